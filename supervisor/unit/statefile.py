"""The server's state file: what it learned (the ladder, its history), the server that runs
(pid, process group, launch mark, tree), its router worker id. Read once at start, written
after every step that changed it; a write that fails is said once, and again when it works.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from supervisor.adapters.ports import Store, StoreError
from supervisor.core import events as ev
from supervisor.core.config import Config
from supervisor.core.ownership import recorded_server
from supervisor.core.state import Core, GiveUpNote, Hold, Learned
from supervisor.unit.handover import Recorded

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger


@dataclass(frozen=True)
class Loaded:
    learned: Learned
    worker_id: str | None  # the router's id for our worker, kept across daemon restarts
    recorded: Recorded  # the last server a daemon launched
    held: Hold | None = None  # an operator's ``stop --server``, kept until ``start``
    gave_up: GiveUpNote | None = None  # the last give-up, until the server serves again


class StateFile:
    def __init__(self, store: Store, *, log: FilteringBoundLogger, emit: Callable[[ev.Event], None],
                 wall_now: Callable[[], str]) -> None:
        self.store = store
        self.log = log
        self._emit = emit
        self._wall_now = wall_now
        self._failing = False
        self._last: dict[str, Any] | None = None

    def load(self, cfg: Config) -> Loaded:
        data, warning = self.store.load()
        if warning:
            self.log.warning("state_corrupt", detail=warning)
        learned = Learned.initial(cfg)
        if not data:
            return Loaded(learned, None, Recorded())
        try:
            learned = Learned.from_dict(data["learned"]).rebased(cfg)
        except (KeyError, TypeError, ValueError) as exc:
            self.log.warning("state_unreadable", detail=f"{exc!r}"[:200])
        kept = data.get("router_worker_id")
        recorded = recorded_server(data)
        return Loaded(
            learned, kept if isinstance(kept, str) else None,
            Recorded(recorded["recorded_pgid"], recorded["recorded_since"], recorded["recorded_tree"],
                     recorded["recorded_boot"], recorded["recorded_started"]),
            held=Hold.from_dict(data.get("held")), gave_up=GiveUpNote.from_dict(data.get("gave_up")),
        )

    def save(self, core: Core, server: dict[str, Any], *, instance_id: str, worker_id: str | None) -> None:
        """Write what changed (``server``: ``ServerLife.record``); the same content twice is
        written once."""
        data = {
            "learned": core.learned.to_dict(),
            "state": str(core.state),
            "reason": core.reason,
            **server,
            "instance_id": instance_id,
            "router_worker_id": worker_id,
            "daemon_pid": os.getpid(),
            "attempt": core.attempt,
            "held": None if core.held is None else core.held.to_dict(),
            "gave_up": None if core.gave_up is None else core.gave_up.to_dict(),
        }
        if data == self._last:
            return
        try:
            self.store.save({**data, "updated": self._wall_now()})
            self._last = data
            if self._failing:
                self.log.info("state_write_recovered", path=str(self.store.path))
            self._failing = False
        except StoreError as exc:
            if not self._failing:
                self._emit(ev.StateWriteFailed(error=str(exc)))
            self._failing = True
