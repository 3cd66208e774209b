"""Events as sinks see them at their edge, for feeding a sink by hand.

A sink reads ``event.kind``, ``event.quiet`` and ``event.fields()`` (the edge form). The
daemon always hands it a typed event (``supervisor.core.events``); ``edge`` builds one from
a kind and a fields dict, and when the dict is partial or malformed on purpose (a sink must
never raise, whatever it gets) it stands in with exactly those fields.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
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


def _neutral(hint: object) -> object:
    """A field's neutral value when a test leaves it out: None where the type allows it,
    else zero, empty or the enum's first member."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint):
        return None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(iter(hint)).value
    if hint is bool:
        return False
    if hint in (int, float):
        return 0
    if hint is str:
        return ""
    if origin is tuple or hint is tuple:
        return ()
    if origin is dict or hint is dict:
        return {}
    raise TypeError(f"no neutral value for {hint!r}")


def typed(kind: str, fields: Mapping[str, Any] | None = None) -> Event | Edge:
    """The typed event of ``kind`` with ``fields``, the fields a test leaves out at their
    neutral value (None, 0, "", empty, an enum's first member): what a sink that reads typed
    events (``supervisor.sinks.metrics``) is fed by hand. Fields that cannot make one (an
    unknown kind or field, a value its type refuses) give an ``Edge``, which such a sink ignores."""
    given = dict(fields or {})
    cls = EVENTS.get(kind)
    if cls is None:
        return Edge(kind, given)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f.name.rstrip("_")
        if name not in given and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            given[name] = _neutral(hints[f.name])
    try:
        return from_fields(kind, given)
    except (ValueError, TypeError, KeyError):
        return Edge(kind, dict(fields or {}))
