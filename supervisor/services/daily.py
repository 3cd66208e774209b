"""``[report] daily_at = "08:30"``: a daily summary alert with the key figures of the last 24 h.

When it is due is pure (``core.night.next_daily``: the wall time handed in, the local zone,
DST included); this task only waits for it, reads each server's journal and GPU ring (in a
thread: a file read must not hold up the event loop) through the ``Readers`` it is handed
(the composition root, ``supervisor/cli/run.py``, hands in the sinks' own readers: a service
imports no sink) and emits one ``DailySummary`` per server through that server's sinks, its
MQTT alerter among them. The wait is cut into steps
of at most ``STEP_S`` that each re-read the wall clock, so a clock set or a suspended host
does not make the summary late by the jump.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from typing import Any, Protocol

from supervisor.core.config import Config, server_configs, unit_name
from supervisor.core.events import DailySummary
from supervisor.core.night import next_daily, parse_time_of_day, summarize

PERIOD_S = 24 * 3600.0
STEP_S = 60.0

Emit = Callable[[str, DailySummary], None]
"""(server name, event): hand the summary to that server's sinks."""


class GpuRing(Protocol):
    """What the summary reads of a server's GPU memory ring (``sinks.gpuring.Ring``)."""

    @property
    def free_mib(self) -> Sequence[Sequence[int]]: ...  # per record, per rank


class JournalReader(Protocol):
    """A state directory's journal records, oldest first (``sinks.journal.read_journal``)."""

    def __call__(self, state_dir: str) -> Iterable[Mapping[str, Any]]: ...


class RingReader(Protocol):
    """A state directory's GPU memory ring from ``since`` on, or None (``sinks.gpuring.read_ring``)."""

    def __call__(self, state_dir: str, since: float | None = ...) -> GpuRing | None: ...


@dataclass(frozen=True, slots=True)
class Readers:
    """How a server's records are read back from its state directory."""

    journal: JournalReader
    ring: RingReader


def zone(name: str) -> tzinfo:
    """``[report] timezone`` ("Europe/Paris"), else the host's local zone with its DST rules:
    ``$TZ`` if it names a zone, else ``/etc/localtime``. Only if neither can be read, the
    host's offset now (fixed: a DST change would then move the time by an hour)."""
    from zoneinfo import ZoneInfo

    if name:
        return ZoneInfo(name)
    env = os.environ.get("TZ", "").lstrip(":")
    if env:
        with contextlib.suppress(KeyError, ValueError, OSError):
            return ZoneInfo(env)
    with contextlib.suppress(ValueError, OSError), Path("/etc/localtime").open("rb") as f:
        return ZoneInfo.from_file(f, key="localtime")
    local = datetime.now().astimezone().tzinfo
    assert local is not None
    return local


def summary(cfg: Config, now: float, readers: Readers) -> DailySummary:
    """The last 24 h of one server (``cfg``: its own config) as a ``DailySummary``."""
    night = summarize(readers.journal(cfg.state.dir), start=now - PERIOD_S, end=now,
                      floor=cfg.policy.fraction_ladder[-1])
    ring = readers.ring(cfg.state.dir, since=now - PERIOD_S)
    least = min(min(row) for row in ring.free_mib) / 1024 if ring is not None and ring.free_mib else None
    return DailySummary(
        period_h=round(night.span_s / 3600, 1), state=night.state, serving_pct=round(night.serving_pct, 1),
        crashes=night.crash_count, causes=tuple(f"{cause} x {n}" for cause, n in night.crashes),
        lost_s=round(night.lost_crash_s + night.lost_restart_s, 1), mem_fraction_static=night.fraction_start,
        next_mem_fraction_static=night.fraction_end, open_problems=tuple(kind for kind, _ in night.open_problems),
        least_free_gb=round(least, 2) if least is not None else None,
    )


async def run(
    config: Callable[[], Config],
    emit: Emit,
    *,
    clock: Callable[[], float],
    readers: Readers,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    tz: tzinfo | None = None,
) -> None:
    """Emit each server's summary at every ``daily_at``, until cancelled. ``config`` is the
    config in force (re-read at every step: a reload that sets, moves or clears ``daily_at``
    or ``timezone`` takes effect within ``STEP_S``); ``readers`` read each server's records;
    ``tz`` overrides the zone (tests)."""
    while True:
        cfg = config()
        if not cfg.report.daily_at:
            await sleep(STEP_S)
            continue
        at = parse_time_of_day(cfg.report.daily_at)
        due = next_daily(datetime.fromtimestamp(clock(), UTC), at, tz or zone(cfg.report.timezone)).timestamp()
        while (left := due - clock()) > 0:
            await sleep(min(left, STEP_S))
            if config() is not cfg:
                break  # reloaded: work the time out again
        else:
            now = clock()
            for unit in server_configs(cfg):
                event = await asyncio.to_thread(summary, unit, now, readers)
                emit(unit_name(unit), event)
