"""Owning the server process: output pump, rotation, tail, stop with grace, leftovers."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import psutil
import pytest

from supervisor.adapters.output import RotatingLog, Tail
from supervisor.adapters.process import ServerProcess, _tree_handed
from supervisor.core.ownership import server_env

PY = sys.executable


async def _spawn(tmp_path, code: str, *, max_bytes: int = 1 << 30, backups: int = 2, tail: int = 4096) -> ServerProcess:
    log = RotatingLog(tmp_path / "server.log", max_bytes, backups)
    return await ServerProcess.spawn([PY, "-c", code], env=dict(os.environ), cwd=None, log=log, tail_bytes=tail)


async def test_a_flood_of_output_reaches_the_log_whole_and_the_tail_keeps_the_end(tmp_path, no_leftovers):
    """200,000 lines written as fast as the child can: every byte in the log, the last in the tail."""
    code = "import sys\nw=sys.stdout.write\nfor i in range(200000): w(f'line {i}\\n')\nsys.stdout.flush()"
    server = await _spawn(tmp_path, code)
    status = await server.wait()
    await server.drain_output(5)
    await server.close()
    assert status.code == 0
    data = (tmp_path / "server.log").read_bytes()
    assert data.count(b"\n") == 200000
    assert server.tail.get().endswith(b"line 199999\n")
    assert len(server.tail.get()) <= 4096


async def test_lines_reach_the_callback_while_one_is_set(tmp_path, no_leftovers):
    """The startup-facts callback sees whole lines, the last one even without a newline."""
    server = await _spawn(tmp_path, "import time; print('a'); print('b', flush=True); time.sleep(0.3); print('c', end='')")
    seen: list[str] = []
    server.on_line = seen.append
    await server.wait()
    await server.drain_output(5)
    await server.close()
    assert seen == ["a", "b", "c"]


async def test_the_log_rotates_by_size_and_keeps_the_backups(tmp_path, no_leftovers):
    """Past max_bytes the log moves to server.log.1, .2; older ones are dropped."""
    code = "import sys\nfor i in range(3000): sys.stdout.write('x' * 99 + '\\n')"
    server = await _spawn(tmp_path, code, max_bytes=64 * 1024, backups=2)
    await server.wait()
    await server.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["server.log", "server.log.1", "server.log.2"]
    assert all(p.stat().st_size <= 64 * 1024 for p in tmp_path.iterdir())


async def test_stop_sigkills_a_group_that_ignores_sigterm_after_the_grace(tmp_path, no_leftovers):
    """SIGTERM ignored: after the grace the whole group gets SIGKILL and is reaped."""
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print('up', flush=True); time.sleep(60)"
    )
    server = await _spawn(tmp_path, code)
    seen: list[str] = []
    server.on_line = seen.append
    while not seen:
        await asyncio.sleep(0.02)
    kids = server.remember_descendants()
    status = await server.stop(grace_s=0.3)
    await server.close()
    assert status.signal == signal.SIGKILL
    for pid in kids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def _with_an_escaped_child(tmp_path) -> tuple[ServerProcess, list[int]]:
    """A server whose child started its own session (out of the group killpg reaches), and
    that child's pid, remembered."""
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "print('up', flush=True); time.sleep(60)"
    )
    server = await _spawn(tmp_path, code)
    seen: list[str] = []
    server.on_line = seen.append
    while not seen:
        await asyncio.sleep(0.02)
    escaped = [p for p in server.remember_descendants() if p != server.pid]
    assert escaped and os.getpgid(escaped[0]) != server.pgid
    return server, escaped


async def _stopped_and_gone(server: ServerProcess, escaped: list[int]) -> bool:
    await server.stop(grace_s=0.2)
    await server.close()

    def gone() -> bool:
        return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in escaped)

    for _ in range(100):
        if gone():
            break
        await asyncio.sleep(0.05)
    return gone()


async def test_a_descendant_that_left_the_group_is_killed_too(tmp_path, no_leftovers):
    """A child that started its own session escapes killpg; remembered descendants do not."""
    server, escaped = await _with_an_escaped_child(tmp_path)
    assert await _stopped_and_gone(server, escaped)


