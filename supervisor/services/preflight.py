"""Preflight: the checks run before every launch (and by ``sglang-supervisor preflight``).

A service over the ports, beside the daemon: the daemon reaches it through its
``Preflight`` port (a ``HostPreflight``, built by the composition root), the CLI command
(``supervisor/cli/preflight.py``) directly. The checks are pure functions of facts
(``check_*`` return a ``Check``); ``run_preflight`` gathers the facts (GPU probe,
``psutil.virtual_memory``, a bind test on the port and its listeners, the model path), and
``cli_checks`` also finds our stale servers (the ``Cleanup`` port) so that a port they hold
does not fail the check. The concrete adapters (``adapters.cleanup``, the state store) are
handed in by the caller: a service imports none. ``permanent`` marks a failure that waiting cannot fix
(config arithmetic): the daemon gives up on it, and retries on the backoff otherwise.

Units: ``--hicache-size`` is in GB of 10^9 bytes per TP rank, as SGLang reads it, so host
RAM is reported in the same GB.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from supervisor.adapters.ports import Check, Cleanup, GpuProbe, GpuProbeError
from supervisor.core.config import Config, ServerConfig
from supervisor.core.ownership import recorded_server

GB = 10**9

VersionReader = Callable[[Sequence[str]], tuple[str | None, str]]
"""The SGLang version the server command's Python has installed: ``(version, "")``, or
``(None, why)`` in one line (``adapters.versions``, handed in by the CLI)."""

Listeners = Callable[[int], Collection[int]]
"""Pids listening on a TCP port (blocking; ``Cleanup.listeners``)."""

StateReader = Callable[[str], Mapping[str, Any] | None]
"""A state directory's recorded state, read without moving a corrupt file aside (None: none)."""


def _n(x: float) -> str:
    """A number of GB as people write it: 2400, 449, 25, 0.5."""
    return f"{x:.0f}" if x >= 10 or abs(x - round(x)) < 0.05 else f"{x:.1f}"


# --------------------------------------------------------------------------- pure checks


def check_gpu_count(visible: int, tp_size: int, dp_size: int, ranks_on_host: int | None = None) -> Check:
    """Enough GPUs for the ranks this host runs (tp × dp, or fewer with several nodes)."""
    needed = ranks_on_host if ranks_on_host is not None else tp_size * dp_size
    arithmetic = f"tp {tp_size} × dp {dp_size}" + ("" if needed == tp_size * dp_size else " on this node")
    if visible >= needed:
        return Check("gpu_count", True, f"{visible} GPUs visible; {arithmetic} needs {needed}")
    return Check(
        "gpu_count", False,
        f"{arithmetic} needs {needed} GPUs; only {visible} visible", permanent=True,
    )


