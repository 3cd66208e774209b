"""Fuzzed alert payloads: huge evidence is truncated, with a marker saying by how much.

Hypothesis feeds ``supervisor.sinks.alerts.build_alert`` (and ``AlertSink.emit``, whose MQTT
transport's outbox holds the bytes that would be published) evidence of every shape the daemon
could hand it:
thousands of lines, one giant line, wide Unicode, non-strings. The payload's evidence never
exceeds ``[mqtt] evidence_max_chars``, what is kept is the start of the evidence, and the
marker counts exactly the characters cut; the whole message stays small (at most 6 bytes a character,
JSON's worst escape, plus a few KiB of other fields).
"""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.core.config import MqttConfig
from supervisor.core.events import EVENTS
from supervisor.core.model import Cause
from supervisor.sinks.alerts import build_alert, truncate_evidence
from tests.edge import typed
from tests.test_alerts import alerter as wired

MARKER = re.compile(r"\n\.\.\. \[truncated (\d+) chars\]\Z")
TS = datetime(2026, 11, 29, 3, 12, 9, tzinfo=UTC)

lines = st.text(max_size=2000)
evidence = st.one_of(
    st.lists(lines, max_size=200),
    st.text(max_size=50_000),
    st.builds(lambda c, n: [c * n], st.sampled_from(["x", "\u00e9", "\U0001f525", "\u202e", "\0"]), st.integers(0, 100_000)),
    st.lists(st.one_of(st.integers(), st.none(), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)), max_size=50),
)
limits = st.integers(min_value=80, max_value=5000)
FUZZ = settings(max_examples=200, deadline=None)


def joined(ev: Any) -> str:
    return "\n".join(str(line) for line in ev) if isinstance(ev, list | tuple) else str(ev)


def assert_truncated(text: str, original: str, limit: int) -> None:
    """``text`` is ``original`` or its start plus a marker counting what was cut."""
    assert len(text) <= limit
    if len(original) <= limit:
        assert text == original
        return
    m = MARKER.search(text)
    assert m, text[-80:]
    kept = text[: m.start()]
    assert original.startswith(kept)
    assert len(kept) + int(m.group(1)) == len(original)


@FUZZ
@given(ev=evidence, limit=limits)
def test_truncate_evidence_keeps_the_start_and_counts_the_rest(ev: Any, limit: int) -> None:
    """Any evidence is cut to the limit; the marker says exactly how much was dropped."""
    assert_truncated(truncate_evidence(ev, limit), joined(ev), limit)


@FUZZ
@given(ev=evidence, limit=limits, cause=st.sampled_from(list(Cause)), kind=st.sampled_from(["crash", "gave_up", "headroom_low"]))
def test_alert_payload_with_huge_evidence_is_bounded(ev: Any, limit: int, cause: Cause, kind: str) -> None:
    """build_alert: the evidence field obeys the limit and the JSON payload stays small. Of
    the three, only a crash carries evidence: a typed give-up or headroom warning has no such
    field, so its evidence is empty (each event gets the fields its class has)."""
    fields = {"cause": str(cause), "evidence": ev, "phase": "serving", "mem_fraction_static": 0.93,
              "next_mem_fraction_static": 0.88, "attempt": 3, "next_retry_s": 10.0, "reason": "budget spent"}
    names = {f.name.rstrip("_") for f in dataclasses.fields(EVENTS[kind])}
    event = typed(kind, {k: v for k, v in fields.items() if k in names})
    payload = build_alert(event, host="gpu-node-7", instance="kimi", ts=TS, alert_id="id-1",  # type: ignore[arg-type]
                          evidence_max_chars=limit)
    assert payload is not None
    assert_truncated(payload["evidence"], joined(ev) if kind == "crash" else "", limit)
    size = len(json.dumps(payload, ensure_ascii=False).encode())
    assert size <= 6 * limit + 4096, size


@settings(max_examples=50, deadline=None)
@given(ev=evidence, limit=limits)
def test_queued_mqtt_message_is_bounded(ev: Any, limit: int) -> None:
    """What the alerts sink hands its MQTT transport (the outbox) carries the truncated evidence."""
    sink, transport = wired(MqttConfig(enabled=True, evidence_max_chars=limit), host="h", instance="i")
    sink.emit(typed("crash", {"cause": "cuda_oom_runtime", "evidence": ev, "attempt": 1, "next_retry_s": 1.0}))
    assert transport.pending == 1
    message = transport._outbox[0]  # noqa: SLF001 - the bytes that would go on the wire
    payload = json.loads(message.payload)
    assert_truncated(payload["evidence"], joined(ev), limit)
    assert len(message.payload) <= 6 * limit + 4096


@settings(max_examples=30, deadline=None)
@given(count=st.integers(0, 5000), limit=limits)
def test_gpu_memory_stuck_evidence_from_many_gpus_is_bounded(count: int, limit: int) -> None:
    """The stuck-memory alert builds its evidence from the GPU list: bounded as well."""
    gpus = [{"index": i, "uuid": f"GPU-{i:08d}", "free_bytes": 1, "total_bytes": 2} for i in range(count)]
    payload = build_alert(typed("gpu_memory_stuck", {"gpus": gpus, "timeout_s": 120}),  # type: ignore[arg-type]
                          host="h", instance="i", ts=TS, alert_id="id", evidence_max_chars=limit)
    assert payload is not None
    assert len(payload["evidence"]) <= limit
