"""``status`` for people and for monitors (issue 33): one line per server in
``supervisorctl status``'s shape, and the LSB exit code ``systemctl is-active`` uses, one
test per code; a give-up's reason shown after a later stop; planned relaunches counted apart.

The state files are written as the daemon writes them (``StateFile.save`` on a ``Core``);
a daemon that runs is one that holds the state directory's lock (``StateStore.acquire``)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from harness import REPO

from supervisor.adapters import procstart
from supervisor.adapters.store import StateStore
from supervisor.cli.status import EXIT_DEAD, EXIT_NO_STATE, EXIT_NOT_RUNNING, EXIT_SERVING, status
from supervisor.core.config import load_config
from supervisor.core.model import Cause, Phase, State
from supervisor.core.state import Core, CrashRecord, GiveUpNote, Hold, Learned, Run
from supervisor.unit.statefile import StateFile


class _Log:
    def warning(self, *a: Any, **k: Any) -> None: ...
    def info(self, *a: Any, **k: Any) -> None: ...


def config(tmp_path: Path, names: tuple[str, ...] = ()) -> Path:
    doc: dict[str, Any] = {"state": {"dir": str(tmp_path / "state")}}
    server = {"command": ["python", "-m", "sglang.launch_server"], "model_path": "/models/kimi", "tp_size": 8}
    if names:
        doc["server"] = [{**server, "name": n, "port": 30000 + i} for i, n in enumerate(names)]
    else:
        doc["server"] = server
    path = tmp_path / "sup.toml"
    path.write_text(tomli_w.dumps(doc))
    return path


def record(cause: Cause, *, planned: bool = False) -> CrashRecord:
    return CrashRecord("2026-12-03T02:00:00+00:00", cause, cause.remedy, Phase.SERVING, "killed by SIGKILL", 0.93,
                       0.88, "torch.OutOfMemoryError: CUDA out of memory.", "deepseek_v2.py:2919 forward", 1,
                       planned=planned)


def write(state_dir: Path, state: State, server_keys: dict[str, Any] | None = None, **core: Any) -> None:
    learned = replace(Learned(0.88, 48, 0.93, 48), history=core.pop("history", ()))
    c = replace(Core(state, learned, run=Run(attempt=3, pid=4242 if state is State.READY else None)), **core)
    server = {"server_pid": c.pid, "server_pgid": c.pid, "server_since": 1.0 if c.pid else None,
              "server_launch": None, "server_tree": [], **(server_keys or {})}
    StateFile(StateStore(str(state_dir)), log=_Log(), emit=lambda e: None,  # type: ignore[arg-type]
              wall_now=lambda: "2026-12-03T03:00:00+00:00").save(c, server, instance_id="i", worker_id=None)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[StateStore]:
    """The state directory's lock held, as a running daemon holds it."""
    store = StateStore(str(tmp_path / "state"))
    store.acquire()
    yield store
    store.release()


