"""Clearing stale servers of ours before a launch, and reporting foreign GPU holders.

After a crash SGLang's schedulers can outlive their parent (reparented to PID 1) and keep
~100 GB per GPU. Before every launch the daemon finds them (``find_stale``) and kills them
(``kill_stale``). A process is *ours* only when it is provably so:

- it carries our mark in its environment (``SGLANG_SUPERVISOR_INSTANCE`` = this daemon's
  instance id, set on every server we launch and inherited by all its processes; readable
  in ``/proc/PID/environ`` by our user). SGLang's parts set their title with setproctitle,
  which zeroes that area, so for them the mark is not readable and the next rules count;
- it is in the session or process group we recorded for the last server we launched (we
  start it with setsid: its parts stay in that session unless they leave it on purpose),
  in the same boot; or
- it is one of the processes we recorded in that server's tree: same pid, and the same
  start in the same boot (``procstart``: no step of the wall clock moves it).

Looking like SGLang proves nothing: another user's SGLang on the same host, even on our
port or our GPUs, is *foreign*. Foreign holders of our GPUs and foreign listeners on our
port are reported, and killed only when asked (``[gpu] kill_foreign``). A pid the GPU reports that does not exist in our ``/proc`` (a
process in another container's pid namespace) is foreign and never signalled. Our own
process and its ancestors are never touched.

``find_stale`` and ``kill_stale``'s work are blocking psutil calls: the async entry points
(``scan_stale``, ``kill_stale``) run them in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NamedTuple

import psutil

from supervisor.adapters.ports import ProcInfo, StaleReport
from supervisor.adapters.procstart import boot_id, started
from supervisor.core.ownership import LAUNCH_VAR, MARK_VAR, recorded_server  # noqa: F401  (re-exported for tests and preflight)

SGLANG_TITLES = ("sglang::scheduler", "sglang::detokenizer", "sglang::data_parallel_controller")
SIMULATOR_MODULE = "supervisor.sim.simulator"
# Our mark on every server we launch: the daemon's instance id, and the launch's nonce.
def server_kind(cmdline: Sequence[str], name: str = "") -> str | None:
    """Why this command line is an SGLang server part or our simulator; None if it is not (pure)."""
    text = " ".join(cmdline)
    for title in SGLANG_TITLES:
        if text.startswith(title) or name.startswith(title[:15]):  # comm is cut to 15 chars
            return title
    args = list(cmdline)
    for a, b in zip(args, args[1:], strict=False):
        if a == "-m" and b in (SIMULATOR_MODULE, "sglang.launch_server"):
            return b
        if Path(a).name == "sglang" and b == "serve":
            return "sglang serve"
    if any(a.endswith("sglang/launch_server.py") for a in args):
        return "sglang.launch_server"
    return None


def _protected(own_pid: int) -> set[int]:
    """Our own process, its ancestors, and the kernel's/init's pids."""
    keep = {0, 1, own_pid}
    with contextlib.suppress(psutil.Error):
        keep.update(p.pid for p in psutil.Process(own_pid).parents())
    return keep


def listeners(port: int) -> set[int]:
    """Pids listening on TCP ``port`` (any address)."""
    pids: set[int] = set()
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return pids
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            pids.add(c.pid)
    return pids


def find_stale(
    *,
    recorded_pgid: int | None,
    gpu_pids: Collection[int],
    own_pid: int,
    port: int | None = None,
    recorded_since: float | None = None,
    instance: str | None = None,
    recorded_tree: Collection[tuple[int, float]] = (),
    recorded_boot: str | None = None,
    recorded_started: Collection[tuple[int, int]] = (),
) -> StaleReport:
    """Processes of an earlier server of ours, and foreign holders of our GPUs and port (blocking).

    ``instance``: our mark's value (``MARK_VAR`` in the environment). ``recorded_pgid``: the
    process group of the last server we launched (its leader's pid, since we start it in a
    new session). ``gpu_pids``: pids the probe saw on our GPUs. ``port``: the server port.
    ``recorded_boot``, ``recorded_started``: the boot that server ran in and (pid, start in
    ticks since that boot) of the processes seen in its tree (``procstart``).

    In the recorded boot a process of that group, or of the tree with its recorded start, is
    ours; from another boot nothing is (a reboot ended every process of ours). Within a boot
    a group's id cannot be taken by another group while one member lives. A state file from
    before the boot was kept gives ``recorded_since`` (that launch's wall-clock time: a
    process of the group created before it is not ours) and ``recorded_tree`` (pid, create
    time), compared as the wall clock allows: within a second.
    """
    boot = None if recorded_boot is None else recorded_boot == boot_id()
    proof = _Proof(
        recorded_pgid if recorded_pgid and recorded_pgid > 1 and recorded_pgid != _pgid(own_pid) else None,
        boot, recorded_since, dict(recorded_started) if boot else {}, dict(recorded_tree) if boot is None else {},
    )
    protected = _protected(own_pid)
    gpu = set(gpu_pids)
    listening = listeners(port) if port else set()

    ours: list[ProcInfo] = []
    seen: set[int] = set()
    for p in psutil.process_iter(["name", "cmdline", "create_time", "status"]):
        if p.pid in protected or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # a zombie holds nothing and cannot be killed again
        try:
            argv = p.info["cmdline"] or []
            info = ProcInfo(p.pid, p.info["name"] or "", " ".join(argv), p.info["create_time"])
            reason = _why_ours(p, info, proof, instance)
            if reason:
                ours.append(_with(info, reason, started(p.pid)))
                seen.add(p.pid)
        except psutil.Error:
            continue

    foreign = [_describe_foreign(pid) for pid in sorted(gpu - seen - protected)]
    port_holders = [_describe_foreign(pid, "port") for pid in sorted(listening - seen - protected)]
    return StaleReport(ours, foreign, port_holders)


def instance_id(state_dir: str) -> str:
    """This daemon's mark value: derived from its state directory, which one daemon at a time
    owns (the store's lock), so it survives a lost or corrupt state file and differs between
    daemons (and users) on one host."""
    real = Path(state_dir).expanduser().resolve()
    return hashlib.sha256(f"{socket.gethostname()}:{real}".encode()).hexdigest()[:20]


def carries_mark(environ: dict[str, str], instance: str | None) -> bool:
    """Whether an environment carries our mark (pure)."""
    return bool(instance) and environ.get(MARK_VAR) == instance


class _Proof(NamedTuple):
    """What the state file recorded that proves a process ours (``find_stale``)."""

    pgid: int | None
    same_boot: bool | None  # None: the state file did not say (a daemon before procstart)
    since: float | None
    started: dict[int, int]  # pid -> start since boot, in the recorded boot
    created: dict[int, float]  # pid -> create time, from a state file without the boot


def _why_ours(p: psutil.Process, info: ProcInfo, proof: _Proof, instance: str | None) -> str | None:
    created = info.create_time or 0.0
    pgid = proof.pgid
    if pgid is not None and (proof.same_boot or (
            proof.same_boot is None and (proof.since is None or created >= proof.since - 1.0))):
        if _pgid(p.pid) == pgid:
            return f"process group {pgid}"
        if _sid(p.pid) == pgid:
            return f"session {pgid}"
    if p.pid in proof.started and started(p.pid) == proof.started[p.pid]:
        return "recorded in our server's tree"
    if p.pid in proof.created and abs(proof.created[p.pid] - created) < 1.0:
        return "recorded in our server's tree"
    if instance:
        try:
            environ = p.environ()
        except psutil.Error:
            return None  # not readable by us: not provably ours
        if carries_mark(environ, instance):
            return f"marked {MARK_VAR}={instance} launch {environ.get(LAUNCH_VAR, '?')}"
    return None


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _with(info: ProcInfo, reason: str, start: int) -> ProcInfo:
    return ProcInfo(info.pid, info.name, info.cmdline, info.create_time, reason, start)


def _describe_foreign(pid: int, why: str = "gpu") -> ProcInfo:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            argv, name = p.cmdline(), p.name()
            kind = server_kind(argv, name)
            reason = f"{why}: {kind}, not ours (no mark)" if kind else why
            return ProcInfo(pid, name, " ".join(argv), p.create_time(), reason, started(pid))
    except psutil.NoSuchProcess:
        return ProcInfo(pid, reason="unknown pid (another pid namespace?)")
    except psutil.Error:
        return ProcInfo(pid, reason="gpu (details not readable)", create_time=0.0)


async def scan_stale(
    *,
    recorded_pgid: int | None,
    gpu_pids: Collection[int],
    own_pid: int,
    port: int | None = None,
    recorded_since: float | None = None,
    instance: str | None = None,
    recorded_tree: Collection[tuple[int, float]] = (),
    recorded_boot: str | None = None,
    recorded_started: Collection[tuple[int, int]] = (),
) -> StaleReport:
    """``find_stale`` in a worker thread."""
    return await asyncio.to_thread(
        lambda: find_stale(
            recorded_pgid=recorded_pgid, gpu_pids=gpu_pids, own_pid=own_pid,
            port=port, recorded_since=recorded_since, instance=instance, recorded_tree=recorded_tree,
            recorded_boot=recorded_boot, recorded_started=recorded_started,
        )
    )


async def kill_stale(
    report: StaleReport,
    *,
    grace_s: float,
    kill_foreign: bool = False,
    own_pid: int | None = None,
    kill_wait_s: float = 10.0,
) -> list[int]:
    """SIGTERM the stale processes, SIGKILL what is left after ``grace_s``; the pids now gone.

    Foreign processes only with ``kill_foreign`` and only when visible in our ``/proc``.
    Never our own process or its ancestors. A process whose pid now belongs to a newer
    process (create time differs), or that we may not signal, is left alone: it is simply
    not in the returned list. Runs in a worker thread.
    """
    targets = [*report.ours, *((*report.foreign, *report.port_holders) if kill_foreign else ())]
    return await asyncio.to_thread(
        _terminate, targets, grace_s, kill_wait_s, _protected(own_pid or os.getpid())
    )


def _terminate(targets: list[ProcInfo], grace_s: float, kill_wait_s: float, protected: set[int]) -> list[int]:
    procs: list[psutil.Process] = []
    for t in targets:
        if t.pid in protected or not t.visible:
            continue
        try:
            p = psutil.Process(t.pid)
            if t.started is not None and started(t.pid) != t.started:
                continue  # the pid was reused: not the process we found
            if t.started is None and t.create_time and abs(p.create_time() - t.create_time) > 1.0:
                continue  # (a report made without the start: the create time, as near as the clock allows)
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            p.send_signal(signal.SIGTERM)
            procs.append(p)
        except psutil.Error:
            continue  # gone already, or not ours to signal (AccessDenied): not reported as killed
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(alive, timeout=kill_wait_s)
    return [p.pid for p in procs if not _exists(p)]


def _exists(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
