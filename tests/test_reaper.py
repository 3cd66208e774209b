"""Reaping orphans: as a child subreaper (real double forks in this process), and as PID 1 of
a fresh PID namespace (the real daemon on the simulator under ``unshare``).

The kernel parts are real: prctl, reparenting, zombies, waitpid. A machine that cannot make
a PID namespace fails the PID 1 tests with what it lacks; they never skip.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import wait_until
from harness import DaemonRun, write_config

from supervisor.adapters import reaper
from supervisor.adapters.output import RotatingLog
from supervisor.adapters.ports import ReapedChild, ReaperError
from supervisor.adapters.process import ServerProcess
from supervisor.sim import simgpu

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent

# Forks a grandchild that sleeps argv[1] seconds and exits argv[2], prints its pid, and
# exits at once (argv[3], default 0): the grandchild is orphaned.
DOUBLE_FORK = """
import os, sys, time
pid = os.fork()
if pid == 0:
    time.sleep(float(sys.argv[1]))
    os._exit(int(sys.argv[2]))
print(pid, flush=True)
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
sys.exit(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
"""


@pytest.fixture
def subreaper() -> Iterator[None]:
    """This test process as a child subreaper, for the test only."""
    before = reaper.is_subreaper()
    reaper.become_subreaper()
    try:
        yield
    finally:
        reaper.become_subreaper(before)


def _ppid(pid: int) -> int | None:
    stat = reaper._read_stat(reaper.PROC, pid)
    return stat.ppid if stat else None


async def _until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` on the loop (the reaper runs on it) until true, with a deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        await asyncio.sleep(0.02)


def test_parse_stat_takes_the_name_up_to_the_last_parenthesis() -> None:
    """A process name may hold spaces and parentheses; the fields after it still parse."""
    line = "4242 (sglang::sch (x) y) Z 17 4242 4242 0 -1 4228 0 0 0 0 0 0 0 0 20 0 1 0 987654 0 0"
    assert reaper.parse_stat(line) == reaper.Stat(4242, "sglang::sch (x) y", "Z", 17, 987654)
    assert reaper.parse_stat("garbage") is None


def test_zombies_are_found_from_the_kernels_children_lists_when_it_has_them(tmp_path: Path) -> None:
    """With CONFIG_PROC_CHILDREN, /proc/PID/task/*/children lists the children (no full scan)."""
    def proc(pid: int, ppid: int, state: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (p{pid}) {state} {ppid} 1 1 0 -1 0 0 0 0 0 0 0 0 20 0 1 0 {pid}0 0")

    proc(10, 1, "S")
    (tmp_path / "10" / "task" / "10").mkdir(parents=True)
    (tmp_path / "10" / "task" / "11").mkdir(parents=True)
    (tmp_path / "10" / "task" / "10" / "children").write_text("20 21 ")
    (tmp_path / "10" / "task" / "11" / "children").write_text("22 ")
    proc(20, 10, "Z")
    proc(21, 10, "S")
    proc(22, 10, "Z")
    proc(30, 99, "Z")  # someone else's zombie: not listed, never looked at
    assert sorted(z.pid for z in reaper.zombie_children(10, tmp_path)) == [20, 22]
    for t in ("10", "11"):
        (tmp_path / "10" / "task" / t / "children").unlink()
    shutil.rmtree(tmp_path / "10" / "task")
    (tmp_path / "10" / "task").mkdir()
    (tmp_path / "10" / "task" / "10").mkdir()  # no children file: the scan finds the same
    assert sorted(z.pid for z in reaper.zombie_children(10, tmp_path)) == [20, 22]


def test_not_linux_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no PR_SET_CHILD_SUBREAPER the failure says so in one line."""
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ReaperError, match=r"^cannot become a child subreaper: Linux only \(this is darwin\)$"):
        reaper.become_subreaper()


async def test_an_orphan_reparented_to_us_is_reaped_and_a_watched_childs_status_is_not_stolen(
    subreaper: None, no_leftovers: str,
) -> None:
    """A child double-forks and exits: its child's ppid becomes ours (subreaper); when it
    exits it is reaped (no zombie left). A watched child that exited first stays a zombie
    through every sweep until its own waiter collects it, with its own status. The same
    zombie left out of ``keep`` would have been collected: ``keep`` is what protects it."""
    reaped: list[ReapedChild] = []
    watched = subprocess.Popen([PY, "-c", "import sys; sys.exit(3)"])
    middle = subprocess.Popen([PY, "-c", DOUBLE_FORK, "1.0", "7"], stdout=subprocess.PIPE)
    kept = {watched.pid, middle.pid}
    r = reaper.Reaper(lambda: kept, reaped.extend, settle_s=0.0, sweep_s=0.2)
    r.start()
    try:
        assert middle.stdout is not None
        orphan = int(middle.stdout.readline())
        middle.stdout.close()
        assert middle.wait(10) == 0
        assert _ppid(orphan) == os.getpid(), "the orphan was reparented to us, the subreaper"
        await _until(lambda: any(c.pid == orphan for c in reaped), 10, "the orphan to be reaped")
        assert [c.returncode for c in reaped if c.pid == orphan] == [7]
        assert not psutil.pid_exists(orphan), "a zombie was left"
        # Sweeps ran (the SIGCHLDs, and the 0.2 s safety sweep) while `watched` was a zombie.
        stat = reaper._read_stat(reaper.PROC, watched.pid)
        assert stat is not None and stat.state == "Z"
        assert all(c.pid != watched.pid for c in reaped)
        assert watched.wait(5) == 3, "the watcher got its child's own exit status"

        # Negative control: a zombie child nobody keeps is collected, status and all.
        unkept = subprocess.Popen([PY, "-c", "import sys; sys.exit(5)"])
        await _until(lambda: any(c.pid == unkept.pid for c in reaped), 10, "an unkept zombie to be reaped")
        assert [c.returncode for c in reaped if c.pid == unkept.pid] == [5]
        assert unkept.wait(5) == 0  # what Popen says once its status was stolen: why keep() exists
    finally:
        r.close()


async def test_a_server_processes_exit_reaches_its_watcher_while_its_orphans_are_reaped(
    tmp_path: Path, subreaper: None, no_leftovers: str,
) -> None:
    """The process adapter's server (asyncio's child watcher) exits 3 after orphaning a child
    that exits 9: the reaper (no settle time, sweeping every 50 ms) collects the orphan and
    leaves the server's exit status to ``wait()``."""
    reaped: list[ReapedChild] = []
    log = RotatingLog(tmp_path / "server.log", 1 << 20, 1)
    server = await ServerProcess.spawn([PY, "-c", DOUBLE_FORK, "0.3", "9", "0.8", "3"], env=dict(os.environ),
                                       cwd=None, log=log, tail_bytes=4096)
    r = reaper.Reaper(lambda: {server.pid}, reaped.extend, settle_s=0.0, sweep_s=0.05)
    r.start()
    try:
        lines: list[str] = []
        server.on_line = lines.append
        await _until(lambda: bool(lines), 10, "the orphan's pid")
        orphan = int(lines[0])
        status = await asyncio.wait_for(server.wait(), 10)
        assert status.code == 3, status
        await _until(lambda: any(c.pid == orphan for c in reaped), 10, "the orphan to be reaped")
        assert [c.returncode for c in reaped if c.pid == orphan] == [9]
        assert all(c.pid != server.pid for c in reaped)
        assert not psutil.pid_exists(orphan)
    finally:
        r.close()
        await server.close()


def test_the_daemon_reaps_its_servers_orphaned_scheduler(tmp_path: Path, no_leftovers: str) -> None:
    """Simulator orphan mode: scheduler TP0 survives its main process. With the daemon a
    child subreaper it is reparented to the daemon, not to init: the daemon's own
    ``waitpid`` on its pid collects it (which only its parent can), after the daemon killed
    it with the rest of the tree; then the relaunch serves as before, and no zombie stays."""
    cfg = write_config(tmp_path, sim_args=("--sim-fail", "orphan", "--sim-fail-after-s", "0.5"))
    with DaemonRun(cfg) as d:
        assert d.wait_for("reaper_started")["mode"] == "subreaper"
        d.wait_for("server_ready")
        server = d.find("launch")[0]["pid"]
        tp0 = [p.pid for p in simgpu.read_processes(tmp_path / "gpus") if p.title == "sglang::scheduler_TP0"]
        assert len(tp0) == 1
        d.wait_for("crash", timeout=30)

        def reaped() -> list[int]:
            return [pid for e in d.find("orphans_reaped") for pid in e["pids"]]

        wait_until(lambda: tp0[0] in reaped(), timeout=15, what="the orphaned scheduler to be reaped by the daemon")
        d.wait_for("server_ready", count=2, timeout=40)
        assert server not in reaped(), "the server's own exit is its watcher's, never the reaper's"
        daemon = psutil.Process(d.proc.pid)
        wait_until(lambda: all(k.status() != psutil.STATUS_ZOMBIE for k in daemon.children()), timeout=5,
                   what="no zombie child of the daemon")
        assert d.stop() == 0


# --- PID 1 in a fresh PID namespace -----------------------------------------------------------

UNSHARE = ("--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child")


def _unshare() -> list[str]:
    """``unshare`` with a user and a PID namespace, or a failure naming what is missing."""
    path = shutil.which("unshare")
    if path is None:
        pytest.fail("unshare (util-linux) is not installed: the PID 1 tests need it")
    probe = subprocess.run([path, *UNSHARE, "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        pytest.fail(
            f"cannot create a PID namespace here (`unshare {' '.join(UNSHARE)} sh`: rc {probe.returncode}, "
            f"{probe.stderr.strip()[:300]!r}): the PID 1 tests need unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1 or user.max_user_namespaces > 0; on Ubuntu 24.04 "
            "kernel.apparmor_restrict_unprivileged_userns=0) or root; in a container, a seccomp profile "
            "that allows unshare(CLONE_NEWUSER|CLONE_NEWPID)"
        )
    return [path, *UNSHARE]


def _inner(unshare: subprocess.Popen[bytes]) -> psutil.Process:
    """The namespace's PID 1 as the host sees it: unshare's one child."""
    return wait_until(lambda: next(iter(psutil.Process(unshare.pid).children()), None), timeout=10,
                      what="unshare's child")


def _zombies_in_namespace(pid1: psutil.Process) -> list[str]:
    """Zombies in the namespace's own /proc (read through its root)."""
    proc = Path(f"/proc/{pid1.pid}/root/proc")
    found = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = reaper._read_stat(proc, int(entry.name))
            if stat is not None and stat.state == "Z":
                found.append(f"{stat.pid} {stat.name}")
    return found


def test_as_pid1_sigterm_ends_the_cli_before_the_daemon_handles_it(tmp_path: Path) -> None:
    """PID 1 ignores a signal it has no handler for. The CLI gives SIGTERM one before the
    daemon installs its own: a SIGTERM at startup ends it (143) instead of being lost."""
    unshare = _unshare()
    code = ("import os, signal, sys, time\n"
            "if sys.argv[1] == 'cli':\n"
            "    from supervisor.cli import _pid1_signals\n"
            "    _pid1_signals()\n"
            "assert os.getpid() == 1\n"
            "os.kill(1, signal.SIGTERM)\n"
            "time.sleep(0.5)\n"
            "print('still here', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bare = subprocess.run([*unshare, PY, "-c", code, "bare"], capture_output=True, text=True, timeout=30, env=env)
    assert (bare.returncode, bare.stdout) == (0, "still here\n"), bare.stderr  # what PID 1 does by default
    cli = subprocess.run([*unshare, PY, "-c", code, "cli"], capture_output=True, text=True, timeout=30, env=env)
    assert (cli.returncode, cli.stdout) == (143, ""), cli.stderr


def test_as_pid1_the_daemon_reaps_orphans_and_stops_drained_within_the_grace(tmp_path: Path, no_leftovers: str) -> None:
    """The real daemon as PID 1 of a fresh PID namespace, on the simulator in orphan mode:
    it is pid 1 there, the orphaned scheduler is reaped (no zombie in the namespace's /proc),
    and a SIGTERM stops the server drained and the daemon exits 0 within stop_grace_s."""
    unshare = _unshare()
    grace = 3.0
    cfg = write_config(tmp_path, {"server": {"stop_grace_s": grace}},
                       sim_args=("--sim-fail", "orphan", "--sim-fail-after-s", "0.5"))
    d = DaemonRun(cfg, wrapper=unshare)
    try:
        assert d.wait_for("daemon_started")["pid"] == 1
        assert d.wait_for("reaper_started")["mode"] == "pid1"
        pid1 = _inner(d.proc)
        d.wait_for("crash", timeout=30)
        d.wait_for("orphans_reaped", timeout=15)
        names = [n for e in d.find("orphans_reaped") for n in e["names"]]
        assert any(n.startswith("sglang::sched") for n in names), names
        d.wait_for("server_ready", count=2, timeout=40)
        wait_until(lambda: not _zombies_in_namespace(pid1), timeout=5, what="no zombie in the namespace")

        started = time.monotonic()
        pid1.send_signal(signal.SIGTERM)  # unshare does not forward it; a pod's runtime signals PID 1
        rc = d.proc.wait(grace + 10)
        elapsed = time.monotonic() - started
        assert rc == 0, d.log_path.read_text()[-3000:]
        assert elapsed < grace + 3.0, f"took {elapsed:.1f}s to stop, grace {grace}s"
        stopped = d.find("server_stopped")
        assert stopped and stopped[-1]["signal"] != signal.SIGKILL, stopped  # drained, not killed
        assert d.find("daemon_stopping")
    finally:
        d.kill()
