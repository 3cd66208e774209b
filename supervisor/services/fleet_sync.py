"""Fleet memory (docs/fleet.md): one server's side of the record its fleet shares in etcd.

The core decides (``machine.FleetAdvice`` lowers the rung, ``FleetShare`` asks for a write);
this service does the I/O over the ``FleetStore`` port (etcd's client):

- ``advice`` runs in the unit's prepare step, before every launch: it reads the
  configuration's identity (the SGLang version of ``[server] command``'s own Python, read
  once per command and environment in a thread; the GPU name and memory from the unit's GPU
  probe sample), computes its key (``core.fleet.fleet_key``) and reads the record there;
- ``share`` merges OOMs, and the memory model's points and kept climb (``core.capacity``),
  into the record: read, merge (``core.fleet.merge``), compare-and-swap on the key's
  mod_revision (create only if absent), again on a conflict. A failed
  write is reported (``fleet_error``) and retried on a backoff until it works; the core
  keeps the lessons in ``state.json`` until a ``FleetShared`` says they are in, so a daemon
  restarted meanwhile merges them at its next launch.

Nothing here raises into supervision: etcd away, a record that is not ours, a version that
cannot be read, each is one ``fleet_error`` and the server is launched on its own rung.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from supervisor.adapters.ports import FleetStore, GpuInfo, VersionReader
from supervisor.aio import Backoff, Reconnect, within
from supervisor.core import events as ev
from supervisor.core.capacity import MemoryPoint
from supervisor.core.config import Config
from supervisor.core.fleet import FleetOom, FleetRecord, fleet_identity, fleet_key, merge
from supervisor.core.messages import FleetAdvice, FleetShare
from supervisor.core.ownership import server_env

UNKNOWN_GPU = "unknown"  # [gpu] backend = "none": no GPU name or memory to key on
CAS_TRIES = 20  # conflicts in a row before a write counts as failed (and is retried later)
RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 60.0
RETRY = Backoff(initial=RETRY_INITIAL_S, maximum=RETRY_MAX_S, jitter=(0.8, 1.2))
DETAIL_CHARS = 300


class FleetUnavailable(Exception):
    """The record cannot be used for this launch; ``op`` says which step failed."""

    def __init__(self, op: str, message: str) -> None:
        super().__init__(message)
        self.op = op


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:DETAIL_CHARS]


def gpu_identity(cfg: Config, gpus: Sequence[GpuInfo]) -> tuple[str, int]:
    """(name, total bytes) of the server's GPUs: the names seen (several kinds joined with
    ``+``) and the smallest card's memory; ``("unknown", 0)`` with ``backend = "none"``.
    A GPU backend that saw no card is no identity at all (``FleetUnavailable``)."""
    if cfg.gpu.backend == "none":
        return UNKNOWN_GPU, 0
    if not gpus:
        raise FleetUnavailable("gpu", f"the {cfg.gpu.backend} GPU probe saw no GPU: the fleet key needs its name and memory")
    names = sorted({" ".join(g.name.split()) or UNKNOWN_GPU for g in gpus})
    return "+".join(names), min(g.total_bytes for g in gpus)


def source_of(oom: FleetOom | None) -> str:
    if oom is None:
        return ""
    return f"{oom.host or '?'}/{oom.server or '?'} ({oom.config or '?'})"


class FleetSync:
    """One server's reads and writes of its fleet record (see the module docstring)."""

    def __init__(
        self,
        store: FleetStore,
        read_version: VersionReader,
        *,
        prefix: str,
        host: str,
        emit: Callable[[ev.Event], None],
        shared: Callable[[tuple[FleetOom, ...]], None],
        wall_now: Callable[[], str],
        timeout_s: float,
        environ: Mapping[str, str],
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._read_version = read_version
        self.prefix = prefix
        self._host = host
        self._emit = emit
        self._shared = shared
        self._wall_now = wall_now
        self._timeout_s = timeout_s
        self._environ = environ
        self._rng = rng or random.Random()
        self._versions: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], str] = {}
        self._wanted = FleetShare(())
        self._kick = asyncio.Event()
        self.key = ""  # the key of the last launch's configuration
        # etcd's outages as the fleet sees them (its reads and writes): one link_down when
        # the first call fails, one link_up when one is answered again; each failure is
        # its fleet_error all the same (op, key, the retry's wait).
        self._link = Reconnect(
            "fleet", RETRY, on_down=lambda error: emit(ev.LinkDown(link="fleet", error=_why(error))),
            on_up=lambda down_s: None if down_s is None else emit(ev.LinkUp(link="fleet", down_s=down_s)), rng=self._rng,
            clock=lambda: asyncio.get_running_loop().time(),
        )

    # -- reading, before a launch -----------------------------------------------------------

    async def advice(self, cfg: Config, gpus: Sequence[GpuInfo]) -> FleetAdvice:
        """What the fleet knows of the configuration about to be launched. Never raises:
        a failure is one ``fleet_error`` and an advice without a fraction."""
        try:
            self.key = ""
            self.key = await self._key(cfg, gpus)
            try:
                entry = await within(self._store.get(self.key), self._timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._link.failed(exc)  # the next read is at the next launch: its wait is not used
                raise
            self._link.connected()
            if entry is None:
                return FleetAdvice(self.key)
            record = FleetRecord.from_json(self.key, entry.value)
        except asyncio.CancelledError:
            raise
        except FleetUnavailable as exc:
            self._error(exc.op, str(exc))
            return FleetAdvice(self.key)
        except Exception as exc:  # noqa: BLE001 - etcd's error, a timeout, a record not ours: the fleet is advice, never a reason to stop supervising
            self._error("read", _why(exc))
            return FleetAdvice(self.key)
        lowest = record.lowest()
        return FleetAdvice(
            self.key, record.rung, tuple(sorted(record.oom_fractions, reverse=True)),
            source=source_of(lowest), when=lowest.when if lowest else "", points=record.points, kept=record.kept,
        )

    async def _key(self, cfg: Config, gpus: Sequence[GpuInfo]) -> str:
        gpu_name, gpu_bytes = gpu_identity(cfg, gpus)
        version = await self.version(cfg)
        s = cfg.server
        identity = fleet_identity(
            model=s.model_path, sglang_version=version, gpu_name=gpu_name, gpu_memory_bytes=gpu_bytes,
            tp=s.tp_size, dp=s.dp_size, extra_args=s.extra_args, hicache_size_gb=s.hicache_size_gb,
        )
        return fleet_key(identity, self.prefix)

    async def version(self, cfg: Config) -> str:
        """The SGLang version of the server's own Python, with the server's environment
        (its PYTHONPATH may pick the sglang); read once per command and environment."""
        env = server_env(cfg.server.pass_env, cfg.server.env, self._environ)
        cache_key = (tuple(cfg.server.command), tuple(sorted(env.items())))
        if cache_key not in self._versions:
            try:
                self._versions[cache_key] = await asyncio.to_thread(self._read_version, cfg.server.command, env)
            except Exception as exc:  # noqa: BLE001 - VersionError (one line) or any failure to run the probe
                raise FleetUnavailable("version", _why(exc)) from None
        return self._versions[cache_key]

    # -- writing, after an OOM --------------------------------------------------------------

    def share(self, wish: FleetShare) -> None:
        """What the record should hold of us: the core's lessons not yet in it and its memory
        model (all of it each time: the latest wish wins)."""
        self._wanted = wish
        self._kick.set()

    async def run(self) -> None:
        """Write what is wanted; after a failure, again on the backoff, until it is in."""
        retrying = False
        while True:
            if not retrying:
                await self._kick.wait()
            self._kick.clear()
            wish = self._wanted
            if not wish.entries and not wish.model_key:
                retrying = False
                continue
            error = await self._write_all(wish)
            if error is None:
                retrying = False
                if wish.entries:
                    self._shared(wish.entries)
                continue
            op, exc, key = error
            if not key:
                # No key to write under (the launch's identity could not be read, which its
                # own fleet_error said): the next launch that reads one kicks this again.
                retrying = False
                continue
            delay = self._link.failed(exc)
            retrying = True
            self._error(op, _why(exc), key=key, retry_s=round(delay, 3), pending=len(wish.entries))
            # A new lesson (or the next launch's new key) tries again at once.
            with contextlib.suppress(TimeoutError):
                await within(self._kick.wait(), delay)

    async def _write_all(self, wish: FleetShare) -> tuple[str, Exception, str] | None:
        """Each key's OOMs (and the model, under its key) merged into its record; (op, error,
        key) of the first failure."""
        by_key: dict[str, list[FleetOom]] = {}
        for oom in wish.entries:
            key = oom.key or self.key  # an OOM of a launch whose key was not known: the current one
            if not key:
                return "write", FleetUnavailable("write", "the configuration's fleet key is not known (read at the next launch)"), ""
            by_key.setdefault(key, []).append(replace(oom, host=oom.host or self._host))
        if wish.model_key:
            by_key.setdefault(wish.model_key, [])
        for key, ooms in by_key.items():
            model = key == wish.model_key
            try:
                record, conflicts = await self._merge(key, ooms, wish.points if model else (),
                                                      wish.kept if model else None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd's error or a timeout: retried, never raised into supervision
                return "write", exc, key
            self._link.connected()
            if record is not None:
                self._emit(ev.FleetUpdated(key=key, rung=record.rung, fractions=tuple(o.fraction for o in ooms),
                                           conflicts=conflicts, points=len(record.points), kept=record.kept))
        return None

    async def _merge(self, key: str, ooms: Sequence[FleetOom], points: Sequence[MemoryPoint],
                     kept: float | None) -> tuple[FleetRecord | None, int]:
        """Read, merge, compare-and-swap; again while another daemon wrote in between. The
        record written, or None when it held all of it already (nothing written)."""
        for conflicts in range(CAS_TRIES):
            entry = await within(self._store.get(key), self._timeout_s)
            old = None
            if entry is not None:
                try:
                    old = FleetRecord.from_json(key, entry.value)
                except ValueError:
                    old = None  # not a record of ours: replaced by one (compare-and-swapped all the same)
            record = merge(old, key, ooms, self._wall_now(), points, kept)
            if old is not None and replace(old, updated="") == replace(record, updated=""):
                return None, conflicts
            revision = 0 if entry is None else entry.mod_revision
            written = await within(self._store.put_if(key, record.to_json(), revision), self._timeout_s)
            if written is not None:
                return record, conflicts
        raise FleetUnavailable("write", f"{key}: {CAS_TRIES} writers in a row were first")

    def _error(self, op: str, why: str, *, key: str | None = None, retry_s: float | None = None,
               pending: int = 0) -> None:
        self._emit(ev.FleetError(op=op, key=self.key if key is None else key, error=why, retry_s=retry_s,
                                 pending=pending))
