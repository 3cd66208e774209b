"""Clearing stale servers: real child processes with SGLang titles, a real listener, simulated GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from conftest import free_port

from supervisor.adapters.cleanup import (
    LAUNCH_VAR,
    MARK_VAR,
    ProcInfo,
    StaleReport,
    carries_mark,
    find_stale,
    instance_id,
    kill_stale,
    scan_stale,
    server_kind,
)
from supervisor.adapters.ports import GIB
from supervisor.adapters.procstart import boot_id, started
from supervisor.services.release import wait_until_released
from supervisor.sim import simgpu
from supervisor.sim.gpuprobe import SimulatedProbe

pytestmark = pytest.mark.usefixtures("no_leftovers")

Spawn = Callable[..., subprocess.Popen[bytes]]

_CHILD = """
import setproctitle, signal, socket, sys, time
title, ignore_term, port = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if port:
    s = socket.socket(); s.bind(("127.0.0.1", port)); s.listen()
if title:
    setproctitle.setproctitle(title)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Starts Python children (own session, or the process group given) and reaps what is left."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        title: str = "", *, ignore_term: bool = False, port: int = 0, group: int | None = None,
        mark: str | None = None,
    ) -> subprocess.Popen[bytes]:
        env = {**os.environ, **({MARK_VAR: mark, LAUNCH_VAR: "n1"} if mark else {})}
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, title, "1" if ignore_term else "0", str(port)],
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=group is None,
            process_group=group,  # 0: a new group in our session, so others may join it
        )
        procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"  # the child is set up (title, handler, socket)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()


@pytest.fixture
def sim_dir(tmp_path: Path) -> Path:
    """Two simulated 141 GiB GPUs."""
    d = tmp_path / "gpus"
    simgpu.ensure_gpus(d, 2, 141)
    return d


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


MARK = uuid.uuid4().hex[:20]  # this run's own: a parallel worker or another checkout's run never shares it


async def test_orphan_scheduler_is_killed_then_the_gpu_is_free(spawn: Spawn, sim_dir: Path) -> None:
    """An orphaned sglang::scheduler of ours (it carries our mark) holding 100 GiB is killed, a
    foreign holder is left alive, and memory frees."""
    orphan = spawn("sglang::scheduler_TP0", mark=MARK)  # setproctitle zeroes its environ: the mark is unreadable
    other = spawn("someone-elses-training-job")
    simgpu.write_process(sim_dir, orphan.pid, {0: 100 * GIB, 1: 100 * GIB}, title="sglang::scheduler_TP0")
    simgpu.write_process(sim_dir, other.pid, {1: 5 * GIB}, title="train")
    probe = SimulatedProbe(sim_dir)
    gpus = await probe.sample()
    gpu_pids = {p.pid for g in gpus for p in g.processes}

    tree = [(orphan.pid, psutil.Process(orphan.pid).create_time())]
    report = await scan_stale(recorded_pgid=None, gpu_pids=gpu_pids, own_pid=os.getpid(), instance=MARK,
                              recorded_tree=tree)
    assert [(p.pid, p.reason) for p in report.ours] == [(orphan.pid, "recorded in our server's tree")]
    assert [p.pid for p in report.foreign] == [other.pid]

    killed = await kill_stale(report, grace_s=10)
    assert killed == [orphan.pid]
    assert _alive(other.pid)
    result = await wait_until_released(probe, min_free_share=0.9, timeout_s=30, poll_s=0.05)
    assert result.ok, result.describe(0.9)
    assert [p.pid for p in result.gpus[1].processes] == [other.pid]


@pytest.mark.parametrize("title", ["sglang::detokenizer", "sglang::data_parallel_controller",
                                   "sglang::scheduler_DP1_TP3"])
def test_unmarked_sglang_on_our_gpu_is_foreign(spawn: Spawn, title: str) -> None:
    """Looking like SGLang proves nothing: without our mark, a part holding our GPU is foreign."""
    proc = spawn(title)
    report = find_stale(recorded_pgid=None, gpu_pids={proc.pid}, own_pid=os.getpid(), instance=MARK)
    assert report.ours == [] and [p.pid for p in report.foreign] == [proc.pid]
    assert title.split("_")[0] in report.foreign[0].reason or "sglang" in report.foreign[0].reason


