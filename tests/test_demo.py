"""`sglang-supervisor demo` end to end: the seed's night, both scenarios, side by side; a held port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from harness import REPO

from supervisor.core.config import load_config

pytestmark = pytest.mark.integration


def _argv(*args: str) -> list[str]:
    test_id = os.environ.get("SGLANG_SUPERVISOR_TEST_ID", "")
    return [sys.executable, "-m", "supervisor.cli", "demo", "--report", "none",
            "--set", f'server.env={{SGLANG_SUPERVISOR_TEST_ID="{test_id}"}}', *args]


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp_path)}  # the demo keeps its logs in a temp dir


def _demo(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_argv(*args), capture_output=True, text=True, cwd=REPO, timeout=300, env=_env(tmp_path))


def _status_config(stdout: str) -> Path:
    """The config file the demo printed for `sglang-supervisor status --config`."""
    line = next(line for line in stdout.splitlines() if line.startswith("look again: "))
    return Path(line.split("status --config ", 1)[1].split()[0])


def test_two_demos_side_by_side_each_on_its_own_ports(tmp_path, no_leftovers):
    """Two demos at once, neither told a port (the oom night and the preempt night), both pass:
    each picks free ports. The first is given a metrics port the test holds: it says so, names
    the holder, and does not advertise a metrics URL. Each prints a config that `status` reads."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        metrics_port = held.getsockname()[1]
        procs = [
            subprocess.Popen(_argv("--metrics-port", str(metrics_port)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(tmp_path)),
            subprocess.Popen(_argv("--scenario", "preempt"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, env=_env(tmp_path)),
        ]
        outs = [p.communicate(timeout=300) for p in procs]
    (oom, oom_err), (preempt, preempt_err) = outs
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "cuda_oom_runtime" in oom and "mem_fraction_static=0.88" in oom and "FAIL" not in oom
    assert "headroom guard" in preempt and "CRASH" not in preempt and "FAIL" not in preempt
    assert "Traceback" not in oom_err + preempt_err
    assert (f"demo: the metrics port 127.0.0.1:{metrics_port} is in use by pid {os.getpid()} "
            f"({psutil.Process().name()})") in oom  # under xdist the name is its worker's title and "the demo runs without metrics" in oom
    assert "metrics: http" not in oom and "metrics: http://127.0.0.1:" in preempt
    configs = [load_config(_status_config(out)) for out in (oom, preempt)]
    assert configs[0].server.port != configs[1].server.port
    assert configs[0].state.dir != configs[1].state.dir and f"state in {configs[0].state.dir}" in oom
    assert Path(configs[0].state.dir, "state.json").exists()


def test_a_demo_on_a_held_port_says_who_holds_it(tmp_path):
    """--port on a port in use: one line naming the port and its holder, exit 1, at once."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = _demo(tmp_path, "--port", str(port))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr == (f"demo: the simulated SGLang's port 127.0.0.1:{port} is in use by pid {os.getpid()} "
                        f"({psutil.Process().name()}): pass --port N for another, or leave --port out for a free one\n")


def test_without_the_sim_extra_the_demo_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A production install has neither setproctitle nor aiohttp (the daemon speaks HTTP by
    h11): the demo says which, and how to get them, in one line."""
    import importlib.util

    from supervisor.cli import registry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("setproctitle", "aiohttp") else real(name, *a))
    why = registry.sim_missing()
    assert why is not None and "(setproctitle, aiohttp)" in why and "[sim]" in why and "\n" not in why
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert registry.sim_missing() is None