async def test_a_descendant_that_left_the_group_is_killed_after_the_wall_clock_stepped(tmp_path, no_leftovers,
                                                                                       clock_step):
    """The descendants are remembered by their start since boot: a step of the wall clock
    between the look and the kill (which moves every create time) does not make the escaped
    one look like a stranger to be left alive."""
    server, escaped = await _with_an_escaped_child(tmp_path)
    created = psutil.Process(escaped[0]).create_time()
    clock_step(+3600.0)
    assert psutil.Process(escaped[0]).create_time() > created + 3000  # every create time moved
    assert server.kill_leftovers() == escaped
    assert await _stopped_and_gone(server, escaped)


async def test_a_fork_of_a_part_is_not_a_part(tmp_path, no_leftovers):
    """A scheduler's own fork (a compile worker, a subprocess before its exec) carries the
    scheduler's title: it is not watched as a part, so its end is never read as the
    scheduler's death (seen on the real two-node group: a healthy node relaunched)."""
    scheduler = (
        "import os, time, setproctitle\n"
        "setproctitle.setproctitle('sglang::scheduler_TP1')\n"
        "if os.fork() == 0:\n"
        "    time.sleep(60); os._exit(0)\n"
        "print('up', flush=True); time.sleep(60)"
    )
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {scheduler!r}])\ntime.sleep(60)"
    server = await _spawn(tmp_path, code)
    seen: list[str] = []
    server.on_line = seen.append
    while not seen:
        await asyncio.sleep(0.02)
    kids = psutil.Process(server.pid).children(recursive=True)
    titled = [k.pid for k in kids if k.cmdline()[:1] == ["sglang::scheduler_TP1"]]
    assert len(titled) == 2  # the scheduler and its fork, both titled
    parts = await asyncio.to_thread(server.scan_descendants)
    assert [title for _, title in parts] == ["sglang::scheduler_TP1"]
    ((pid, _),) = parts
    assert psutil.Process(pid).ppid() not in titled  # the scheduler itself, not its fork
    await server.stop(grace_s=0.2)
    await server.close()


async def test_a_missing_command_is_a_process_error(tmp_path):
    """An argv[0] that does not exist is reported, not raised as OSError."""
    from supervisor.adapters.process import ProcessError

    log = RotatingLog(tmp_path / "server.log", 1 << 20, 1)
    with pytest.raises(ProcessError, match="/nonexistent/python"):
        await ServerProcess.spawn(["/nonexistent/python"], env={}, cwd=None, log=log, tail_bytes=1024)


def test_the_tail_is_bounded():
    """The in-memory tail holds its limit plus at most one block and returns the last bytes."""
    tail = Tail(100)
    for i in range(1000):
        tail.append(f"{i:04d}\n".encode())
    assert tail.get().endswith(b"0999\n") and len(tail.get()) == 100
    assert tail._size <= 100 + tail.block and tail.total == 5000
    tail.append(b"x" * 1000)  # one chunk bigger than the whole tail
    assert tail.get() == b"x" * 100 and tail._size == 100


def test_the_tail_keeps_small_reads_in_a_few_blocks():
    """A line per read (a server logging a request at a time) is copied into 64 KiB blocks:
    the tail holds a handful of buffers, not one object per read, and what it returns is the
    output's last bytes in order."""
    tail = Tail(256 * 1024)
    lines = [f"line {i:06d} ".encode() + b"x" * 140 + b"\n" for i in range(20_000)]
    for line in lines:
        tail.append(line)
    assert tail.get() == b"".join(lines)[-256 * 1024:]
    assert len(tail._blocks) <= 256 // 64 + 1
    assert tail._size <= 256 * 1024 + Tail.BLOCK


def test_the_tail_is_the_outputs_last_bytes_whatever_the_reads():
    """Reads of every size, against the output itself: the tail is always its last bytes."""
    import random

    rng = random.Random(7)
    for limit in (4096, 100_000, 256 * 1024):
        tail, out = Tail(limit), bytearray()
        for _ in range(600):
            chunk = rng.randbytes(rng.choice((1, 150, 4000, 70_000, limit, limit + 3)))
            tail.append(chunk)
            out += chunk
            assert tail.get() == bytes(out[-limit:])
            assert tail.total == len(out) and tail._size <= limit + tail.block


