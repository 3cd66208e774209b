"""Log pass-through (issue 8, row 5): does capturing the server's output slow the server?

The flood child (``bench/flood.py``) writes N SGLang-like lines as fast as it can and
stamps its first and last write. Its wall time is measured under our daemon (pipe ->
size-rotated ``server.log`` + the in-memory tail), under supervisord (pipe ->
``stdout_logfile``), piped into ``cat > file`` (the fastest honest consumer), straight to
a file and to /dev/null. Two children: ``format`` formats each chunk as it goes, as a real
server does; ``raw`` has everything formatted before the clock starts, so the consumer is
the only thing it waits for. The flood starts 1 s after the child (a supervisor's own
start-up is the cold-start row's business). The consumers take turns, in a rotating order.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from . import flood
from .common import (
    FLOOD,
    PY,
    Daemon,
    Row,
    Section,
    Settings,
    Stat,
    child_env,
    daemon_sections,
    read_stamps,
    reap_tagged,
    server_argv,
    wait_until,
    write_toml,
)
from .supervisord import Supervisord

CONSUMERS = ("ours", "supervisord", "cat", "file", "devnull")
MODES = ("format", "raw")


# Issue 36's goal (issue 8's was 1.05×: a Python pump that writes a log, keeps a tail and
# spots words in what it reads does three things `cat` does not).
VS_CAT_GOAL = 1.5
SETTLE_S = 1.0  # the flood starts this long after the child, once its supervisor has settled


def _child(count: int, stamps: Path, mode: str) -> list[str]:
    return [PY, "-I", "-S", str(FLOOD), str(count), str(stamps), mode, str(SETTLE_S)]


def _elapsed(stamps: Path) -> float | None:
    s = read_stamps(stamps)
    return s[1] - s[0] if len(s) >= 2 else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class _Run:
    """One consumer of one flood: starts it, waits for the flood and its capture, cleans up."""

    def __init__(self, settings: Settings, exe: Path, work: Path, count: int, mode: str, expected: int) -> None:
        self.settings, self.exe, self.work = settings, exe, work
        self.count, self.mode, self.expected = count, mode, expected
        self.stamps = work / "flood.stamps"
        self.deadline = 60 + count / 2000

    def _until_done(self, captured: Path, alive: Callable[[], bool]) -> float:
        wait_until(lambda: _elapsed(self.stamps) is not None or not alive(), self.deadline, "the flood")
        wait_until(lambda: _size(captured) >= self.expected or not alive(), self.deadline, "the capture")
        elapsed = _elapsed(self.stamps)
        if elapsed is None or _size(captured) < self.expected:
            raise RuntimeError(f"flood incomplete in {self.work}: {_size(captured)} of {self.expected} bytes")
        return elapsed

    def ours(self) -> float:
        sections = daemon_sections(self.settings, self.work, _child(self.count, self.stamps, self.mode), {
            "gpu": {"backend": "none"}, "health": {"startup_poll_s": 2.0},
        })
        daemon = Daemon(self.settings, self.work, sections)
        try:
            return self._until_done(daemon.server_log, lambda: daemon.proc.poll() is None)
        finally:
            daemon.stop()
            reap_tagged(self.settings.tag)

    def supervisord(self) -> float:
        sections = daemon_sections(self.settings, self.work, _child(self.count, self.stamps, self.mode))
        argv = server_argv(write_toml(self.work / "argv.toml", sections))
        sv = Supervisord(self.exe, self.work, argv, child_env(self.settings), autorestart=False)
        try:
            return self._until_done(sv.child_log, sv.alive)
        finally:
            sv.stop()
            reap_tagged(self.settings.tag)

    def plain(self, how: str) -> float:
        out = self.work / "out.log"
        argv = _child(self.count, self.stamps, self.mode)
        env = child_env(self.settings)
        procs: list[subprocess.Popen[bytes]] = []
        with open(out, "wb") as f:
            if how == "cat":
                child = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
                assert child.stdout is not None
                procs = [child, subprocess.Popen(["cat"], stdin=child.stdout, stdout=f, env=env)]
                child.stdout.close()
            else:
                target = subprocess.DEVNULL if how == "devnull" else f
                procs = [subprocess.Popen(argv, stdout=target, env=env)]
        try:
            wait_until(lambda: _elapsed(self.stamps) is not None or procs[0].poll() is not None,
                       self.deadline, f"the flood into {how}")
        finally:
            for p in procs[:1]:
                p.kill()
            for p in procs:
                p.wait(30)
        elapsed = _elapsed(self.stamps)
        if elapsed is None:
            raise RuntimeError(f"the flood into {how} did not finish")
        return elapsed


def run(settings: Settings, exe: Path) -> Section:
    count = 20_000 if settings.quick else 500_000
    expected = sum(len(line.encode()) for line in flood.lines(count))
    times: dict[str, dict[str, list[float]]] = {m: {c: [] for c in CONSUMERS} for m in MODES}
    for r in range(settings.repeats):
        order = CONSUMERS[r % len(CONSUMERS):] + CONSUMERS[: r % len(CONSUMERS)]
        for mode in MODES:
            for who in order:
                job = _Run(settings, exe, settings.dir(f"logs-{mode}-{who}-{r}"), count, mode, expected)
                t = job.ours() if who == "ours" else job.supervisord() if who == "supervisord" else job.plain(who)
                times[mode][who].append(t)
    section = Section("logs", raw={"lines": count, "bytes": expected, "seconds": times})
    for mode in MODES:
        t = times[mode]
        vs_cat = Stat.of([o / c for o, c in zip(t["ours"], t["cat"], strict=True)])
        sv_vs_cat = Stat.of([s / c for s, c in zip(t["supervisord"], t["cat"], strict=True)])
        ours, theirs = Stat.of(t["ours"]), Stat.of(t["supervisord"])
        what = "formatted as written" if mode == "format" else "pre-formatted: the consumer is the limit"
        base = ", ".join(f"{name} {Stat.of(t[key]).value:.3f} s" for key, name in
                         (("cat", "`cat > file`"), ("file", "straight to a file"), ("devnull", "/dev/null")))
        section.rows += [
            Row(f"logs_{mode}", f"log pass-through, {count:,} lines ({what}): child's wall time", "s",
                ours, theirs, "≤ supervisord", ours.value <= theirs.value, note=base),
            Row(f"logs_{mode}_vs_cat", f"log pass-through ({mode}) ÷ `cat > file`, paired per repeat", "×",
                vs_cat, sv_vs_cat, f"≤ {VS_CAT_GOAL}×", vs_cat.value <= VS_CAT_GOAL),
        ]
    return section
