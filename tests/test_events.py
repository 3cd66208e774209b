"""The outgoing events are typed: one dataclass per kind, strings only at the edge.

Every event class round-trips through its edge form (``fields()`` -> ``from_fields``), the
edge form is plain JSON, and each alerting class has its severity and its wording."""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any

import pytest

from supervisor.core import events as ev
from supervisor.core.model import Cause, State
from supervisor.sinks import alerts


def sample(hint: object, *, none: bool) -> object:
    """A value of type ``hint`` (None for an optional one when ``none``)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if none else sample(arms[0], none=none)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return list(hint)[-1]
    if origin is tuple:
        return (sample(typing.get_args(hint)[0], none=none),)
    if origin is dict or hint is dict:
        return {"TP0": {"avail_mem_after_capture_gb": 0.82}}
    return {bool: True, int: 7, float: 0.88, str: "text"}.get(hint, "text")  # type: ignore[call-overload]


def instances() -> list[ev.Event]:
    out = []
    for cls in ev.EVENTS.values():
        hints = typing.get_type_hints(cls)
        for none in (False, True):
            values: dict[str, Any] = {
                f.name: sample(hints[f.name], none=none) for f in dataclasses.fields(cls) if f.name not in ("host", "instance")
            }
            out.append(cls(host="gpu-node-3", instance="kimi", **values))
    return out


def plain(value: object) -> bool:
    if isinstance(value, str):
        return type(value) is str
    if isinstance(value, dict):
        return all(type(k) is str and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return value is None or type(value) in (int, float, bool)


@pytest.mark.parametrize("event", instances(), ids=lambda e: f"{e.kind}")
def test_every_event_round_trips_through_its_edge_form(event: ev.Event) -> None:
    """fields() is plain JSON (enums as their values, tuples as lists) and from_fields gives
    the same typed event back."""
    edge = event.fields()
    assert plain(edge), edge
    assert json.loads(json.dumps(edge)) == edge
    assert ev.from_fields(event.kind, edge) == event


def test_typed_inside_plain_outside() -> None:
    """A state change keeps State and Cause; its edge form has their values, ``from`` spelt so."""
    changed = ev.StateChanged(from_=State.READY, to=State.BACKOFF, reason="crash", mem_fraction_static=0.93,
                              hicache_size_gb=48.0, restarts=1, last_cause=Cause.CUDA_OOM_RUNTIME)
    assert changed.last_cause is Cause.CUDA_OOM_RUNTIME
    assert changed.fields() == {"from": "READY", "to": "BACKOFF", "reason": "crash", "mem_fraction_static": 0.93,
                                "hicache_size_gb": 48.0, "restarts": 1, "last_cause": "cuda_oom_runtime"}


def test_from_fields_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="unknown event kind 'crashed'"):
        ev.from_fields("crashed", {})
    with pytest.raises(ValueError, match=r"stable: unknown field\(s\) \['after'\]"):
        ev.from_fields("stable", {"after": 1.0})


def test_each_kind_is_one_class() -> None:
    """Kinds are unique and every event class is registered under its kind."""
    classes = [c for c in vars(ev).values() if isinstance(c, type) and issubclass(c, ev.Event) and c is not ev.Event]
    assert sorted(c.kind for c in classes) == sorted(ev.EVENTS)
    assert all(ev.EVENTS[c.kind] is c for c in classes)


def test_every_alert_has_a_severity_and_one_wording() -> None:
    """An alerting event class says its MQTT kind and severity; the alerts sink has one
    wording per alert kind (plus the drill's), a case of its match, so adding an alert kind is
    one class and one function."""
    kinds = ev.alert_kinds()
    assert kinds == {
        "crash": "crash", "restart_scheduled": "restart", "recovered": "recovered", "gave_up": "gave_up",
        "headroom_low": "headroom_low", "gpu_memory_stuck": "gpu_memory_stuck", "server_down": "down",
        "port_in_use": "port_in_use", "daemon_failed": "daemon_failed",
        "group_etcd_unreachable": "etcd_unreachable", "daily_summary": "daily_summary",
        "climb": "climb", "climb_fell_back": "climb_fell_back",
        "server_held": "server_held", "server_released": "server_released",
        "reexec_refused": "reexec_refused",
    }
    for kind, alert in kinds.items():
        assert ev.EVENTS[kind].severity in ("info", "warning", "critical"), kind
        assert alerts.SEVERITY[alert] == ev.EVENTS[kind].severity
    # The alerts sink's one match: words for every alerting class (each sample of it), for no
    # other event, and for the drill.
    samples = instances()
    assert all(alerts.said(e, host="h", instance="i") is not None for e in samples if e.alert)
    assert {e.alert for e in samples if alerts.said(e, host="h", instance="i") is not None} == set(kinds.values())
    assert alerts.said(alerts.Drill(), host="h", instance="i") is not None and alerts.Drill.alert == alerts.DRILL
    assert set(alerts.SEVERITY) == {*kinds.values(), alerts.DRILL}
    assert all(not cls.severity for cls in ev.EVENTS.values() if not cls.alert)


def test_quiet_events_are_the_frequent_ones() -> None:
    assert ev.quiet_events() == {"probe", "gpu_sample"}
