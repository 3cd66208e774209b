"""Security: loopback binds, no shell, file modes, no secret in any log, the server's env.

- Metrics (and any other listening socket of the daemon) bind 127.0.0.1 unless configured.
- No ``shell=True``, ``os.system``, ``os.popen`` or shell-spawning asyncio call anywhere in
  our Python code (an AST scan, so a comment or a string does not count).
- A config file that group or others may write is refused: it sets a command line run as
  the service user. A password file that others may read gets a warning.
- The MQTT password and tokens given to the server never appear in a log, the state
  directory or the server's command line, even at debug level with a broker refusing them.
- The server's environment holds only what the config names (``pass_env`` and ``env``).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import signal
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import free_port, wait_until
from harness import REPO, DaemonRun, ProcessWatch, write_config

from supervisor.core.config import ConfigError, MetricsConfig, MqttConfig, ServerConfig, load_config
from supervisor.sinks import logs
from supervisor.sinks.metrics_endpoint import start_metrics_server
from tests.edge import edge
from tests.test_alerts import alerter as wired

LOOPBACK = {"127.0.0.1", "::1"}


@contextmanager
def daemon(tmp_path: Path, sections: dict[str, dict[str, Any]] | None = None, *,
           sim_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[DaemonRun]:
    """A daemon on a fast config; afterwards it is stopped (SIGTERM: exit 0), there were
    never two servers, and nothing of it is left."""
    cfg = write_config(tmp_path, sections, sim_args=sim_args)
    port = int(next(line.split("=")[1] for line in cfg.read_text().splitlines() if line.startswith("port =")))
    watch = ProcessWatch(port, gpu_dir=tmp_path / "gpus")
    d = DaemonRun(cfg, env=env)
    watch.add_root(d.proc.pid)
    try:
        yield d
    finally:
        code = d.stop()
        servers = watch.close()
        try:
            wait_until(lambda: not watch.leftovers(), timeout=15, what="no leftover process")
        finally:
            for text in watch.leftovers():
                with contextlib.suppress(psutil.Error):
                    psutil.Process(int(text.split()[0])).kill()
    assert code == 0 and servers <= 1


# --- loopback ---------------------------------------------------------------------------------


async def test_metrics_bind_loopback_by_default() -> None:
    """The default [metrics] listen is loopback, and the socket really is bound there."""
    host, _, _ = MetricsConfig().listen.rpartition(":")
    assert host == "127.0.0.1"
    assert ServerConfig().host == "127.0.0.1"  # the SGLang server too, unless configured
    from prometheus_client import CollectorRegistry

    server = await start_metrics_server(f"{host}:0", CollectorRegistry())
    try:
        listening = [c for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port]
        assert listening and all(c.laddr.ip in LOOPBACK for c in listening)
    finally:
        await server.close()


def test_running_daemon_listens_on_loopback_only(tmp_path: Path) -> None:
    """Every listening socket of a running daemon (metrics, any status endpoint) and of the
    server it launched is on loopback."""
    metrics = free_port()
    with daemon(tmp_path, {"metrics": {"enabled": True, "listen": f"127.0.0.1:{metrics}"}}) as d:
        d.wait_for("server_ready")
        server = psutil.Process(int(d.find("launch")[0]["pid"]))
        for proc in (psutil.Process(d.proc.pid), server):
            listening = [c for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
            assert listening, proc
            assert all(c.laddr.ip in LOOPBACK for c in listening), listening
        assert any(c.laddr.port == metrics for c in psutil.Process(d.proc.pid).net_connections("inet"))


# --- no shell ---------------------------------------------------------------------------------

SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
               ("asyncio", "create_subprocess_shell")}


def our_python_files() -> list[Path]:
    """Our own Python sources: supervisor/, tests/, bench/, scripts/ (no virtualenvs)."""
    files = []
    for top in ("supervisor", "tests", "bench", "scripts"):
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).parts
            if any(p.startswith(".") or p in ("__pycache__", "site-packages") for p in parts):
                continue
            files.append(path)
    return files


def shell_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each call that would run a shell."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):  # ``from os import system`` hides the owner
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if (node.module, a.name) in SHELL_CALLS]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if (owner, name) in SHELL_CALLS or name in ("subprocess_shell", "create_subprocess_shell"):
            found.append((node.lineno, f"{owner + '.' if owner else ''}{name}()"))
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append((node.lineno, f"{name}(shell=...)"))
    return found


def test_the_scan_finds_a_shell_when_there_is_one() -> None:
    """The scanner itself: each forbidden form is found, a string mentioning them is not."""
    code = ("import os, subprocess, asyncio\nos.system('x')\nos.popen('x')\nsubprocess.run('x', shell=True)\n"
            "subprocess.run(['x'], shell=flag)\nasyncio.create_subprocess_shell('x')\n"
            "subprocess.run(['x'], shell=False)\ntext = 'shell=True os.system'\nfrom os import popen\n"
            "import platform\nplatform.system()\n")
    assert sorted(line for line, _ in shell_uses(ast.parse(code))) == [2, 3, 4, 5, 6, 9]


def test_no_shell_anywhere_in_our_code() -> None:
    """No shell=True, os.system, os.popen or shell subprocess in any of our Python files."""
    files = our_python_files()
    assert any(p.name == "daemon.py" for p in files) and len(files) > 20
    offences = [f"{p.relative_to(REPO)}:{line}: {what}" for p in files
                for line, what in shell_uses(ast.parse(p.read_bytes(), filename=str(p)))]
    assert not offences, offences


# --- file modes -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646, 0o620, 0o602, 0o660, 0o777])
def test_config_writable_by_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    """Group- or world-writable: refused with one line that says how to fix it."""
    cfg = write_config(tmp_path)
    cfg.chmod(mode)
    with pytest.raises(ConfigError, match="writable by group or others") as err:
        load_config(cfg)
    assert "chmod go-w" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600, 0o444, 0o400])
def test_config_only_the_owner_may_write_is_accepted(tmp_path: Path, mode: int) -> None:
    """Readable by others is fine; only writes matter."""
    cfg = write_config(tmp_path)
    cfg.chmod(mode)
    written = tomllib.loads(cfg.read_text())["server"]
    loaded = load_config(cfg).server
    assert (loaded.port, loaded.command) == (written["port"], tuple(written["command"]))


def test_daemon_refuses_to_start_or_reload_a_writable_config(tmp_path: Path) -> None:
    """``run`` on a group-writable config exits 2 before touching anything; a config that
    becomes writable while the daemon runs is refused at SIGHUP and the old one kept."""
    cfg = write_config(tmp_path)
    cfg.chmod(0o664)
    refused = DaemonRun(cfg)
    assert refused.proc.wait(60) == 2
    refused.kill()
    assert "writable by group or others" in refused.log_path.read_text()
    assert not (tmp_path / "state").exists()
    cfg.chmod(0o644)
    with daemon(tmp_path) as d:
        d.wait_for("server_ready")
        d.config.chmod(0o666)
        d.proc.send_signal(signal.SIGHUP)
        reload = d.wait_for("config_reloaded")
        assert reload["ok"] is False and "writable by group or others" in reload["error"]
        d.config.chmod(0o644)


class RecordingLogger:
    """A structlog-shaped logger that records (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.records.append((level, event, kw))


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o640, True), (0o604, True), (0o600, False), (0o400, False)])
async def test_password_file_readable_by_others_gets_a_warning(tmp_path: Path, mode: int, warned: bool) -> None:
    """A password file group or others can read: one warning naming the file and the fix."""
    pw = tmp_path / "mqtt.pw"
    pw.write_text("hunter2\n")
    pw.chmod(mode)
    log = RecordingLogger()
    cfg = MqttConfig(enabled=True, port=free_port(), username="u", password_file=str(pw),
                     reconnect_initial_s=0.05, reconnect_max_s=0.1, connect_timeout_s=1.0)
    _, alerter = wired(cfg, host="h", instance="i", logger=log)
    await alerter.start()
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while alerter.connect_failures < 2:  # the file is read before every connect
            assert asyncio.get_running_loop().time() < deadline, log.records
            await asyncio.sleep(0.05)
    finally:
        await alerter.aclose(timeout_s=2)
    warnings = [r for r in log.records if r[1] == "mqtt_password_file_readable_by_others"]
    assert len(warnings) == (1 if warned else 0)
    if warned:
        assert warnings[0][2]["path"] == str(pw) and "chmod 600" in warnings[0][2]["hint"]
    assert not any("hunter2" in repr(r) for r in log.records)


