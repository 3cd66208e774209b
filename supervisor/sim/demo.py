"""``sglang-supervisor demo``: the seed's night, replayed against the simulator.

Scenario ``oom`` (default): launch at 0.93 with 0.82 GB of headroom; a burst of 150 short
and 32 long concurrent requests (each retried across restarts) dies with a CUDA OOM in
``deepseek_v2.py forward``; the supervisor reads the traceback (``cuda_oom_runtime``),
relaunches at 0.88, and the load completes. Scenario ``preempt``: the headroom guard sees
0.82 GB after CUDA-graph capture and steps down to 0.88 before any traffic: no crash.

It needs no GPU and no broker. It prints a short human timeline and exits 0 when the
night ended as the policy promises.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import json
import os
import socket
import sys
import tempfile
import time
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from supervisor.aio import within
from supervisor.core.config import Config, ConfigError, load_config, parse_override
from supervisor.core.events import Event

if TYPE_CHECKING:  # loadgen (aiohttp) is imported only when the demo runs
    from supervisor.sim.loadgen import LoadResult

DEMO_CONFIG = Path(__file__).resolve().parent / "demo.toml"  # package data: in the wheel too


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=str(DEMO_CONFIG), help="demo config (default: supervisor/sim/demo.toml)")
    p.add_argument("--scenario", choices=("oom", "preempt"), default="oom")
    p.add_argument("--port", type=int, metavar="N",
                   help="the simulated SGLang's port (default: a free one; or --set server.port=N)")
    p.add_argument("--metrics-port", type=int, metavar="N",
                   help="the metrics endpoint's port (default: a free one; or --set metrics.listen=HOST:N)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a config key; the value is read as TOML (a bare word is a string)",
    )
    p.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep supervising this long after the scenario (for scraping, for a look)")
    p.add_argument("--log-json", action="store_true", help="JSON log lines to stderr instead of a file")
    p.add_argument("--deadline", type=float, default=240.0, metavar="SECONDS",
                   help="give the scenario up after this long (exit 1)")
    p.add_argument("--report", default="", metavar="PATH",
                   help="where to write the night's report (default: report.html in the demo's directory; "
                        "'none': no report)")


class Timeline:
    """An EventSink that prints the night as a person would tell it."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.start = time.monotonic()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.ready = asyncio.Event()
        self.state = "STOPPED"
        self.fraction: float | None = None

    def _say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {text}", file=self.out, flush=True)

    def emit(self, typed: Event) -> None:
        event, f = typed.kind, typed.fields()
        self.events.append((event, f))
        if event == "launch":
            self.fraction = f["mem_fraction_static"]
            self._say(f"launch #{f['attempt']}: SGLang (simulated) at mem_fraction_static={f['mem_fraction_static']:g}, pid {f['pid']}")
        elif event == "state_changed":
            self.state = f["to"]
            if f["to"] == "READY":
                self.ready.set()
            else:
                self.ready.clear()
        elif event == "server_ready":
            self._say(f"server ready after {f['startup_s']:.1f} s at {f['mem_fraction_static']:g}")
        elif event == "startup_facts" and f.get("avail_mem_after_capture_gb") is not None:
            self._say(f"startup facts: {f['avail_mem_after_capture_gb']:g} GB left after CUDA-graph capture, "
                      f"max_total_num_tokens={f.get('max_total_num_tokens')}")
        elif event == "headroom_low":
            act = f"stepping down to {f['next_mem_fraction_static']:g} before traffic arrives" if f["action"] == "step_down" else "warning only"
            self._say(f"headroom guard: {f['avail_mem_gb']:g} GB < {f['threshold_gb']:g} GB on {f['rank']}: {act}")
        elif event == "server_down":
            who = "its main process" if f.get("title") == "main" else f"{f.get('title')} (pid {f.get('pid')})"
            self._say(f"DOWN: {who} died; reading the log while SGLang tears itself down")
        elif event == "crash":
            where = f" at {f['location']}" if f.get("location") else ""
            self._say(f"CRASH: {f['cause']} ({f['phase']}){where}, {f.get('exc_type') or ''} - remedy {f['remedy']}")
            if f.get("evidence"):
                self._say(f"  evidence: {f['evidence'][0][:140]}")
        elif event == "restart_scheduled":
            self._say(f"restart in {f['delay_s']:.1f} s at mem_fraction_static={f['mem_fraction_static']:g}")
        elif event == "recovered":
            self._say(f"recovered from {f['cause']} at {f['mem_fraction_static']:g}")
        elif event == "gave_up":
            self._say(f"GAVE UP: {f['reason']}")
        elif event == "preflight_failed":
            for check in f["checks"]:
                if not check["ok"]:
                    self._say(f"preflight failed: {check['name']}: {check['detail']}")
        elif event == "preflight_retry":
            self._say(f"retrying in {f['delay_s']:.1f} s ({f['cause']}: {f['detail']})")

    def count(self, event: str, **match: Any) -> int:
        return sum(1 for e, f in self.events if e == event and all(f.get(k) == v for k, v in match.items()))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the kernel's pick), so that demos run side by side."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _given(overrides: list[str], key: str) -> bool:
    return any(item.split("=", 1)[0].strip() == key for item in overrides)


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def demo_overrides(args: argparse.Namespace, data: dict[str, Any], workdir: Path) -> list[str]:
    """The scenario's settings, the ports (the user's, else free ones), then the user's --set."""
    action = "step_down" if args.scenario == "preempt" else "warn"
    base = [
        f"state.dir={workdir / 'state'}",
        f"gpu.sim_dir={workdir / 'gpus'}",
        f'gpu.headroom_action="{action}"',
        "report.gpu_sample_s=1",  # the morning report of a two-minute night: one GPU record a second
        "report.keep_days=1",
    ]
    server_host = _local(str(data.get("server", {}).get("host", "127.0.0.1")))
    if args.port is not None:
        base.append(f"server.port={args.port}")
    elif not _given(args.overrides, "server.port"):
        base.append(f"server.port={free_port(server_host)}")
    metrics_host = str(data.get("metrics", {}).get("listen", "127.0.0.1:9188")).rpartition(":")[0] or "127.0.0.1"
    if args.metrics_port is not None:
        base.append(f'metrics.listen="{metrics_host}:{args.metrics_port}"')
    elif not _given(args.overrides, "metrics.listen"):
        base.append(f'metrics.listen="{metrics_host}:{free_port(_local(metrics_host))}"')
    return [*base, *args.overrides]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"demo: cannot write {v!r} back as TOML")


