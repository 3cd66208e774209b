"""Owning the server process: its own session, its output, its stop, its leftovers.

- The server starts in a new session (so in its own process group): SGLang does not do
  this itself, and its parts must be signalled as a group.
- stdout and stderr are merged into one pipe read from the event loop so the child does
  not stall: the pipe is enlarged, each chunk goes to a size-rotated log file and to a bounded
  in-memory tail kept for the diagnosis; lines are handed to a callback only while one
  is set (startup-fact parsing), so steady serving costs one write per chunk.
- Stopping begins at SGLang's main process only (SIGTERM: it drains its requests; SIGQUIT on
  a hang: it dumps its stacks), waits a grace period for it to end, then SIGKILLs the group
  and every descendant seen that left it; the main process is always reaped. A SIGTERM to
  the whole group would kill the scheduler and detokenizer at once (they have no handler)
  and the drain, which only the main process does, would never happen.
- Every ``sglang::`` process of the tree (schedulers, detokenizer) is watched through a
  pidfd, so the death of one is known in milliseconds, not after SGLang's own 5 s
  diagnostics sleep ends with its main process.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import mmap
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

from supervisor.adapters.output import Tail
from supervisor.adapters.ports import ProcessError, ServerLog
from supervisor.adapters.procstart import boot_id, start_or_none, started, still
from supervisor.aio import within
from supervisor.core.model import ExitStatus

F_SETPIPE_SZ = 1031  # linux/fcntl.h
PIPE_SIZE = 1 << 20
READ_CHUNK = 1 << 16
SMALL_READ = 64 * 1024  # a read below this means the server is not flooding us
SLOW_RATE = 1 << 20  # bytes/s: below this a server is trickling (2,000 lines/s is ~0.2 MB/s)
# Pause after a small read. The 1 MiB pipe covers 10 MB/s (100,000 lines/s of 100 bytes)
# for this long, so even a burst that starts right after a quiet spell does not stall the
# child; a longer pause would save a little CPU at the price of that guarantee.
BATCH_S = 0.1
# One buffer for every read of every server (the event loop reads one pipe at a time), each
# read copied out at the size read: ``os.read(fd, 1 MiB)`` would ask malloc for 1 MiB (an mmap)
# and shrink it in place, so each small read the tail keeps would cost a 4 KiB page and a
# mapping of its own; and a buffer per server would cost 1 MiB of RSS each. An anonymous
# mapping, not a bytearray (which zero-fills, so touches, all of it): a page costs RSS only once
# a read has reached it, so a server that logs a few KB at a time holds a few pages, not 1 MiB.
_READ_BUFFER = mmap.mmap(-1, PIPE_SIZE)
_READ_VIEW = memoryview(_READ_BUFFER)


# Bytes that log text holds rarely, rarest first: a spotted word is searched from where the
# first of these it holds first appears (``ServerProcess._spot``). Letters, digits, spaces and
# ``.,:-#()[]/`` fill every SGLang line and are not here.
RARE_BYTES = b"_|~^`@$%&*+=<>{}\\;!?\"'"


@functools.lru_cache(maxsize=16)
def _pivot(word: bytes) -> tuple[bytes, int]:
    """The rarest byte of ``word`` (by ``RARE_BYTES``) and where it first is in the word;
    (b"", 0) when it has none."""
    for byte in RARE_BYTES:
        at = word.find(bytes((byte,)))
        if at >= 0:
            return bytes((byte,)), at
    return b"", 0


class AdoptedChild:
    """A child this process did not spawn in its current program (a server kept across a
    re-exec): what ``ServerProcess`` needs of ``asyncio.subprocess.Process``, over a pidfd.
    It is still our child and not yet reaped, so its pid cannot have been reused."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._fd: int | None = os.pidfd_open(pid)
        self._loop.add_reader(self._fd, self._reap)
        self._reap()  # it may have ended during the exec

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not ours to reap after all (never expected): say it ended
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return
        self.returncode = os.waitstatus_to_exitcode(status)
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        if not self._done.done():
            self._done.set_result(None)

    async def wait(self) -> int:
        await asyncio.shield(self._done)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