# --- secrets never reach a log ----------------------------------------------------------------


def _all_text_under(root: Path, skip: set[Path]) -> Iterator[tuple[Path, bytes]]:
    for path in root.rglob("*"):
        if path.is_file() and path not in skip:
            yield path, path.read_bytes()


def test_mqtt_password_and_tokens_never_reach_a_log(tmp_path: Path) -> None:
    """A broker that refuses the password, debug logging, a crash: the password, a token in
    [server] env and one passed through the environment appear in no log, no file of the
    state directory, and not in the server's command line."""
    from tests.mosquitto import Broker

    password = f"S3cr3t-pw-{uuid.uuid4().hex}"
    token = f"hf_{uuid.uuid4().hex}"
    passed = f"tok-{uuid.uuid4().hex}"
    pw_file = tmp_path / "mqtt.pw"
    pw_file.write_text(password + "\n")
    pw_file.chmod(0o600)
    with Broker(tmp_path / "broker", users={"chaos": "the-right-one"}) as broker:
        sections = {
            "server": {"env": {"SGLANG_SIM_GPU_DIR": str(tmp_path / "gpus"), "HF_TOKEN": token},
                       "pass_env": ["PATH", "CHAOS_API_TOKEN"]},
            "mqtt": {"enabled": True, "host": broker.host, "port": broker.port, "username": "chaos",
                     "password_file": str(pw_file), "reconnect_initial_s": 0.1, "reconnect_max_s": 0.3},
            "logging": {"level": "debug"},
        }
        with daemon(tmp_path, sections, sim_args=("--sim-fail", "exit0", "--sim-fail-after-s", "0.5"),
                    env={"CHAOS_API_TOKEN": passed}) as d:
            d.wait_for("mqtt_auth_failed", timeout=60)
            d.wait_for("crash")
            server = psutil.Process(int(d.wait_for("launch", attempt=2)["pid"]))
            try:
                seen = " ".join(server.cmdline()) + " ".join(server.environ().values())
            except psutil.Error:
                seen = ""  # already gone: nothing of it to leak
            assert password not in seen
            d.wait_for("server_ready", count=2)
        broker_log = broker.log()
    assert "not authorised" in broker_log  # the broker saw (and refused) our login
    for path, data in _all_text_under(tmp_path, skip={pw_file, tmp_path / "test.toml"}):  # they hold them
        for secret in (password, token, passed):
            assert secret.encode() not in data, f"{secret[:8]}... found in {path}"


