"""Events as sinks see them at their edge, for feeding a sink by hand.

A sink reads ``event.kind``, ``event.quiet`` and ``event.fields()`` (the edge form). The
daemon always hands it a typed event (``supervisor.core.events``); ``edge`` builds one from
a kind and a fields dict, and when the dict is partial or malformed on purpose (a sink must
never raise, whatever it gets) it stands in with exactly those fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from supervisor.core.events import EVENTS, Event, from_fields


class Edge:
    """Any kind with any fields: what a typed event cannot be, on purpose."""

    def __init__(self, kind: str, fields: Mapping[str, Any]) -> None:
        self.kind = kind
        self._fields = dict(fields)
        cls = EVENTS.get(kind)
        self.quiet = bool(cls and cls.quiet)

    def fields(self) -> dict[str, Any]:
        return dict(self._fields)

    def __repr__(self) -> str:
        return f"Edge({self.kind!r}, {self._fields!r})"


def edge(kind: str, fields: Mapping[str, Any] | None = None) -> Event | Edge:
    """The typed event when ``fields`` make a whole one, else an ``Edge`` with just them."""
    fields = dict(fields or {})
    try:
        event = from_fields(kind, fields)
    except (ValueError, TypeError, KeyError):
        return Edge(kind, fields)
    return event if event.fields() == {k: v for k, v in fields.items()} else Edge(kind, fields)