def run(path: Path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    cfg = load_config(str(path), [])
    code = status(cfg, as_json="--json" in args, verbose="-v" in args, out=out)
    return code, out.getvalue()


def test_exit_0_when_every_server_serves(tmp_path: Path, running: StateStore) -> None:
    path = config(tmp_path)
    write(tmp_path / "state", State.READY, history=(record(Cause.CUDA_OOM_RUNTIME),))
    code, text = run(path)
    assert code == EXIT_SERVING == 0
    (line,) = text.splitlines()
    assert line.split()[:2] == ["sup", "READY"]
    assert "pid 4242, uptime " in line and "fraction 0.88" in line and "last cuda_oom_runtime" in line


def test_uptime_is_counted_on_the_boots_clock_so_a_wall_clock_step_does_not_move_it(
        tmp_path: Path, running: StateStore) -> None:
    """The daemon records the server's start in this boot's ticks: a spawn time a day off (the
    wall clock stepped since) does not make `status` say a day; a start from another boot is
    not read, and the wall time is the fallback."""
    path = config(tmp_path)
    ours = procstart.started(os.getpid())  # a process that started moments ago
    stepped = {"server_since": time.time() - 86400, "server_started": ours, "server_boot": procstart.boot_id()}
    write(tmp_path / "state", State.READY, server_keys=stepped)
    _, text = run(path)
    uptime = text.split("uptime ")[1].split(",")[0]
    assert "day" not in uptime and uptime.startswith("0:"), text
    write(tmp_path / "state", State.READY, server_keys={**stepped, "server_boot": "another-boot"})
    _, text = run(path)
    assert "uptime 1 day, " in text, text


def test_exit_3_when_a_server_is_held_by_an_operator(tmp_path: Path, running: StateStore) -> None:
    path = config(tmp_path)
    write(tmp_path / "state", State.STOPPED, held=Hold("GPU 3 reseated", "2026-12-03T02:30:00+00:00"))
    code, text = run(path)
    assert code == EXIT_NOT_RUNNING == 3
    assert "STOPPED" in text and "held by an operator since 2026-12-03T02:30:00+00:00: GPU 3 reseated" in text


def test_exit_3_when_a_server_is_starting_or_backing_off(tmp_path: Path, running: StateStore) -> None:
    path = config(tmp_path)
    for state in (State.STARTING, State.BACKOFF, State.PREPARING):
        write(tmp_path / "state", state, reason="backoff 4 s after a crash")
        assert run(path)[0] == EXIT_NOT_RUNNING


def test_exit_3_after_a_clean_stop_of_the_daemon(tmp_path: Path) -> None:
    path = config(tmp_path)
    write(tmp_path / "state", State.STOPPED, reason="SIGTERM")
    code, text = run(path)
    assert code == EXIT_NOT_RUNNING and "STOPPED (last known)" in text and "daemon is not running" in text


def test_exit_1_when_a_server_gave_up_and_why_is_shown_after_a_later_stop(tmp_path: Path) -> None:
    path = config(tmp_path)
    note = GiveUpNote("2026-12-03T02:10:00+00:00", "gpu_hw_error: GPU 3 fell off the bus", "gpu_hw_error",
                      "NVRM: Xid 79: GPU has fallen off the bus", ("python", "-m", "sglang.launch_server", "--tp", "8"))
    with_lock = StateStore(str(tmp_path / "state"))
    with_lock.acquire()
    try:
        write(tmp_path / "state", State.GAVE_UP, gave_up=note)
        assert run(path)[0] == EXIT_DEAD == 1
    finally:
        with_lock.release()
    write(tmp_path / "state", State.STOPPED, reason="SIGTERM", gave_up=note)  # then the daemon was stopped
    code, text = run(path)
    assert "gave up at 2026-12-03T02:10:00+00:00: gpu_hw_error: GPU 3 fell off the bus" in text
    assert "evidence: NVRM: Xid 79" in text and "command:  python -m sglang.launch_server --tp 8" in text
    assert code == EXIT_NOT_RUNNING


def test_exit_1_when_the_daemon_is_not_running_but_the_state_says_it_serves(tmp_path: Path) -> None:
    """A killed daemon (SIGKILL, an OOM kill) leaves READY in its state and no lock."""
    path = config(tmp_path)
    write(tmp_path / "state", State.READY)
    code, text = run(path)
    assert code == EXIT_DEAD and "READY (last known)" in text and "it was killed" in text


def test_exit_4_when_there_is_no_state(tmp_path: Path) -> None:
    code, text = run(config(tmp_path))
    assert code == EXIT_NO_STATE == 4 and "NO STATE" in text


def test_the_worst_server_decides_and_json_says_each_code(tmp_path: Path, running: StateStore) -> None:
    path = config(tmp_path, ("a", "b"))
    cfg = load_config(str(path), [])
    for unit, state in zip(cfg.units, (State.READY, State.GAVE_UP), strict=True):
        store = StateStore(unit.state.dir)
        store.acquire()
        write(Path(unit.state.dir), state)
    code, text = run(path)
    assert code == EXIT_DEAD and [line.split()[:2] for line in text.splitlines() if not line.startswith(" ")] == [
        ["a", "READY"], ["b", "GAVE_UP"]]
    code, text = run(path, "--json")
    doc = json.loads(text)
    assert doc["exit_code"] == 1 and {n: s["exit_code"] for n, s in doc["servers"].items()} == {"a": 0, "b": 1}


def test_planned_restarts_and_climbs_are_counted_apart_from_crashes(tmp_path: Path, running: StateStore) -> None:
    path = config(tmp_path)
    history = (record(Cause.CUDA_OOM_RUNTIME), record(Cause.OPERATOR_RESTART, planned=True),
               record(Cause.CLIMB, planned=True), record(Cause.HEADROOM_LOW, planned=True))
    write(tmp_path / "state", State.READY, history=history)
    code, text = run(path)
    assert "1 crash(es), 3 planned" in text and "last cuda_oom_runtime" in text
    code, text = run(path, "-v")
    assert "1 crash(es); 3 planned relaunch(es): restarts, climbs and 1 step-down(s) for headroom" in text
    assert json.loads(run(path, "--json")[1])["counts"] == {"crashes": 1, "planned": 3, "step_downs": 1}


def test_the_exit_codes_are_in_the_help() -> None:
    out = subprocess.run([sys.executable, "-m", "supervisor.cli", "status", "--help"], capture_output=True,
                         text=True, cwd=REPO, check=True).stdout
    assert all(f"{n} " in out for n in ("0", "3", "1", "4")) and "LSB" in out