def _key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) and k.isascii() else json.dumps(k)


def to_toml(data: dict[str, Any]) -> str:
    """A parsed config written back: top-level arrays (``[[server]]``) inline, then one table a section."""
    head = [f"{_key(k)} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    tables = [f"[{_key(k)}]\n" + "".join(f"{_key(key)} = {_toml_value(x)}\n" for key, x in v.items())
              for k, v in data.items() if isinstance(v, dict)]
    return "\n".join([*head, *tables])


def demo_config(args: argparse.Namespace, workdir: Path) -> tuple[Config, Path]:
    """The demo's config (supervisor/sim/demo.toml, the scenario's settings, free ports, then the
    user's --set), written whole to WORKDIR/demo.toml so that ``status``, ``report`` and
    ``explain --config`` can be pointed at it; and that file's path."""
    source = Path(args.config)
    try:
        data = tomllib.loads(source.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    for item in demo_overrides(args, data, workdir):
        section, key, value = parse_override(item)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {item!r}: [{section}] is not a table in {source}")
        table[key] = value
    written = workdir / "demo.toml"
    fd = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"# sglang-supervisor demo: {source} with the demo's settings and --set\n" + to_toml(data))
    cfg = load_config(written)
    server = cfg.server
    command = server.command
    if command and command[0] in ("python", "python3"):
        command = (sys.executable, *command[1:])  # the simulator runs in this interpreter
    env = {"SGLANG_SIM_GPU_DIR": cfg.gpu.sim_dir, **server.env}
    if cfg.gpu.backend == "simulated":
        from supervisor.sim import simgpu

        simgpu.ensure_gpus(cfg.gpu.sim_dir, 8, 96)  # the seed's cards: 96 GB each
    return dataclasses.replace(cfg, server=dataclasses.replace(server, command=command, env=env)), written