def check_host_ram(
    hicache_size_gb: float,
    ranks_on_host: int,
    available_bytes: int,
    margin_gb: float,
    total_bytes: int | None = None,
) -> Check:
    """The hierarchical cache (GB per rank × ranks) plus a margin must fit in available RAM.

    Permanent when it cannot fit even in the host's total RAM; otherwise other processes
    may free memory, so it is worth retrying.
    """
    if hicache_size_gb <= 0:
        return Check("host_ram", True, "hicache_size_gb is 0: no fixed hierarchical cache to check")
    ask = hicache_size_gb * ranks_on_host
    need = ask + margin_gb
    available = available_bytes / GB
    arithmetic = (
        f"hierarchical cache asks {_n(hicache_size_gb)} GB × {ranks_on_host} ranks = {_n(ask)} GB; "
        f"this host has {_n(available)} GB available"
    )
    if need <= available:
        return Check("host_ram", True, f"{arithmetic} (keeps a {_n(margin_gb)} GB margin)")
    fits = int((available - margin_gb) // ranks_on_host)
    advice = (
        f"lower hicache_size_gb to at most {fits}" if fits >= 1
        else "free host memory or turn the hierarchical cache off"
    )
    permanent = total_bytes is not None and need > total_bytes / GB
    return Check(
        "host_ram", False,
        f"{arithmetic}, and {_n(need)} GB are needed with the {_n(margin_gb)} GB margin: {advice}",
        permanent=permanent,
    )


def check_port(
    host: str,
    port: int,
    held_by_our_stale_server: bool,
    *,
    bindable: bool,
    holder: str = "",
    error: str = "",
) -> Check:
    """The port is free, or held by a stale server of ours that is cleared before the launch."""
    where = f"{host}:{port}"
    if bindable:
        return Check("port", True, f"{where} is free")
    if held_by_our_stale_server:
        return Check("port", True, f"{where} is held by a stale server of ours ({holder}); it is killed before launch")
    if error:  # not "in use": an address that is not ours, or a privileged port
        return Check("port", False, f"cannot bind {where}: {error}", permanent=True)
    return Check("port", False, f"{where} is in use by another process ({holder or 'unknown holder'})")


def looks_local(model_path: str) -> bool:
    """A path, not a Hugging Face id (``moonshotai/Kimi-K2.5``): starts with /, ./, ../ or ~."""
    return model_path.startswith(("/", "./", "../", "~")) or model_path in (".", "..")


def check_model_path(model_path: str, exists: bool) -> Check:
    """A local model path must exist; a Hugging Face id is left to SGLang.

    ``exists`` is whether the path (resolved against the server's working directory)
    exists. A missing path is permanent (the daemon gives up with ``model_load_error``, as
    SGLang itself would after a minute of imports): a network mount that comes up after
    boot is ordered with systemd's ``RequiresMountsFor=`` (docs/systemd.md), not waited
    for here.
    """
    if not model_path:
        return Check("model_path", False, "server.model_path is empty", permanent=True)
    if exists:
        return Check("model_path", True, f"{model_path} exists")
    if looks_local(model_path):
        return Check("model_path", False, f"{model_path} does not exist (not mounted?)", permanent=True)
    return Check("model_path", True, f"{model_path} is a Hugging Face id (not checked here)")


def check_server_command(argv0: str, resolved: str | None, executable: bool) -> Check:
    """``[server] command``'s first word, found on PATH (or as a path), is an executable file."""
    if not argv0:
        return Check("server_command", False, "[server] command is empty", permanent=True)
    if resolved is None:
        where = "does not exist" if os.sep in argv0 else "is not on PATH"
        return Check("server_command", False, f"[server] command {argv0}: {where}", permanent=True)
    if not executable:
        return Check("server_command", False, f"[server] command {resolved}: not an executable file", permanent=True)
    shown = resolved if resolved == argv0 else f"{argv0} ({resolved})"
    return Check("server_command", True, f"{shown} is executable")


def sglang_module(command: Sequence[str]) -> str | None:
    """The module a ``python -m MODULE`` command runs, or None for a console script."""
    args = list(command)
    return args[args.index("-m") + 1] if "-m" in args[1:-1] else None


def check_sglang_version(version: str | None, error: str, tested: str) -> Check:
    """The server's Python has SGLang; a release other than the tested one is a warning naming it."""
    if version is None:
        return Check("sglang", False, error, permanent=True)
    if version != tested:
        return Check("sglang", True, f"SGLang {version}: not the release tested with this supervisor "
                                     f"({tested}); crash words it relies on may differ", warning=True)
    return Check("sglang", True, f"SGLang {version} (the release tested)")


def ranks_on_host(server: ServerConfig) -> int:
    """Scheduler processes on this node: tp × dp divided over ``--nnodes`` (from extra_args)."""
    nnodes = 1
    args = list(server.extra_args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--nnodes=") else (
            args[i + 1] if arg == "--nnodes" and i + 1 < len(args) else None
        )
        if value is not None and value.isdigit() and int(value) >= 1:
            nnodes = int(value)
    total = server.tp_size * server.dp_size
    return -(-total // nnodes)


def all_ok(checks: Sequence[Check]) -> bool:
    return all(c.ok for c in checks)


def permanent_failure(checks: Sequence[Check]) -> bool:
    """True when a failed check cannot pass by waiting: give up instead of retrying."""
    return any(not c.ok and c.permanent for c in checks)


def failed_fields(checks: Sequence[Check]) -> dict[str, Any]:
    """Fields of the ``preflight_failed`` event."""
    return {
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
        "permanent": permanent_failure(checks),
    }


def _verdict(c: Check) -> str:
    return "FAIL" if not c.ok else "warn" if c.warning else "ok"


def format_table(checks: Sequence[Check]) -> str:
    """The checks as an aligned text table, one line each."""
    width = max([len("CHECK"), *(len(c.name) for c in checks)])
    lines = [f"{'CHECK':<{width}}  RESULT  DETAIL"]
    lines += [f"{c.name:<{width}}  {_verdict(c):<6}  {c.detail}" for c in checks]
    failed = [c for c in checks if not c.ok]
    if failed:
        permanent = sum(c.permanent for c in failed)
        lines.append(
            f"{len(failed)} check(s) failed"
            + (f"; {permanent} cannot pass by waiting (fix the config or the host)" if permanent else "")
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- facts (I/O)


@dataclass(frozen=True, slots=True)
class _PortFacts:
    bindable: bool
    holders: dict[int, str]  # pid -> name of the listeners on the port
    error: str = ""  # set when binding failed for another reason than "in use"


def _probe_port(host: str, port: int, listeners: Listeners) -> _PortFacts:
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return _PortFacts(False, {}, f"cannot resolve {host!r}: {exc.strerror}")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
            return _PortFacts(True, {})
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return _PortFacts(False, {}, exc.strerror or str(exc))
    return _PortFacts(False, _holders(port, listeners))


def _holders(port: int, listeners: Listeners) -> dict[int, str]:
    holders: dict[int, str] = {}
    for pid in listeners(port):
        try:
            holders[pid] = psutil.Process(pid).name()
        except psutil.Error:
            holders[pid] = "?"
    return holders


def _model_exists(cfg: Config) -> bool:
    path = Path(cfg.server.model_path).expanduser()
    if not path.is_absolute():
        path = Path(cfg.server.cwd or cfg.state.dir) / path
    return path.exists()


def _host_facts(cfg: Config, listeners: Listeners) -> tuple[Any, _PortFacts, bool]:
    return (
        psutil.virtual_memory(),
        _probe_port(cfg.server.host, cfg.server.port, listeners),
        bool(cfg.server.model_path) and _model_exists(cfg),
    )


async def _gpu_check(cfg: Config, probe: GpuProbe, ranks: int, degraded_ok: bool) -> Check:
    if cfg.gpu.backend == "none":
        return Check("gpu_count", True, 'not checked: [gpu] backend = "none"')
    try:
        gpus = await probe.sample()
    except GpuProbeError as exc:
        if degraded_ok and not exc.lost:
            # The daemon runs degraded rather than refuse to launch: SGLang finds its GPUs itself.
            return Check("gpu_count", True, f"not checked (GPU probe unavailable: {exc})")
        return Check("gpu_count", False, f"cannot read the GPUs: {exc}", permanent=exc.lost)
    return check_gpu_count(len(gpus), cfg.server.tp_size, cfg.server.dp_size, ranks)


async def run_preflight(
    cfg: Config, probe: GpuProbe, *, listeners: Listeners, stale_pids: Collection[int] = (), degraded_ok: bool = False
) -> list[Check]:
    """Gather the facts and run every check. ``listeners``: who holds a port (``Cleanup.listeners``).
    ``stale_pids``: processes of ours due to be killed.
    ``degraded_ok``: a failing GPU probe (no NVML, NVML errors) passes the GPU check unless
    the GPU is lost (the daemon runs degraded; the CLI reports the failure)."""
    ranks = ranks_on_host(cfg.server)
    gpu_check = await _gpu_check(cfg, probe, ranks, degraded_ok)
    mem, port, model_exists = await asyncio.to_thread(_host_facts, cfg, listeners)
    held_by_ours = bool(port.holders) and set(port.holders) <= set(stale_pids)
    holder = ", ".join(f"pid {pid} {name}" for pid, name in sorted(port.holders.items()))
    return [
        gpu_check,
        check_host_ram(cfg.server.hicache_size_gb, ranks, mem.available, cfg.gpu.host_ram_margin_gb, mem.total),
        check_port(
            cfg.server.host, cfg.server.port, held_by_ours, bindable=port.bindable, holder=holder, error=port.error,
        ),
        check_model_path(cfg.server.model_path, model_exists),
    ]


def _command_facts(command: Sequence[str]) -> tuple[str, str | None, bool]:
    argv0 = command[0] if command else ""
    resolved = (argv0 if Path(argv0).exists() else None) if os.sep in argv0 else shutil.which(argv0)
    executable = resolved is not None and Path(resolved).is_file() and os.access(resolved, os.X_OK)
    return argv0, resolved, executable


async def command_checks(cfg: Config, read_version: VersionReader, tested: str) -> list[Check]:
    """The server command exists and is executable; its Python has SGLang, of the tested release.
    A ``python -m MODULE`` command whose module is not SGLang's (a simulator, a wrapper) is not
    asked for SGLang."""
    argv0, resolved, executable = _command_facts(cfg.server.command)
    command = check_server_command(argv0, resolved, executable)
    if not command.ok:
        return [command]
    module = sglang_module(cfg.server.command)
    if module is not None and module.split(".")[0] != "sglang":
        return [command, Check("sglang", True, f"not checked: the command runs {module}, not SGLang's module")]
    version, error = await asyncio.to_thread(read_version, cfg.server.command)
    return [command, check_sglang_version(version, error, tested)]


async def cli_checks(
    cfg: Config, probe: GpuProbe, *, cleanup: Cleanup, read_state: StateReader,
    read_version: VersionReader | None = None, tested: str = "",
) -> list[Check]:
    """The checks as ``sglang-supervisor preflight`` runs them: our own stale servers (found
    as before a launch, through ``cleanup``, from the state ``read_state`` reads) do not fail
    the port check; with ``read_version``, the server command and its SGLang (against
    ``tested``) are checked too. Closes ``probe``."""
    try:
        try:
            gpu_pids = {p.pid for g in await probe.sample() for p in g.processes}
        except GpuProbeError:
            gpu_pids = set()  # the gpu_count check reports it
        state = read_state(cfg.state.dir)
        recorded = recorded_server(state or {})
        instance = cleanup.instance_id(cfg.state.dir)
        stale = await asyncio.to_thread(lambda: cleanup.find_stale(
            gpu_pids=gpu_pids, own_pid=os.getpid(), port=cfg.server.port, instance=instance, **recorded,
        ))
        checks = await run_preflight(cfg, probe, listeners=cleanup.listeners, stale_pids={p.pid for p in stale.ours})
        if read_version is not None:
            checks += await command_checks(cfg, read_version, tested)
        return checks
    finally:
        await probe.aclose()


class HostPreflight:
    """The daemon's ``Preflight`` port (``adapters.ports.Preflight``): ``run_preflight`` on this
    host, a port's listeners found through ``cleanup`` (the composition root passes
    ``adapters.cleanup``)."""

    def __init__(self, cleanup: Cleanup) -> None:
        self.cleanup = cleanup

    async def run_preflight(
        self, cfg: Config, probe: GpuProbe, *, stale_pids: Collection[int] = (), degraded_ok: bool = False
    ) -> list[Check]:
        return await run_preflight(
            cfg, probe, listeners=self.cleanup.listeners, stale_pids=stale_pids, degraded_ok=degraded_ok,
        )
