"""Crash noticed, crash diagnosed, relaunch overhead (issue 8, rows 1 and 2).

A fast crash loop: the simulator dies of a runtime CUDA OOM (the real traceback, SIGQUIT,
SIGKILL of its tree) 0.05 s after it is ready and writes ``monotonic_ns`` just before; the
server runs behind the stamping trampoline, which writes the moment of every exec.

- noticed: stamp -> our ``state_changed`` out of STARTING/READY; supervisord's ``exited:``.
- diagnosed: stamp -> our ``crash`` event (its cause read from the traceback).
- relaunch: stamp -> the next exec of the server, backoff 0, the simulated GPUs checked free
  (ours); supervisord restarts without any check.
- the floor: the same simulator run by a parent blocked in ``waitpid()`` (no event loop):
  how soon anyone can know on this machine.

The fraction ladder is long (0.93 down in steps of 0.005) and the simulated weights small,
so that a runtime OOM steps down a rung each time without reaching the floor.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from .common import (
    Daemon,
    Row,
    Section,
    Settings,
    child_env,
    daemon_sections,
    event_is,
    follow,
    interleaved,
    ms,
    pooled,
    read_stamps,
    reap_tagged,
    server_argv,
    simulator,
    state_left,
    trampoline,
    wait_until,
    write_toml,
)
from .supervisord import Supervisord

TICK_MS = 1000.0  # supervisord's main-loop poll timeout


def _sections(settings: Settings, work: Path, crashes: int) -> dict[str, dict[str, Any]]:
    sim = simulator(
        "--sim-load-s", "0.05", "--sim-fail", "runtime_oom", "--sim-fail-after-s", "0.05",
        "--sim-crash-stamp", str(work / "crash.stamps"), "--sim-weights-gb", "1",
    )
    ladder = [round(0.93 - 0.005 * i, 4) for i in range(crashes + 20)]
    return daemon_sections(settings, work, trampoline(work / "exec.stamps", sim), {
        "policy": {"fraction_ladder": ladder},
        "health": {"startup_poll_s": 0.05},
    })


def _enough(work: Path, crashes: int) -> bool:
    """``crashes`` crashes happened and the last one was relaunched."""
    return len(read_stamps(work / "exec.stamps")) > crashes and len(read_stamps(work / "crash.stamps")) >= crashes


def _ours(settings: Settings, work: Path, crashes: int) -> dict[str, list[float]]:
    daemon = Daemon(settings, work, _sections(settings, work, crashes))
    try:
        wait_until(lambda: _enough(work, crashes) or daemon.proc.poll() is not None, 30 + 10 * crashes,
                   f"{crashes} crashes under our daemon")
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"our daemon exited {daemon.proc.returncode}: {daemon.tail()}")
    finally:
        daemon.stop()
        reap_tagged(settings.tag)
    crash = read_stamps(work / "crash.stamps")[:crashes]
    return {
        "noticed": ms(follow(crash, daemon.monos(state_left("STARTING", "READY")))),
        "diagnosed": ms(follow(crash, daemon.monos(event_is("crash")))),
        "relaunch": ms(follow(crash, read_stamps(work / "exec.stamps"))),
    }


def _supervisord(settings: Settings, exe: Path, work: Path, crashes: int) -> dict[str, list[float]]:
    sections = _sections(settings, work, crashes)
    argv = server_argv(write_toml(work / "argv.toml", sections))
    env = {**child_env(settings), **sections["server"]["env"]}
    sv = Supervisord(exe, work, argv, env)
    try:
        wait_until(lambda: _enough(work, crashes) or not sv.alive(), 30 + 10 * crashes,
                   f"{crashes} crashes under supervisord")
    finally:
        sv.stop()
        reap_tagged(settings.tag)
    crash = read_stamps(work / "crash.stamps")[:crashes]
    return {
        "noticed": ms(follow(crash, sv.monos("exited:"))),
        "relaunch": ms(follow(crash, read_stamps(work / "exec.stamps"))),
    }


def _floor(settings: Settings, work: Path, crashes: int) -> dict[str, list[float]]:
    """The same crashes seen by a parent blocked in ``waitpid()``: the floor on this machine."""
    sections = _sections(settings, work, crashes)
    argv = server_argv(write_toml(work / "argv.toml", sections))
    env = {**os.environ, **sections["server"]["env"]}
    seen = []
    try:
        for _ in range(crashes):
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True, env=env, cwd=work)
            guard = threading.Timer(60, proc.kill)  # a simulator that never crashes must not hang us
            guard.start()
            proc.wait()  # no timeout: a plain blocking waitpid()
            seen.append(time.monotonic())
            guard.cancel()
    finally:
        reap_tagged(settings.tag)
    return {"noticed": ms(follow(read_stamps(work / "crash.stamps")[:crashes], seen))}


def run(settings: Settings, exe: Path) -> Section:
    crashes = 3 if settings.quick else 25
    got: dict[str, dict[str, list[list[float]]]] = {"ours": {}, "supervisord": {}, "floor": {}}
    for r in range(settings.repeats):
        for who in (*interleaved(r), "floor"):
            work = settings.dir(f"crash-{who}-{r}")
            if who == "ours":
                one = _ours(settings, work, crashes)
            elif who == "supervisord":
                one = _supervisord(settings, exe, work, crashes)
            else:
                one = _floor(settings, work, crashes)
            for k, v in one.items():
                got[who].setdefault(k, []).append(v)
    ours, theirs, floor = got["ours"], got["supervisord"], got["floor"]["noticed"]
    n = sum(len(v) for v in ours["noticed"])
    section = Section("crash", raw={"crashes_per_repeat": crashes, "ours_ms": ours, "supervisord_ms": theirs,
                                    "floor_ms": floor})
    # The goal is a ratio to the floor measured in the same run: what the daemon adds to what
    # the kernel and the machine's load take anyway.
    floor50, floor99 = pooled(floor, 50).value, pooled(floor, 99).value
    ours50, ours99 = pooled(ours["noticed"], 50).value, pooled(ours["noticed"], 99).value
    floor_note = (f"the floor: a parent blocked in `waitpid()` sees the same crashes after {floor50:.2f} ms (p50) / "
                  f"{floor99:.2f} ms (p99); ours is {ours50 / floor50:.2f}× / {ours99 / floor99:.2f}× the floor")
    section.rows += [
        Row("crash_noticed_p50", "crash → noticed (state leaves READY), p50", "ms", pooled(ours["noticed"], 50),
            pooled(theirs["noticed"], 50), f"≤ 1.2 × the floor ({1.2 * floor50:.2f} ms)", ours50 <= 1.2 * floor50,
            note=floor_note),
        Row("crash_noticed_p99", "crash → noticed (state leaves READY), p99", "ms", pooled(ours["noticed"], 99),
            pooled(theirs["noticed"], 99), f"≤ 1.2 × the floor ({1.2 * floor99:.2f} ms)", ours99 <= 1.2 * floor99,
            note=floor_note),
        Row("crash_diagnosed_p50", "crash → diagnosed (`crash` event), p50", "ms", pooled(ours["diagnosed"], 50),
            note="supervisord does not diagnose"),
        Row("crash_diagnosed_p99", "crash → diagnosed (`crash` event), p99", "ms", pooled(ours["diagnosed"], 99),
            goal="≤ 50 ms", met=pooled(ours["diagnosed"], 99).value <= 50, note="supervisord does not diagnose"),
        Row("relaunch_p50", "relaunch overhead (crash → next exec), p50", "ms", pooled(ours["relaunch"], 50),
            pooled(theirs["relaunch"], 50), "≤ 100 ms", pooled(ours["relaunch"], 50).value <= 100,
            note="ours includes clearing the GPUs (simulated) and preflight; backoff 0"),
        Row("relaunch_p99", "relaunch overhead (crash → next exec), p99", "ms", pooled(ours["relaunch"], 99),
            pooled(theirs["relaunch"], 99)),
    ]
    every = [v for rep in theirs["noticed"] for v in rep]
    fast = [v for v in every if v < TICK_MS / 2]
    section.notes.append(
        f"crash rows: {n} crashes per supervisor ({crashes} × {settings.repeats} runs). supervisord noticed "
        f"{len(fast)} of {len(every)} crashes within {max(fast, default=0):.1f} ms and the rest at its "
        f"{TICK_MS / 1000:g} s tick: its SIGCHLD handler only records the signal and `poll()` is restarted "
        "(PEP 475), so it reaps early only when the child's pipe wakes it after the child became "
        "reapable; it spawns the next one at a tick too."
    )
    return section