def test_marked_process_is_ours_wherever_it_is(spawn: Spawn) -> None:
    """A process with our mark is ours even off our GPUs and port; another daemon's mark is not."""
    ours = spawn("", mark=MARK)
    theirs = spawn("", mark="another-daemon-instance")
    report = find_stale(recorded_pgid=None, gpu_pids=set(), own_pid=os.getpid(), instance=MARK)
    assert [p.pid for p in report.ours] == [ours.pid]
    assert theirs.pid not in {p.pid for p in report.ours}


async def test_recorded_process_group_is_killed_even_when_it_ignores_sigterm(spawn: Spawn) -> None:
    """Every member of our recorded process group is ours; one that ignores SIGTERM gets SIGKILL after the grace."""
    leader = spawn("", group=0)
    member = spawn("", ignore_term=True, group=leader.pid)
    report = find_stale(recorded_pgid=leader.pid, gpu_pids=(), own_pid=os.getpid())
    assert sorted(p.pid for p in report.ours) == sorted([leader.pid, member.pid])
    assert {p.reason for p in report.ours} == {f"process group {leader.pid}"}
    killed = await kill_stale(report, grace_s=0.5)
    assert sorted(killed) == sorted([leader.pid, member.pid])  # the member ignores SIGTERM: only SIGKILL ends it


def test_recorded_group_older_than_the_launch_is_not_ours(spawn: Spawn) -> None:
    """A process group created before our recorded launch (a pgid reused after a reboot) is left alone."""
    leader = spawn("")
    since = psutil.Process(leader.pid).create_time() + 60
    report = find_stale(recorded_pgid=leader.pid, gpu_pids=(), own_pid=os.getpid(), recorded_since=since)
    assert report.ours == []


def test_recorded_tree_and_group_stay_ours_after_the_wall_clock_stepped(spawn: Spawn, clock_step) -> None:
    """Recorded with this boot's id and starts since boot, a part that left our group (its
    mark unreadable) and a member of the group are ours after a step of the wall clock back
    (every create time now reads an hour earlier, before the recorded launch)."""
    leader = spawn("", group=0)
    member = spawn("", group=leader.pid)
    part = spawn("sglang::scheduler_TP0", mark=MARK)  # its own session, title set: only the tree proves it
    since = psutil.Process(leader.pid).create_time()
    clock_step(-3600.0)
    report = find_stale(recorded_pgid=leader.pid, gpu_pids=(), own_pid=os.getpid(), recorded_since=since,
                        recorded_boot=boot_id(), recorded_started=[(part.pid, started(part.pid))])
    assert sorted((p.pid, p.reason) for p in report.ours) == sorted([
        (leader.pid, f"process group {leader.pid}"), (member.pid, f"process group {leader.pid}"),
        (part.pid, "recorded in our server's tree")])


def test_a_recorded_group_or_tree_from_another_boot_is_not_ours(spawn: Spawn) -> None:
    """After a reboot nothing of ours survived: a process that now has the recorded group's id,
    or a recorded pid and start, is another boot's."""
    leader = spawn("", group=0)
    report = find_stale(recorded_pgid=leader.pid, gpu_pids=(), own_pid=os.getpid(), recorded_since=0.0,
                        recorded_boot="a-boot-before-this-one", recorded_started=[(leader.pid, started(leader.pid))])
    assert report.ours == []


def test_a_recorded_tree_without_the_boot_is_proven_by_the_create_time(spawn: Spawn) -> None:
    """A state file from before the boot was kept: its (pid, create time) tree still counts."""
    part = spawn("sglang::scheduler_TP0")
    tree = [(part.pid, psutil.Process(part.pid).create_time())]
    report = find_stale(recorded_pgid=None, gpu_pids=(), own_pid=os.getpid(), recorded_tree=tree)
    assert [(p.pid, p.reason) for p in report.ours] == [(part.pid, "recorded in our server's tree")]
    stale = [(part.pid, tree[0][1] - 30)]  # another process with that pid
    assert find_stale(recorded_pgid=None, gpu_pids=(), own_pid=os.getpid(), recorded_tree=stale).ours == []


async def test_a_found_process_whose_pid_was_taken_since_is_not_signalled(spawn: Spawn) -> None:
    """Between the look and the kill: a pid now another process's (another start) is left alone."""
    other = spawn("")
    report = StaleReport(ours=[ProcInfo(other.pid, create_time=psutil.Process(other.pid).create_time(),
                                        started=started(other.pid) - 1)])
    assert await kill_stale(report, grace_s=1) == []
    assert _alive(other.pid)