class ServerProcess:
    """One launched server: its pid/pgid, output pump and lifecycle.

    The output pump reads the pipe's raw fd, up to 1 MiB per read, in two modes. Watching
    (``add_reader``): every readable event is read at once; an idle server costs nothing
    and a flood is read as fast as it comes. After two small reads in a row at under
    ``SLOW_RATE`` (a steady trickle) it switches to polling: one read per pause of at most ``BATCH_S``, shorter when
    the rate just seen would half-fill the 1 MiB pipe sooner, so a server logging 2,000
    lines a second costs ten wake-ups a second instead of one per line. A big read, an
    empty pipe, or the server's exit switch back to watching.
    """

    def __init__(self, proc: asyncio.subprocess.Process | AdoptedChild, fd: int, log: ServerLog, tail: Tail) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.pgid = proc.pid  # start_new_session=True: the leader of its own group
        self.started = start_or_none(proc.pid)  # in ticks since boot (procstart): `status`'s uptime
        self.log = log
        self.tail = tail
        self.on_line: Callable[[str], None] | None = None
        # After start-up: each line holding one of ``spotted`` (bytes searched in each read,
        # no line split) goes to ``on_spotted``.
        self.spotted: tuple[bytes, ...] = ()
        self.on_spotted: Callable[[str], None] | None = None
        self._partial = b""
        # descendant pid -> (start in ticks since boot, create time): the start tells it from
        # a later process with its pid (procstart); the create time is what the state file keeps
        self._known: dict[int, tuple[int, float]] = {}
        self._fd: int | None = fd
        self._loop = asyncio.get_running_loop()
        self._eof = self._loop.create_future()
        self._poll_handle: asyncio.TimerHandle | None = None
        self._watching = False
        self._last_small = False
        self._last_read = self._loop.time()
        self._hurry = False  # the server has exited: read everything left without pausing
        self.last_output_at = self._loop.time()  # monotonic: when the server last printed
        self.on_part_died: Callable[[int, str], None] | None = None
        self._part_fds: dict[int, tuple[int, str]] = {}  # pid -> (pidfd, title) of watched parts
        self._watch_pipe()

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | None,
        log: ServerLog,
        tail_bytes: int,
    ) -> ServerProcess:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            fcntl.fcntl(read_fd, F_SETPIPE_SZ, PIPE_SIZE)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write_fd,
                stderr=write_fd,
                start_new_session=True,
                env=dict(env),
                cwd=cwd or None,
            )
        except OSError as exc:
            os.close(read_fd)
            raise ProcessError(f"{argv[0]}: {exc.strerror or exc}") from None
        finally:
            os.close(write_fd)  # only the child writes; EOF comes when the last writer exits
        os.set_blocking(read_fd, False)
        return cls(proc, read_fd, log, Tail(tail_bytes))

    # -- a re-exec: handed over, then adopted ------------------------------------------------

    def hand_over(self) -> dict[str, Any]:
        """Stop reading (what is not read stays in the pipe for the next daemon) and say what
        the next one needs: the pipe's and the parts' descriptors, the tail, the tree."""
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        if self._fd is not None and self._watching:
            self._loop.remove_reader(self._fd)
            self._watching = False
        for fd, _title in self._part_fds.values():
            self._loop.remove_reader(fd)
        return {
            "pid": self.pid, "pipe_fd": self._fd, "tail": self.tail.get(), "tail_total": self.tail.total,
            # the tree twice: (pid, create time) as every daemon version reads it, and each
            # pid's start (procstart), which a daemon before it ignores
            "known": sorted(self.tree()),
            "known_started": sorted((pid, start) for pid, (start, _created) in self._known.items()),
            "parts": [(pid, fd, title) for pid, (fd, title) in sorted(self._part_fds.items())],
        }

    def resume(self) -> None:
        """The exec failed: read and watch again, as before ``hand_over``."""
        for pid, (fd, _title) in self._part_fds.items():
            self._loop.add_reader(fd, self._part_exited, pid)
        self._watch_pipe()

    @property
    def kept_fds(self) -> list[int]:
        """What an exec must keep open for the next daemon to adopt this server."""
        return [fd for fd in (self._fd, *(f for f, _t in self._part_fds.values())) if fd is not None]

    @classmethod
    def adopt(cls, pid: int, pipe_fd: int, *, log: ServerLog, tail_bytes: int, tail: bytes, tail_total: int,
              known: Sequence[tuple[int, float]], parts: Sequence[tuple[int, int, str]],
              known_started: Sequence[tuple[int, int]] | None = None) -> ServerProcess:
        """A server handed over by the daemon this process was before its exec: its output
        read on from the same pipe, its tail and tree as they were, its parts still watched.
        ``known_started``: each pid's start; None from a daemon that did not hand it over,
        whose tree is proven as that daemon proved it (the create time within a second)."""
        for fd in (pipe_fd, *(fd for _pid, fd, _title in parts)):
            os.set_inheritable(fd, False)  # ours again: a later exec keeps only what it hands over
        os.set_blocking(pipe_fd, False)
        kept = Tail(tail_bytes)
        kept.append(tail)
        kept.total = tail_total
        server = cls(AdoptedChild(pid), pipe_fd, log, kept)
        server._known = _tree_handed(known, known_started)
        for part_pid, fd, title in parts:
            server._part_fds[part_pid] = (fd, title)
            server._loop.add_reader(fd, server._part_exited, part_pid)
        return server

    # -- output -----------------------------------------------------------------------------

    def _read(self) -> int | None:
        """One read of what the pipe holds: the byte count (0: nothing yet), None at EOF."""
        fd = self._fd
        if fd is None:
            return None
        try:
            n = os.readv(fd, (_READ_BUFFER,))
        except BlockingIOError:
            return 0
        except OSError:
            n = 0
        if not n:
            self._finish()
            return None
        view = _READ_VIEW[:n]  # written and kept from the shared buffer itself: no copy per read
        self.last_output_at = self._loop.time()
        self.log.write(view)
        self.tail.append(view)
        if self.on_line is not None:
            self._split_lines(view.tobytes())
        elif self.on_spotted is not None:
            self._spot(_READ_BUFFER, n, self.on_spotted)
        return n

    def _on_readable(self) -> None:
        """Watching (add_reader): keep up with a flood; after two small, slow reads in a row
        (a steady trickle, not the first line of a burst) switch to polling."""
        now = self._loop.time()
        n = self._read()
        if n is None or self._fd is None:
            return
        elapsed, self._last_read = now - self._last_read, now
        slow = n < SMALL_READ and n < SLOW_RATE * elapsed
        if slow and self._last_small and not self._hurry:
            self._loop.remove_reader(self._fd)
            self._watching = False
            self._schedule_poll(n / elapsed if elapsed > 0 else 0.0)
        self._last_small = slow

    def _poll(self) -> None:
        """Polling (the pipe is not watched): one read per pause, no epoll churn. An empty
        pipe goes back to watching, so an idle server costs no wake-ups at all."""
        self._poll_handle = None
        now = self._loop.time()
        n = self._read()
        if n is None or self._fd is None:
            return
        elapsed, self._last_read = now - self._last_read, now
        if n == 0 or n >= SMALL_READ or self._hurry:
            self._last_small = False
            self._watch_pipe()
        else:
            self._schedule_poll(n / elapsed if elapsed > 0 else 0.0)

    def _schedule_poll(self, rate: float) -> None:
        # Pause at most BATCH_S, and no longer than the pipe takes to half-fill at ``rate``.
        pause = BATCH_S if rate <= 0 else min(BATCH_S, 0.5 * PIPE_SIZE / rate)
        self._poll_handle = self._loop.call_later(pause, self._poll)

    def _watch_pipe(self) -> None:
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        if self._fd is not None and not self._watching:
            self._loop.add_reader(self._fd, self._on_readable)
            self._watching = True

    def _finish(self) -> None:
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        if self._fd is not None:
            if self._watching:
                self._loop.remove_reader(self._fd)
                self._watching = False
            os.close(self._fd)
            self._fd = None
        if self._partial and self.on_line is not None:
            self._deliver(self._partial)
        self._partial = b""
        if not self._eof.done():
            self._eof.set_result(None)

    def _split_lines(self, data: bytes) -> None:
        chunk = self._partial + data
        lines = chunk.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > READ_CHUNK * 4:  # a runaway line: keep it bounded
            self._partial = self._partial[-READ_CHUNK:]
        for line in lines:
            self._deliver(line)

    def _spot(self, buf: bytes | bytearray | mmap.mmap, n: int, callback: Callable[[str], None]) -> None:
        """The lines of the read (``buf``'s first ``n`` bytes: the shared buffer, searched in
        place) that hold a spotted word, one call each (a word cut by a read boundary is missed: the
        words are a signal that repeats, not a record).

        A word is looked for only from where its rarest byte first appears (``_pivot``:
        ``_`` in both of SGLang's retraction words, a byte its decode and access lines never
        hold): one ``memchr`` pass, and a read without it is not searched at all. A log flood
        of decode lines costs one fast scan a read instead of one slow search a word (issue
        36, item 3: the search was most of the pump's cost)."""
        for word in self.spotted:
            pivot, offset = _pivot(word)
            at = 0
            if pivot:
                first = buf.find(pivot, 0, n)
                if first < 0:
                    continue
                at = max(0, first - offset)  # the word's own pivot cannot lie before ``first``
            at = buf.find(word, at, n)
            while at >= 0:
                start = buf.rfind(b"\n", 0, at) + 1
                end = buf.find(b"\n", at, n)
                end = n if end < 0 else end
                callback(bytes(buf[start:end]).decode("utf-8", errors="replace").rstrip("\r"))
                at = buf.find(word, end, n)

    def _deliver(self, line: bytes) -> None:
        callback = self.on_line
        if callback is not None:
            callback(line.decode("utf-8", errors="replace").rstrip("\r"))

    async def drain_output(self, timeout_s: float) -> None:
        """Read what is left (bounded): the last lines hold the cause. An orphan that keeps
        the pipe open cannot hold us longer than ``timeout_s``."""
        self._hurry = True
        self._watch_pipe()
        with contextlib.suppress(TimeoutError):
            await within(asyncio.shield(self._eof), timeout_s)

    # -- lifecycle --------------------------------------------------------------------------

    def remember_descendants(self) -> list[int]:
        """Note every current descendant, so one that leaves the group is still found, and
        start watching each SGLang part among them. On the loop, and blocking (psutil): the
        daemon calls the two halves apart, ``scan_descendants`` in a thread, then
        ``watch_parts`` on the loop."""
        found = self.scan_descendants()
        self.watch_parts(found)
        return [self.pid, *self._known]

    def scan_descendants(self) -> list[tuple[int, str]]:
        """Note every current descendant (blocking); returns the SGLang parts, (pid, title)."""
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        seen: dict[int, tuple[str, int]] = {}  # pid -> (part title, parent pid)
        for k in kids:
            with contextlib.suppress(psutil.Error):
                self._known[k.pid] = (started(k.pid), k.create_time())
                seen[k.pid] = (_part_title(k), k.ppid())
        # A part's own fork (a compile worker, a subprocess before its exec) carries its
        # parent's title for a while: it is not a part, and its end is not the part's death.
        return [(pid, title) for pid, (title, ppid) in seen.items()
                if title and seen.get(ppid, ("", 0))[0] != title]

    def watch_parts(self, parts: Sequence[tuple[int, str]]) -> None:
        """Watch each part's pidfd (on the loop): its death calls ``on_part_died`` once."""
        if self._proc.returncode is not None:
            return
        for pid, title in parts:
            if pid in self._part_fds:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # already gone: the main process's exit (or its log) will tell
            self._part_fds[pid] = (fd, title)
            self._loop.add_reader(fd, self._part_exited, pid)

    def _part_exited(self, pid: int) -> None:
        fd, title = self._part_fds.pop(pid, (None, ""))
        if fd is None:
            return
        self._loop.remove_reader(fd)
        os.close(fd)
        if self.on_part_died is not None and self._proc.returncode is None:
            self.on_part_died(pid, title)

    def unwatch_parts(self) -> None:
        for pid in list(self._part_fds):
            fd, _title = self._part_fds.pop(pid)
            self._loop.remove_reader(fd)
            os.close(fd)

    def tree_pids(self) -> list[int]:
        return [self.pid, *self._known]

    def tree(self) -> list[tuple[int, float]]:
        """(pid, create time) of every descendant seen (the main process is the recorded pgid)."""
        return [(pid, created) for pid, (_start, created) in self._known.items()]

    def starts(self) -> tuple[str, list[tuple[int, int]]]:
        """The boot this runs in and (pid, start in ticks since boot) of every descendant seen:
        what proves a leftover ours whatever the wall clock did since (procstart)."""
        return boot_id(), [(pid, start) for pid, (start, _created) in self._known.items()]

    async def wait(self) -> ExitStatus:
        return ExitStatus.from_returncode(await self._proc.wait())

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def signal_main(self, sig: int) -> None:
        """Signal the main process alone (never a reaped pid: asyncio has not waited on it)."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self._proc.send_signal(sig)

    def kill_leftovers(self) -> list[int]:
        """SIGKILL the group and every remembered descendant still alive. Returns pids hit."""
        self.signal_group(signal.SIGKILL)
        hit = []
        for pid, (start, _created) in list(self._known.items()):
            if still(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    hit.append(pid)
        return hit  # _known stays: the diagnosis matches kernel OOM lines against these pids

    async def stop(self, grace_s: float, first: signal.Signals | None = signal.SIGTERM) -> ExitStatus:
        """Send ``first`` to the main process (None: nothing, it is dying on its own), wait up
        to ``grace_s`` for it to end, then SIGKILL the group and every descendant seen;
        always reaps. ``grace_s`` 0 kills at once."""
        parts = await asyncio.to_thread(self.scan_descendants)
        self.watch_parts(parts)
        if self._proc.returncode is None and grace_s > 0:
            if first is not None:
                self.signal_main(first)
            with contextlib.suppress(TimeoutError):
                await within(asyncio.shield(self._proc.wait()), grace_s)
        hit = self.kill_leftovers()
        status = await self.wait()
        await asyncio.to_thread(_wait_gone, [p for p in hit if p != self.pid], 2.0)
        await self.drain_output(0.5)
        return status

    async def close(self) -> None:
        """Drop the output pump and the part watchers (after the process is gone); close the log."""
        self.unwatch_parts()
        await self.drain_output(0.5)
        self._finish()
        self.log.close()
        # Its callbacks close over its launch, which holds it: a cycle the cyclic collector
        # would free only at its next full pass, tail and all. Broken here, it goes at once.
        self.on_line = self.on_spotted = self.on_part_died = None


def _wait_gone(pids: Sequence[int], timeout_s: float) -> None:
    """Until each pid is dead or a zombie (SIGKILL is delivered asynchronously), bounded."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    deadline = time.monotonic() + timeout_s
    while procs and time.monotonic() < deadline:
        procs = [p for p in procs if _running(p)]
        if procs:
            time.sleep(0.01)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


PART_PREFIX = "sglang::"


def _part_title(p: psutil.Process) -> str:
    """The ``sglang::...`` title of a server part (scheduler, detokenizer), else ""."""
    with contextlib.suppress(psutil.Error):
        argv = p.cmdline()
        if argv and argv[0].startswith(PART_PREFIX):
            return argv[0].split()[0]
        name = p.name()
        if name.startswith(PART_PREFIX):
            return name
    return ""


def _tree_handed(
    known: Sequence[tuple[int, float]], known_started: Sequence[tuple[int, int]] | None,
) -> dict[int, tuple[int, float]]:
    """The tree a re-exec handed over, as ``ServerProcess._known`` keeps it."""
    created = dict(known)
    if known_started is not None:
        return {pid: (start, created.get(pid, 0.0)) for pid, start in known_started}
    tree = {}
    for pid, at in created.items():  # from a daemon before procstart
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if abs(p.create_time() - at) < 1.0:
                tree[pid] = (started(pid), at)
    return tree