def test_secret_flags_are_redacted_in_the_launch_line() -> None:
    """``--api-key X``, ``--api-key=X`` and other secret flags in the argv are logged as ***."""
    stream = io.StringIO()
    sink = logs.LogSink(logs.configure("json", "info", stream))
    argv = ["python", "-m", "sglang.launch_server", "--api-key", "k-1", "--hf-token=t-2", "--admin-api-key", "a-3", "--port", "1"]
    sink.emit(edge("launch", {"argv": argv}))
    out = stream.getvalue()
    assert "k-1" not in out and "t-2" not in out and "a-3" not in out and "***" in out and "--port" in out


# --- the server's environment -----------------------------------------------------------------


def test_server_environment_holds_only_what_the_config_names(tmp_path: Path) -> None:
    """A variable of the daemon's environment reaches the server only through pass_env;
    the [server] env table always does."""
    env = {"CHAOS_SECRET_NOT_PASSED": "s-1", "CHAOS_PASSED": "p-2", "NOTIFY_SOCKET": "/run/nope"}
    sections = {"server": {"pass_env": ["PATH", "HOME", "CHAOS_PASSED", "PYTHONPATH", "VIRTUAL_ENV"],
                           "env": {"SGLANG_SIM_GPU_DIR": str(tmp_path / "gpus"), "CHAOS_TABLE": "t-3"}}}
    with daemon(tmp_path, sections, env=env) as d:
        d.wait_for("server_ready")
        pid = int(d.find("launch")[0]["pid"])
        server_env = psutil.Process(pid).environ()
    assert server_env.get("CHAOS_PASSED") == "p-2"
    assert server_env.get("CHAOS_TABLE") == "t-3"
    assert "CHAOS_SECRET_NOT_PASSED" not in server_env and "NOTIFY_SOCKET" not in server_env
    # plus our ownership mark: the daemon's instance id and the launch's nonce
    allowed = {"PATH", "HOME", "CHAOS_PASSED", "PYTHONPATH", "VIRTUAL_ENV", "SGLANG_SIM_GPU_DIR", "CHAOS_TABLE",
               "SGLANG_SUPERVISOR_INSTANCE", "SGLANG_SUPERVISOR_LAUNCH"}
    assert set(server_env) <= allowed, set(server_env) - allowed
    assert server_env["SGLANG_SUPERVISOR_LAUNCH"] == d.find("launch")[0]["launch_id"]


def test_pass_env_patterns_and_the_default_list() -> None:
    """pass_env takes shell patterns; the defaults carry what SGLang reads (tokens, NCCL_*,
    SGLANG_*, CUDA_*, the allocator, the loader path) and nothing else; the mark wins."""
    from supervisor.core.config import DEFAULT_PASS_ENV
    from supervisor.core.ownership import server_env

    environ = {"NCCL_DEBUG": "INFO", "SGLANG_USE_CPU_ENGINE": "1", "HF_TOKEN": "hf_x", "CUDA_VISIBLE_DEVICES": "0,1",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "LD_LIBRARY_PATH": "/opt/x", "AWS_SECRET": "s",
               "SGLANG_SUPERVISOR_INSTANCE": "spoofed"}
    env = server_env(DEFAULT_PASS_ENV, {"X": "1"}, environ, {"SGLANG_SUPERVISOR_INSTANCE": "ours"})
    assert env == {**{k: v for k, v in environ.items() if k != "AWS_SECRET"}, "X": "1",
                   "SGLANG_SUPERVISOR_INSTANCE": "ours"}