def port_holder(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (who holds it, when this user may see it), or None."""
    try:
        infos = socket.getaddrinfo(_local(host), port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return exc.strerror or str(exc)
        else:
            return None
    import psutil

    holders = []
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                try:
                    holders.append(f"pid {c.pid} ({psutil.Process(c.pid).name()})")
                except psutil.Error:
                    holders.append(f"pid {c.pid}")
    except psutil.Error:
        pass
    return "in use by " + (", ".join(sorted(set(holders))) if holders else "another process (not one this user can see)")


DaemonRunner = Callable[..., Awaitable[int]]
"""The CLI's ``run_daemon_async``: the demo runs the real daemon, built by the CLI's
composition root (this package never imports the CLI)."""

ReportWriter = Callable[[Config, Path], Path]
"""The CLI's report writer: (config, where) -> the path of the night's report it wrote."""


def run(args: argparse.Namespace, run_daemon: DaemonRunner, write_report: ReportWriter | None = None) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sglang-supervisor-demo-"))
    cfg, config_file = demo_config(args, workdir)
    held = port_holder(cfg.server.host, cfg.server.port)
    if held is not None:
        print(f"demo: the simulated SGLang's port {_local(cfg.server.host)}:{cfg.server.port} is {held}: "
              "pass --port N for another, or leave --port out for a free one", file=sys.stderr)
        return 1
    if cfg.metrics.enabled:
        host, _, port = cfg.metrics.listen.rpartition(":")
        held = port_holder(host, int(port))
        if held is not None:
            print(f"demo: the metrics port {cfg.metrics.listen} is {held}: the demo runs without metrics "
                  "(--metrics-port N for another)", file=sys.stdout)
            cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, enabled=False))
    code = asyncio.run(_run(args, cfg, workdir, run_daemon, config_file))
    if write_report is not None and args.report != "none":
        try:
            path = write_report(cfg, Path(args.report) if args.report else workdir / "report.html")
        except Exception as exc:  # noqa: BLE001 - the night went as it went; the report is a bonus
            print(f"the night's report could not be written: {exc}", file=sys.stdout)
        else:
            print(f"the night's report: {path}", file=sys.stdout)
    print(f"look again: sglang-supervisor status --config {config_file}  "
          f"(report: sglang-supervisor report --config {config_file} --format text)", file=sys.stdout)
    return code


async def _run(
    args: argparse.Namespace, cfg: Config, workdir: Path, run_daemon_async: DaemonRunner, config_file: Path,
) -> int:
    from supervisor.sim.loadgen import run_load

    out = sys.stdout
    timeline = Timeline(out)
    log_path = workdir / "supervisor.jsonl"
    log_file: IO[str] = sys.stderr if args.log_json else log_path.open("w", buffering=1)  # noqa: SIM115
    print(f"sglang-supervisor demo ({args.scenario}): SGLang and the GPUs are simulated; "
          f"state in {cfg.state.dir}", file=out)
    if not args.log_json:
        print(f"JSON log lines: {log_path}", file=out)
    if cfg.metrics.enabled:
        print(f"metrics: http://{cfg.metrics.listen}/metrics", file=out)
    print(f"its config: {config_file}; while it runs or after: "
          f"sglang-supervisor status --config {config_file}", file=out)

    daemon_box: dict[str, Any] = {}
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        try:
            await within(timeline.ready.wait(), args.deadline)
            host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "") else cfg.server.host
            url = f"http://{host}:{cfg.server.port}"
            timeline._say("load: 150 short + 32 long concurrent requests (retried across restarts)")
            result = await run_load(url, deadline_s=args.deadline)
            outcome["load"] = result
            timeline._say(f"load done: {result.completed} completed, {result.failed} failed, "
                          f"{result.retries} retries, {result.elapsed_s:.1f} s")
            await within(timeline.ready.wait(), args.deadline)
            if args.hold > 0:
                timeline._say(f"holding for {args.hold:g} s")
                await asyncio.sleep(args.hold)
        except TimeoutError:
            outcome["timeout"] = True
            timeline._say(f"deadline of {args.deadline:g} s passed")
        finally:
            daemon = daemon_box.get("daemon")
            if daemon is not None:
                daemon.request_stop("demo finished")

    task = asyncio.create_task(scenario())
    try:
        code = await run_daemon_async(
            cfg, extra_sinks=[timeline], log_stream=log_file,
            on_daemon=lambda d: daemon_box.__setitem__("daemon", d),
        )
    finally:
        task.cancel()
        if log_file is not sys.stderr:
            log_file.close()
    return _verdict(args.scenario, timeline, outcome, code, out)


def _verdict(scenario: str, t: Timeline, outcome: dict[str, Any], code: int, out: IO[str]) -> int:
    load: LoadResult | None = outcome.get("load")
    crashes = t.count("crash")
    ooms = t.count("crash", cause="cuda_oom_runtime")
    checks = {
        "daemon exited cleanly": code == 0,
        "load completed": load is not None and load.failed == 0 and load.completed == 182,
        "final fraction 0.88": t.fraction is not None and abs(t.fraction - 0.88) < 1e-9,
    }
    if scenario == "oom":
        checks["one runtime CUDA OOM, read as cuda_oom_runtime"] = ooms == 1 and crashes == 1
    else:
        checks["stepped down before any crash"] = crashes == 0 and t.count("headroom_low", action="step_down") == 1
    print("", file=out)
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}", file=out)
    good = all(checks.values())
    print("demo: " + ("the supervisor handled the night as promised" if good else "something went wrong"), file=out)
    return 0 if good else 1