class _NoProc:
    pid = 0
    returncode = 0


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


async def test_the_pump_keeps_small_reads_without_a_mapping_each(tmp_path):
    """The pump reads the pipe 1 MiB at a time. ``os.read(fd, 1 MiB)`` asks malloc for 1 MiB
    (an mmap) and shrinks it to what was read: every small read kept by the tail then held a
    4 KiB page and a mapping of its own (2,000 lines of a real server's request log cost 8 MB
    of RSS and 2,000 mappings; a 2 MiB tail of them would pass vm.max_map_count's 65,530 with
    five servers). One buffer reused for every read, copied out at the size read, keeps the
    mappings flat."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    log = RotatingLog(tmp_path / "server.log", 1 << 30, 1)
    sp = ServerProcess(_NoProc(), read_fd, log, Tail(2 * 1024 * 1024))  # type: ignore[arg-type]
    try:
        before = _mappings()
        for i in range(2000):
            os.write(write_fd, f"INFO: 127.0.0.1:{i} - GET /health HTTP/1.1 200 OK ".encode() + b"x" * 90 + b"\n")
            assert sp._read() and sp._read() == 0  # one line per read, then an empty pipe
        grown = _mappings() - before
        assert grown < 50, f"{grown} new mappings for 2,000 kept reads"
        assert sp.tail.get().count(b"\n") == 2000
    finally:
        os.close(write_fd)
        sp._finish()
        log.close()


def test_server_env_passes_only_what_the_config_names():
    """Only pass_env names from our environment, plus the config's env table."""
    env = server_env(("PATH", "HF_HOME"), {"NCCL_DEBUG": "WARN"}, {"PATH": "/bin", "SECRET": "x", "HF_HOME": "/h"})
    assert env == {"PATH": "/bin", "HF_HOME": "/h", "NCCL_DEBUG": "WARN"}


def test_a_log_that_cannot_be_written_reports_once_and_drops(tmp_path):
    """A log under a path that cannot exist: one report, bytes dropped, no exception."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    errors: list[str] = []
    log = RotatingLog(blocker / "sub" / "server.log", 1024, 1, on_error=errors.append)
    log.write(b"hello\n")
    log.write(b"again\n")
    assert len(errors) == 1 and log.dropped_bytes == 12


async def test_a_closed_server_is_freed_at_once_not_at_the_next_full_collection(tmp_path):
    """Its callbacks close over its launch, which holds it (ServerLife sets them so): without
    the cycle broken at ``close`` it lived, tail and all, until the cyclic collector's next
    full pass; 30 crash cycles held ~8 MB of RSS that way in the simulator."""
    import gc
    import weakref

    log = RotatingLog(tmp_path / "server.log", 1 << 20, 1)
    server = await ServerProcess.spawn([sys.executable, "-c", "print('hello')"], env={}, cwd=None, log=log,
                                       tail_bytes=4096)
    launch = [server]  # what a launch's record is to its server
    server.on_line = lambda line, launch=launch: None
    server.on_part_died = lambda pid, title, launch=launch: None
    await server.wait()
    await server.close()
    gone = weakref.ref(server)
    gc.disable()
    del server, launch
    try:
        assert gone() is None, "a closed server outlived its last reference"
    finally:
        gc.enable()


def test_a_tree_handed_over_by_a_daemon_before_the_starts_is_proven_by_the_create_time():
    """A re-exec from an older daemon hands (pid, create time) alone: a pid whose process has
    that create time (within the second it always allowed) is taken on with its start, one
    whose create time differs (another process now) is dropped; a newer daemon's starts are
    taken as handed."""
    from supervisor.adapters.procstart import started

    me = os.getpid()
    created = psutil.Process(me).create_time()
    assert _tree_handed([(me, created), (os.getppid(), 12.0)], None) == {me: (started(me), created)}
    assert _tree_handed([(me, created)], [(me, 7)]) == {me: (7, created)}