async def test_foreign_holder_is_killed_only_when_asked(spawn: Spawn) -> None:
    """A foreign GPU holder survives the default kill and dies with kill_foreign=True."""
    other = spawn("train")
    report = find_stale(recorded_pgid=None, gpu_pids={other.pid}, own_pid=os.getpid())
    assert await kill_stale(report, grace_s=5) == []
    assert _alive(other.pid)
    assert await kill_stale(report, grace_s=5, kill_foreign=True) == [other.pid]


async def test_unknown_pid_is_foreign_and_never_signalled() -> None:
    """A GPU pid absent from our /proc (another pid namespace) is reported as foreign-unknown and not killed."""
    missing = 2**22 + 12345  # above any pid_max this test runs under
    report = find_stale(recorded_pgid=None, gpu_pids={missing}, own_pid=os.getpid())
    assert len(report.foreign) == 1
    assert report.foreign[0].pid == missing and not report.foreign[0].visible
    assert "unknown pid" in report.foreign[0].reason
    assert await kill_stale(report, grace_s=1, kill_foreign=True) == []


async def test_own_process_and_ancestors_are_never_killed() -> None:
    """Our pid, our parent and our own process group are protected even when listed as stale."""
    me, parent = os.getpid(), os.getppid()
    report = find_stale(recorded_pgid=os.getpgid(me), gpu_pids={me, parent}, own_pid=me)
    assert report.ours == [] and report.foreign == []
    forced = StaleReport(ours=[ProcInfo(me, create_time=0.0), ProcInfo(parent, create_time=0.0)])
    assert await kill_stale(forced, grace_s=1, kill_foreign=True) == []
    assert psutil.Process(parent).is_running()


async def test_foreign_sglang_on_our_port_is_reported_and_left_alive(spawn: Spawn) -> None:
    """Another user's SGLang listening on our port is a port holder, not ours: never killed by
    default, only with kill_foreign."""
    port = free_port()
    proc = spawn("sglang::scheduler_TP0", port=port)
    report = find_stale(recorded_pgid=None, gpu_pids=(), own_pid=os.getpid(), port=port, instance=MARK)
    assert report.ours == [] and [p.pid for p in report.port_holders] == [proc.pid]
    assert await kill_stale(report, grace_s=2) == []
    assert _alive(proc.pid)
    assert await kill_stale(report, grace_s=2, kill_foreign=True) == [proc.pid]


def test_scheduler_environ_is_zeroed_by_setproctitle(spawn: Spawn) -> None:
    """Why the mark alone cannot prove ownership: an SGLang-titled process's environ reads empty."""
    proc = spawn("sglang::scheduler_TP0", mark=MARK)
    try:
        environ = psutil.Process(proc.pid).environ()
    except psutil.AccessDenied:
        environ = {}
    assert MARK_VAR not in environ


def test_instance_id_is_stable_per_state_dir(tmp_path: Path) -> None:
    """The mark derives from the state directory: the same dir gives the same id, another dir another."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert instance_id(str(a)) == instance_id(str(a)) != instance_id(str(b))
    assert carries_mark({MARK_VAR: instance_id(str(a))}, instance_id(str(a)))
    assert not carries_mark({}, instance_id(str(a))) and not carries_mark({MARK_VAR: ""}, None)


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["sglang::scheduler_TP7"], "sglang::scheduler"),
        (["python3", "-m", "sglang.launch_server", "--model-path", "m"], "sglang.launch_server"),
        (["/venv/bin/sglang", "serve", "--model-path", "m"], "sglang serve"),
        (["python", "/x/sglang/launch_server.py"], "sglang.launch_server"),
        (["python", "-m", "supervisor.sim.simulator", "--port", "1"], "supervisor.sim.simulator"),
        (["python", "-m", "vllm.entrypoints.openai.api_server"], None),
        (["bash", "-c", "echo sglang::scheduler"], None),
    ],
)
def test_server_kind_recognises_server_command_lines(argv: list[str], kind: str | None) -> None:
    """server_kind names SGLang parts and our simulator from a command line, and nothing else."""
    assert server_kind(argv) == kind

