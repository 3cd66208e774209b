"""The daemon's outgoing events: one frozen dataclass per kind, one stream to every sink.

The pure core returns ``Emit(event)`` actions; the daemon stamps each event with ``host``
and ``instance`` and hands it to every ``EventSink`` (structlog logger, Prometheus metrics,
MQTT alerts). A sink's ``emit`` must never block and never raise: it is called on the event
loop, in the middle of a restart decision.

Inside, fields keep their types (``Cause``, ``Phase``, ``State``, tuples). Strings appear
only at the edge: ``event.fields()`` is the JSON-able form (enums as their values, tuples
as lists, ``from_`` as ``from``) that the log line, the metric labels and the MQTT payload
are made of. ``from_fields(kind, fields)`` is its inverse, for replaying a log line.

A class says what it is for: ``kind`` (its name in logs and metrics), ``alert`` (the MQTT
event kind, topic ``.../event/{alert}``, or None) with its ``severity``, and ``quiet`` (too
frequent for the info log). Adding an alert kind is one class here and one wording function
in ``supervisor/sinks/alerts.py`` (its ``case`` in ``said``); ``tests/test_events.py`` holds both to it.

Log-only lines (not events): daemon_refused, reaper_started, reaper_unavailable, server_stopping,
metrics_listening, metrics_unavailable, task_failed, sink_failed, state_corrupt, state_unreadable,
journal_write_failed, gpu_ring_write_failed.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

Json = dict[str, Any]  # a nested JSON-able record (a GPU reading, a check, a port holder...)

EVENTS: dict[str, type[Event]] = {}
"""Every event class by its ``kind``."""


def _edge(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_edge(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _edge(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One thing that happened. Subclasses add typed fields; construct them by keyword."""

    kind: ClassVar[str] = ""
    alert: ClassVar[str | None] = None  # the MQTT event kind, or None: not an alert
    severity: ClassVar[str] = ""  # info | warning | critical (alerts only)
    quiet: ClassVar[bool] = False  # too frequent for the info log (metrics still see it)

    host: str = ""  # stamped by the daemon
    instance: str = ""
    server: str = ""  # the server's name, with several [[server]] in one daemon

    def __init_subclass__(cls) -> None:
        # (no super() call: slots=True rebuilds the class, and the zero-argument form would
        # see the class it replaced; object's hook does nothing)
        if cls.kind:
            if cls.kind in EVENTS and EVENTS[cls.kind].__qualname__ != cls.__qualname__:
                raise TypeError(f"event kind {cls.kind!r} defined twice")
            EVENTS[cls.kind] = cls

    def fields(self) -> Json:
        """The edge form: JSON-able, enums as strings, ``from_`` as ``from``; without the
        stamp when it is empty."""
        out: Json = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("host", "instance", "server") and not value:
                continue
            out[f.name.rstrip("_")] = _edge(value)
        return out


def _parse(hint: object, value: object) -> object:
    """An edge value back to the field's type (enums, tuples); others as they are."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            if arm is type(None):
                continue
            return _parse(arm, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if origin is tuple and isinstance(value, list | tuple):
        (item, *_rest) = typing.get_args(hint) or (object,)
        return tuple(_parse(item, v) for v in value)
    return value


def from_fields(kind: str, fields: Mapping[str, Any]) -> Event:
    """The typed event for an edge form (``fields()``'s inverse). An unknown kind or field
    raises ``ValueError``."""
    cls = EVENTS.get(kind)
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name.rstrip("_"): f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - set(names)
    if unknown:
        raise ValueError(f"{kind}: unknown field(s) {sorted(unknown)}")
    values: dict[str, Any] = {names[k]: _parse(hints[names[k]], v) for k, v in fields.items()}
    return cls(**values)


class EventSink(Protocol):
    """Receives every event. Must not block and must not raise."""

    def emit(self, event: Event) -> None: ...


def alert_kinds() -> dict[str, str]:
    """Daemon event kind -> MQTT event kind, for every alerting event."""
    return {k: cls.alert for k, cls in EVENTS.items() if cls.alert}


def quiet_events() -> frozenset[str]:
    return frozenset(k for k, cls in EVENTS.items() if cls.quiet)
