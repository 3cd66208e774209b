"""Tests of the Prometheus metrics sink and its HTTP endpoint (issue 5).

Unit tests feed events into a ``Metrics`` built on a fresh registry and read values back
with ``registry.get_sample_value``; endpoint tests scrape a real server over HTTP and run
the real ``promtool check metrics`` on the bytes.
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.core.config import MetricsConfig
from supervisor.core.model import Cause, State
from supervisor.sinks.metrics import GIB, HICACHE_GB, Metrics, rank_gpus
from supervisor.sinks.metrics_endpoint import MetricsError, labelled_registry, parse_listen, start_metrics_server
from tests.conftest import require_binary
from tests.edge import typed

P = "sglang_supervisor_"
LADDER = (0.93, 0.88, 0.85, 0.82, 0.80)


class FakeClock:
    """A wall clock the test sets."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(**kwargs: Any) -> tuple[Metrics, CollectorRegistry]:
    registry = CollectorRegistry()
    kwargs.setdefault("clock", FakeClock())
    return Metrics(registry, **kwargs), registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(P + name, labels)


def feed(metrics: Metrics, events: list[tuple[str, Mapping[str, Any]]]) -> None:
    for event, fields in events:
        metrics.emit(typed(event, fields))


# The seed run's rank facts: 0.82 GB of headroom after CUDA-graph capture at 0.93.
STARTUP_FACTS: Mapping[str, Any] = {
    "ranks": {
        "TP0": {"rank": "TP0", "avail_mem_after_capture_gb": 0.82, "max_total_num_tokens": 1_000_000, "weights_gb": 80.0, "kv_cache_gb": 40.0},
        "TP1": {"rank": "TP1", "avail_mem_after_capture_gb": 0.9},
    },
    "progress": "ready",
}


def night() -> list[tuple[str, Mapping[str, Any]]]:
    """The seed's night as events: launch at 0.93, OOM under load, restart at 0.88."""
    return [
        ("daemon_started", {"version": "0.1.0", "pid": 4242, "config": "kimi"}),
        ("state_changed", {"from": "STOPPED", "to": "PREPARING", "reason": "start"}),
        ("launch", {"argv": ["python", "-m", "sglang.launch_server"], "mem_fraction_static": 0.93, "hicache_size_gb": 64, "attempt": 1, "pid": 5151, "rung": 0}),
        ("state_changed", {"from": "PREPARING", "to": "STARTING", "reason": "launched"}),
        ("probe", {"ok": False, "duration_s": 0.001, "status": None, "error": "connection refused"}),
        ("startup_facts", STARTUP_FACTS),
        ("state_changed", {"from": "STARTING", "to": "READY", "reason": "healthy"}),
        ("server_ready", {"startup_s": 42.0, "mem_fraction_static": 0.93, "hicache_size_gb": 64, "attempt": 1}),
        ("probe", {"ok": True, "duration_s": 1.2, "status": 200, "error": None}),
        ("crash", {"cause": "cuda_oom_runtime", "remedy": "fraction_down", "phase": "serving", "exit_code": None, "signal": 9, "evidence": ["torch.OutOfMemoryError: CUDA out of memory"], "exc_message": "CUDA out of memory. Tried to allocate 2 GiB", "mem_fraction_static": 0.93, "next_mem_fraction_static": 0.88, "next_retry_s": 10.0, "consecutive_failures": 1}),
        ("state_changed", {"from": "READY", "to": "BACKOFF", "reason": "crash"}),
        ("restart_scheduled", {"delay_s": 10.0, "cause": "cuda_oom_runtime", "mem_fraction_static": 0.88, "hicache_size_gb": 64, "attempt": 2, "rung": 1}),
        ("state_changed", {"from": "BACKOFF", "to": "PREPARING", "reason": "delay elapsed"}),
        ("launch", {"argv": ["python"], "mem_fraction_static": 0.88, "hicache_size_gb": 64, "attempt": 2, "pid": 6161, "rung": 1}),
        ("state_changed", {"from": "PREPARING", "to": "STARTING", "reason": "launched"}),
        ("state_changed", {"from": "STARTING", "to": "READY", "reason": "healthy"}),
        ("server_ready", {"startup_s": 40.0, "mem_fraction_static": 0.88, "hicache_size_gb": 64, "attempt": 2}),
        ("recovered", {"startup_s": 40.0, "mem_fraction_static": 0.88, "hicache_size_gb": 64, "attempt": 2, "cause": "cuda_oom_runtime"}),
    ]


# -- counters and the cause label -------------------------------------------------------


def test_every_cause_starts_at_zero_so_increase_works_from_the_first_crash() -> None:
    """Each Cause value has a crash and a restart series at 0 before anything happens."""
    _, registry = make()
    for cause in Cause:
        assert value(registry, "crashes_total", cause=cause.value) == 0
        assert value(registry, "restarts_total", cause=cause.value) == 0


def test_crash_counts_its_cause_and_records_time_and_failures() -> None:
    """A crash event bumps its cause's counter, stamps the wall clock and mirrors consecutive_failures."""
    clock = FakeClock(1_800_000_000.0)
    metrics, registry = make(clock=clock)
    metrics.emit(typed("crash", {"cause": "cuda_oom_runtime", "consecutive_failures": 3}))
    assert value(registry, "crashes_total", cause="cuda_oom_runtime") == 1
    assert value(registry, "crashes_total", cause="host_oom") == 0
    assert value(registry, "last_crash_timestamp_seconds") == 1_800_000_000.0
    assert value(registry, "consecutive_failures") == 3


def test_unknown_cause_is_counted_as_other() -> None:
    """A cause outside the Cause enum never becomes a new label value: a typed crash cannot
    carry one (the stand-in that does is ignored), and a cause read as other counts as other."""
    metrics, registry = make()
    metrics.emit(typed("crash", {"cause": "something new"}))  # no Crash holds it: an Edge, ignored
    metrics.emit(typed("restart_scheduled", {"cause": None, "delay_s": 1}))  # None where a Cause must be: logged, ignored
    metrics.emit(typed("crash", {"cause": "other"}))
    metrics.emit(typed("restart_scheduled", {"cause": "other", "delay_s": 1}))
    assert value(registry, "crashes_total", cause="other") == 1
    assert value(registry, "restarts_total", cause="other") == 1
    assert value(registry, "crashes_total", cause="something new") is None
    assert value(registry, "restarts_total", cause="None") is None


def test_backoff_delay_shows_while_waiting_and_clears_on_the_next_start() -> None:
    """restart_scheduled sets the delay; leaving BACKOFF resets it to 0."""
    metrics, registry = make()
    metrics.emit(typed("state_changed", {"to": "BACKOFF"}))
    metrics.emit(typed("restart_scheduled", {"delay_s": 20.0, "cause": "hang", "rung": 0}))
    assert value(registry, "backoff_delay_seconds") == 20.0
    assert value(registry, "restarts_total", cause="hang") == 1
    metrics.emit(typed("state_changed", {"to": "PREPARING"}))
    assert value(registry, "backoff_delay_seconds") == 0


# -- state, up, gave up ---------------------------------------------------------------------


def test_state_is_a_stateset_with_exactly_the_current_state_set() -> None:
    """Every State has a series; only the one last changed to reads 1."""
    metrics, registry = make()
    assert value(registry, "state", state="STOPPED") == 1
    metrics.emit(typed("state_changed", {"from": "STOPPED", "to": "BACKOFF"}))
    readings = {s: value(registry, "state", state=s.value) for s in State}
    assert readings == {s: (1.0 if s is State.BACKOFF else 0.0) for s in State}


def test_server_up_follows_ready_state_and_probes() -> None:
    """Up is 1 only in READY with a passing last probe; a failing probe or a crash drops it."""
    metrics, registry = make()
    metrics.emit(typed("state_changed", {"to": "STARTING"}))
    assert value(registry, "server_up") == 0
    metrics.emit(typed("state_changed", {"to": "READY"}))
    assert value(registry, "server_up") == 1
    metrics.emit(typed("probe", {"ok": False, "duration_s": 30.0, "status": None}))
    assert value(registry, "server_up") == 0
    metrics.emit(typed("probe", {"ok": True, "duration_s": 1.0, "status": 200}))
    assert value(registry, "server_up") == 1
    metrics.emit(typed("crash", {"cause": "hang"}))
    assert value(registry, "server_up") == 0


def test_gave_up_is_set_by_the_event_or_state_and_cleared_by_a_launch() -> None:
    """gave_up reads 1 after giving up and 0 again once the server is launched anew."""
    metrics, registry = make()
    metrics.emit(typed("gave_up", {"reason": "dead GPU", "cause": "gpu_hw_error"}))
    assert value(registry, "gave_up") == 1
    metrics.emit(typed("launch", {"mem_fraction_static": 0.9, "rung": None}))
    assert value(registry, "gave_up") == 0
    metrics.emit(typed("state_changed", {"to": "GAVE_UP"}))
    assert value(registry, "gave_up") == 1


# -- memory settings --------------------------------------------------------------------------


def test_launch_sets_fraction_hicache_bytes_and_rung() -> None:
    """A launch publishes its fraction, its host cache in bytes (decimal GB) and its rung."""
    metrics, registry = make(fraction_ladder=LADDER)
    metrics.emit(typed("launch", {"mem_fraction_static": 0.88, "hicache_size_gb": 64, "rung": 1}))
    assert value(registry, "mem_fraction_static") == 0.88
    assert value(registry, "hicache_size_bytes") == 64 * HICACHE_GB
    assert value(registry, "mem_fraction_ladder_rung") == 1
    assert value(registry, "mem_fraction_static_floor") == 0.80


def test_fraction_left_to_sglang_reads_nan() -> None:
    """A launch without a fraction (SGLang computes it) exports NaN, never a fake number."""
    metrics, registry = make()
    metrics.emit(typed("launch", {"mem_fraction_static": None, "hicache_size_gb": None, "rung": None}))
    assert math.isnan(value(registry, "mem_fraction_static") or 0.0)
    assert math.isnan(value(registry, "mem_fraction_ladder_rung") or 0.0)
    assert value(registry, "hicache_size_bytes") == 0


def test_ladder_floor_and_headroom_minimum_come_from_the_config_and_headroom_low() -> None:
    """The ladder floor and the headroom minimum are NaN unless configured; headroom_low updates the minimum."""
    _, unconfigured = make()
    assert math.isnan(value(unconfigured, "mem_fraction_static_floor") or 0.0)
    assert math.isnan(value(unconfigured, "headroom_min_bytes") or 0.0)
    metrics, registry = make(fraction_ladder=(0.9, 0.7), headroom_min_gb=2)
    assert value(registry, "mem_fraction_static_floor") == 0.7
    assert value(registry, "headroom_min_bytes") == 2 * GIB
    metrics.emit(typed("headroom_low", {"avail_mem_gb": 0.5, "threshold_gb": 3.0, "rank": "TP0", "action": "warn"}))
    assert value(registry, "headroom_min_bytes") == 3 * GIB
    assert value(registry, "events_total", event="headroom_low") == 1


# -- timings ----------------------------------------------------------------------------------


def test_startup_duration_is_observed_once_per_ready_server() -> None:
    """server_ready feeds the startup histogram; recovered (its companion) does not count twice."""
    metrics, registry = make()
    metrics.emit(typed("server_ready", {"startup_s": 700.0, "mem_fraction_static": 0.88}))
    metrics.emit(typed("recovered", {"startup_s": 700.0, "mem_fraction_static": 0.88, "cause": "hang"}))
    assert value(registry, "startup_duration_seconds_count") == 1
    assert value(registry, "startup_duration_seconds_bucket", le="600.0") == 0
    assert value(registry, "startup_duration_seconds_bucket", le="900.0") == 1
    assert value(registry, "startup_duration_seconds_bucket", le="3600.0") == 1


def test_probes_of_a_started_server_feed_duration_and_failures_by_reason() -> None:
    """Probes after startup are timed; a 503 and a timeout count under different reasons."""
    metrics, registry = make()
    metrics.emit(typed("state_changed", {"to": "READY"}))
    metrics.emit(typed("probe", {"ok": True, "duration_s": 1.1, "status": 200}))
    metrics.emit(typed("probe", {"ok": False, "duration_s": 20.5, "status": 503}))
    metrics.emit(typed("probe", {"ok": False, "duration_s": 30.0, "status": None, "error": "timeout"}))
    assert value(registry, "health_probe_duration_seconds_count") == 3
    assert value(registry, "health_probe_duration_seconds_bucket", le="1.5") == 1
    assert value(registry, "health_probe_failures_total", reason="http_status") == 1
    assert value(registry, "health_probe_failures_total", reason="no_response") == 1


def test_startup_polls_are_not_probe_failures() -> None:
    """While STARTING the port is closed by design: those polls are not counted."""
    metrics, registry = make()
    metrics.emit(typed("state_changed", {"to": "STARTING"}))
    metrics.emit(typed("probe", {"ok": False, "duration_s": 0.001, "status": None}))
    assert value(registry, "health_probe_failures_total", reason="no_response") == 0
    assert value(registry, "health_probe_duration_seconds_count") == 0


# -- GPUs and ranks ---------------------------------------------------------------------------


def test_gpu_sample_exports_total_and_free_per_gpu_with_dcgm_labels() -> None:
    """Each sampled GPU gets total/free bytes labelled gpu (index) and UUID, like DCGM exporter."""
    metrics, registry = make()
    metrics.emit(typed("gpu_sample", {"gpus": [
        {"index": 0, "uuid": "GPU-aaa", "total_bytes": 150 * GIB, "free_bytes": 3 * GIB, "used_bytes": 147 * GIB},
        {"index": 1, "uuid": "GPU-bbb", "total_bytes": 150 * GIB, "free_bytes": 149 * GIB, "used_bytes": GIB},
    ]}))
    assert value(registry, "gpu_memory_total_bytes", gpu="0", UUID="GPU-aaa") == 150 * GIB
    assert value(registry, "gpu_memory_free_bytes", gpu="0", UUID="GPU-aaa") == 3 * GIB
    assert value(registry, "gpu_memory_free_bytes", gpu="1", UUID="GPU-bbb") == 149 * GIB


def test_startup_facts_export_per_rank_memory_in_bytes_until_the_next_launch() -> None:
    """Rank facts (GiB in SGLang's log) become bytes per rank and vanish when a new run launches."""
    metrics, registry = make()
    feed(metrics, night()[:6])
    assert value(registry, "rank_avail_memory_after_capture_bytes", rank="TP0") == pytest.approx(0.82 * GIB)
    assert value(registry, "rank_avail_memory_after_capture_bytes", rank="TP1") == pytest.approx(0.9 * GIB)
    assert value(registry, "rank_max_total_num_tokens", rank="TP0") == 1_000_000
    assert value(registry, "rank_weights_bytes", rank="TP0") == 80 * GIB
    assert value(registry, "rank_max_total_num_tokens", rank="TP1") is None
    metrics.emit(typed("launch", {"mem_fraction_static": 0.88, "rung": 1}))
    assert value(registry, "rank_avail_memory_after_capture_bytes", rank="TP0") is None


def rank_gpu(registry: CollectorRegistry) -> dict[str, dict[str, str]]:
    """rank -> the labels of its rank_gpu_info series (value 1), from a scrape."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == P + "rank_gpu_info":
                assert sample.value == 1
                labels = dict(sample.labels)
                out[labels.pop("rank")] = labels
    return out


def gpu_sample(*uuids: tuple[int, str]) -> Any:
    return typed("gpu_sample", {"gpus": [
        {"index": index, "uuid": uuid, "total_bytes": 80 * GIB, "free_bytes": GIB} for index, uuid in uuids
    ]})


def facts(*ranks: str) -> Any:
    return typed("startup_facts", {"ranks": {r: {"rank": r, "avail_mem_after_capture_gb": 1.0} for r in ranks}, "progress": "ready"})


def test_rank_gpu_info_ties_each_tp_rank_to_its_gpu_with_dcgm_labels() -> None:
    """TP i runs on the i-th configured GPU: rank_gpu_info carries its gpu, UUID and both host labels."""
    metrics, registry = make(hostname="gpu-node-1", gpu_indices=(4, 6))
    metrics.emit(gpu_sample((4, "GPU-four"), (5, "GPU-five"), (6, "GPU-six")))
    metrics.emit(facts("TP0", "TP1"))
    host = {"Hostname": "gpu-node-1", "hostname": "gpu-node-1"}
    assert rank_gpu(registry) == {
        "TP0": {"gpu": "4", "UUID": "GPU-four", **host},
        "TP1": {"gpu": "6", "UUID": "GPU-six", **host},
    }
    assert value(registry, "rank_gpu_info", rank="TP1", gpu="6", UUID="GPU-six", **host) == 1


def test_rank_gpu_info_without_indices_follows_the_sample_and_gets_its_uuid_when_sampled() -> None:
    """No [gpu] indices: TP i is GPU i until a sample arrives, then the i-th sampled GPU, with its UUID."""
    metrics, registry = make(hostname="h")
    metrics.emit(facts("TP0", "TP1"))
    assert {r: (g["gpu"], g["UUID"]) for r, g in rank_gpu(registry).items()} == {"TP0": ("0", ""), "TP1": ("1", "")}
    metrics.emit(gpu_sample((2, "GPU-two"), (3, "GPU-three")))  # the daemon's CUDA_VISIBLE_DEVICES=2,3
    assert {r: (g["gpu"], g["UUID"]) for r, g in rank_gpu(registry).items()} == {"TP0": ("2", "GPU-two"), "TP1": ("3", "GPU-three")}


def test_rank_gpu_info_is_cleared_by_a_launch_and_replaced_by_the_next_runs_ranks() -> None:
    """A new launch removes the last run's series; the next run's ranks bring theirs."""
    metrics, registry = make(hostname="h")
    metrics.emit(gpu_sample((0, "GPU-a"), (1, "GPU-b")))
    metrics.emit(facts("TP0", "TP1"))
    assert set(rank_gpu(registry)) == {"TP0", "TP1"}
    metrics.emit(typed("launch", {"mem_fraction_static": 0.88, "rung": 1}))
    assert rank_gpu(registry) == {}
    metrics.emit(gpu_sample((0, "GPU-a"), (1, "GPU-b")))  # samples alone bring nothing back
    assert rank_gpu(registry) == {}
    metrics.emit(facts("main"))  # a TP-1 server prints no rank
    assert rank_gpu(registry) == {"main": {"gpu": "0", "UUID": "GPU-a", "Hostname": "h", "hostname": "h"}}


@pytest.mark.parametrize(("ranks", "expected"), [
    (["TP0", "TP1", "TP2"], {"TP0": 0, "TP1": 1, "TP2": 2}),
    (["TP1 EP1", "TP0 EP0"], {"TP0 EP0": 0, "TP1 EP1": 1}),
    (["DP0 TP0", "DP0 TP1", "DP1 TP2", "DP1 TP3"], {"DP0 TP0": 0, "DP0 TP1": 1, "DP1 TP2": 2, "DP1 TP3": 3}),  # DP attention
    (["DP0-TP1", "DP0-TP0"], {"DP0-TP0": 0, "DP0-TP1": 1}),
    (["TP8", "TP9"], {"TP8": 0, "TP9": 1}),  # the second node of a 2-node TP 16 server
    (["main"], {"main": 0}),
    (["main", "TP0", "TP1"], {"TP0": 0, "TP1": 1}),
    (["DP0 TP0", "DP0 TP1", "DP1 TP0", "DP1 TP1"], {}),  # plain DP: TP numbers repeat, no guess
    (["PP0 TP0", "PP1 TP0", "PP0 TP1"], {"PP0 TP1": 1}),
    (["DP0", "DP1"], {}),
    (["rank0", "rank1"], {}),
    ([], {}),
])
def test_rank_gpus_maps_only_ranks_that_cannot_be_mistaken(ranks: list[str], expected: dict[str, int]) -> None:
    """TP i is the i-th GPU; repeated TP numbers (plain DP, PP) and rank names without TP are left out."""
    assert rank_gpus(ranks) == expected


def test_rank_gpu_info_leaves_out_ranks_beyond_the_known_gpus() -> None:
    """More TP ranks than configured GPUs: the extra ranks get no series rather than a wrong one."""
    metrics, registry = make(gpu_indices=(0,))
    metrics.emit(facts("TP0", "TP1"))
    assert set(rank_gpu(registry)) == {"TP0"}


def test_gpu_memory_stuck_is_raised_by_its_event_and_cleared_by_a_launch() -> None:
    """The stuck flag reads 1 after gpu_memory_stuck and 0 after the next launch."""
    metrics, registry = make()
    metrics.emit(typed("gpu_memory_stuck", {"gpus": [{"index": 0, "uuid": "GPU-aaa", "free_bytes": 0, "total_bytes": 1}], "timeout_s": 120}))
    assert value(registry, "gpu_memory_stuck") == 1
    metrics.emit(typed("launch", {"mem_fraction_static": 0.93, "rung": 0}))
    assert value(registry, "gpu_memory_stuck") == 0


# -- alerting health --------------------------------------------------------------------------


def test_the_mqtt_adapters_health_hook_feeds_the_same_metrics() -> None:
    """alerting_health(kind, value), the MQTT adapter's on_health, counts sends, drops and failed connects."""
    metrics, registry = make()
    metrics.alerting_health("mqtt_connect_failed", "auth")
    metrics.alerting_health("mqtt_connect_failed", "something else")
    metrics.alerting_health("mqtt_connected", True)
    metrics.alerting_health("alert_sent", "gave_up")
    metrics.alerting_health("alert_dropped", "crash")
    metrics.alerting_health("not_a_health_kind", 1)
    assert value(registry, "mqtt_connect_failures_total", reason="auth") == 1
    assert value(registry, "mqtt_connect_failures_total", reason="error") == 1
    assert value(registry, "mqtt_connected") == 1
    assert value(registry, "alerts_sent_total", kind="gave_up") == 1
    assert value(registry, "alerts_dropped_total", kind="crash") == 1


def test_alerting_health_events_count_by_kind_and_track_the_connection() -> None:
    """alert_sent/alert_dropped count per kind (unknown kinds as other); mqtt_connected is NaN until reported.
    (The MQTT adapter's reports are not daemon events: they come through its hook, alerting_health.)"""
    metrics, registry = make()
    assert math.isnan(value(registry, "mqtt_connected") or 0.0)
    metrics.alerting_health("mqtt_connected", True)
    metrics.alerting_health("alert_sent", "crash")
    metrics.alerting_health("alert_dropped", "weird")
    metrics.alerting_health("mqtt_connected", False)
    assert value(registry, "alerts_sent_total", kind="crash") == 1
    assert value(registry, "alerts_dropped_total", kind="other") == 1
    assert value(registry, "mqtt_connected") == 0


# -- the whole night and robustness ---------------------------------------------------------


def test_the_seed_night_ends_up_at_088_with_one_oom_restart() -> None:
    """After the seed's night the server is up at 0.88, with one cuda_oom_runtime crash and restart."""
    metrics, registry = make()
    feed(metrics, night())
    assert value(registry, "server_up") == 1
    assert value(registry, "mem_fraction_static") == 0.88
    assert value(registry, "mem_fraction_ladder_rung") == 1
    assert value(registry, "crashes_total", cause="cuda_oom_runtime") == 1
    assert value(registry, "restarts_total", cause="cuda_oom_runtime") == 1
    assert value(registry, "launches_total") == 2
    assert value(registry, "consecutive_failures") == 0
    assert value(registry, "startup_duration_seconds_count") == 2


def test_labels_never_carry_pids_or_messages() -> None:
    """No label value in the exposition contains a pid, an argv or an error message from the events."""
    metrics, registry = make()
    feed(metrics, night())
    text = generate_latest(registry).decode()
    labels = {v for fam in text_string_to_metric_families(text) for s in fam.samples for v in s.labels.values()}
    for secret in ("4242", "5151", "6161", "CUDA out of memory", "sglang.launch_server", "connection refused"):
        assert not any(secret in label for label in labels), secret


def test_every_metric_family_is_documented() -> None:
    """docs/metrics.md has a table row for each exported metric family."""
    docs = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    _, registry = make()
    for family in registry.collect():
        name = family.name.removeprefix(P) + ("_total" if family.type == "counter" else "")
        name += "_info" if family.type == "info" else ""
        assert f"| `{name}` |" in docs, name


def test_registries_are_independent() -> None:
    """Two Metrics on two registries neither collide nor share values (no global registry)."""
    first, first_registry = make()
    _, second_registry = make()
    first.emit(typed("crash", {"cause": "host_oom"}))
    assert value(first_registry, "crashes_total", cause="host_oom") == 1
    assert value(second_registry, "crashes_total", cause="host_oom") == 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
_EVENTS = ["launch", "state_changed", "server_ready", "recovered", "startup_facts", "crash",
           "restart_scheduled", "gave_up", "headroom_low", "gpu_memory_stuck", "gpu_sample",
           "probe", "alert_sent", "alert_dropped", "mqtt_connected", "daemon_started", "unknown"]
_KEYS = ["to", "cause", "mem_fraction_static", "hicache_size_gb", "rung", "startup_s", "ranks",
         "gpus", "duration_s", "ok", "status", "kind", "connected", "config", "delay_s",
         "threshold_gb", "consecutive_failures"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_EVENTS), st.dictionaries(st.sampled_from(_KEYS), _json, max_size=5)), max_size=8))
def test_emit_never_raises_and_the_registry_still_renders(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Garbage fields never escape emit, and the registry stays renderable afterwards."""
    metrics, registry = make()
    feed(metrics, events)
    assert generate_latest(registry).startswith(b"# HELP")


# -- the endpoint -------------------------------------------------------------------------------


async def scrape(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(url) as response:
            return response.status, await response.read()


def test_default_listen_address_is_loopback() -> None:
    """The configured default binds 127.0.0.1 on a port other than DCGM exporter's 9400."""
    host, port = parse_listen(MetricsConfig().listen)
    assert host == "127.0.0.1"
    assert port not in (0, 9400)
    assert parse_listen("[::1]:9188") == ("::1", 9188)


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:", ":9188", "127.0.0.1:99999"])
async def test_bad_listen_address_raises_metrics_error(listen: str) -> None:
    """A malformed listen address is one MetricsError naming it."""
    with pytest.raises(MetricsError, match="metrics.listen"):
        await start_metrics_server(listen, CollectorRegistry())


async def test_port_zero_binds_exactly_the_host_and_reports_the_real_port() -> None:
    """Port 0 picks a free port, readable back, listening on 127.0.0.1 only; close stops it."""
    metrics, registry = make()
    metrics.emit(typed("crash", {"cause": "cuda_oom_runtime"}))
    server = await start_metrics_server("127.0.0.1:0", registry)
    try:
        assert server.port > 0
        listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        assert (("127.0.0.1", server.port)) in [(a.ip, a.port) for a in listening]
        status, body = await scrape(server.url)
        assert status == 200
        assert b'sglang_supervisor_crashes_total{cause="cuda_oom_runtime"} 1.0' in body
    finally:
        await server.close()
    with pytest.raises(aiohttp.ClientConnectionError):
        await scrape(server.url)


async def test_a_taken_port_raises_metrics_error() -> None:
    """Binding a port someone else listens on is a MetricsError with the address in it."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(MetricsError, match=f"127.0.0.1:{port}"):
            await start_metrics_server(f"127.0.0.1:{port}", CollectorRegistry())


async def test_promtool_check_metrics_is_clean_on_a_live_scrape() -> None:
    """The real promtool lints a live scrape after a whole night's events with no complaint."""
    promtool = require_binary("promtool")
    metrics, registry = make()
    feed(metrics, night())
    metrics.emit(typed("gpu_sample", {"gpus": [{"index": 0, "uuid": "GPU-aaa", "total_bytes": 10, "free_bytes": 5}]}))
    metrics.alerting_health("mqtt_connected", True)
    server = await start_metrics_server("127.0.0.1:0", registry)
    try:
        status, body = await scrape(server.url)
    finally:
        await server.close()
    assert status == 200
    proc = await asyncio.create_subprocess_exec(
        promtool, "check", "metrics",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(proc.communicate(body), timeout=60)
    assert (proc.returncode, output.decode()) == (0, "")


def test_router_registration_removal_time_and_failed_calls() -> None:
    """The router's view: registered 1/0, the time each removal took, failed calls by operation."""
    from supervisor.core.events import RouterCallFailed, RouterRegistered, RouterRemoved

    metrics, registry = make()
    url = "http://127.0.0.1:30001"
    assert value(registry, "router_registered") == 0
    metrics.emit(RouterRegistered(worker_url=url, worker_id="w1"))
    assert value(registry, "router_registered") == 1
    metrics.emit(RouterCallFailed(op="remove", error="router remove: refused", retry_s=0.5))
    metrics.emit(RouterRemoved(worker_url=url, worker_ids=("w1",), reason="scheduler died", after_s=0.012))
    metrics.emit(RouterRemoved(worker_url=url, worker_ids=("w9",), reason="reconcile", after_s=None))
    assert value(registry, "router_registered") == 0
    assert value(registry, "router_remove_seconds_count") == 1
    assert value(registry, "router_remove_seconds_bucket", le="0.025") == 1
    assert value(registry, "router_remove_seconds_bucket", le="0.01") == 0
    assert value(registry, "router_call_failures_total", op="remove") == 1
    assert value(registry, "router_call_failures_total", op="add") == 0


def test_several_servers_are_served_as_one_exposition_under_a_server_label() -> None:
    """Each server's Metrics keeps its own registry; the served registry has one family per
    name with every sample labelled by its server, and the text parses as Prometheus's."""
    (a, reg_a), (b, reg_b) = make(), make()
    a.emit(typed("state_changed", {"from": "STARTING", "to": "READY", "reason": "", "mem_fraction_static": 0.88,
                                  "hicache_size_gb": 0, "restarts": 0, "last_cause": None}))
    b.emit(typed("crash", {"cause": "cuda_oom_runtime"}))
    served = labelled_registry({"tp4-a": reg_a, "tp4-b": reg_b})
    assert served.get_sample_value(P + "state", {"server": "tp4-a", "state": "READY"}) == 1
    assert served.get_sample_value(P + "state", {"server": "tp4-b", "state": "READY"}) == 0
    assert served.get_sample_value(P + "crashes_total", {"server": "tp4-b", "cause": "cuda_oom_runtime"}) == 1
    assert served.get_sample_value(P + "crashes_total", {"server": "tp4-a", "cause": "cuda_oom_runtime"}) == 0
    text = generate_latest(served).decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family per metric, both servers in it
    assert all(s.labels.get("server") in ("tp4-a", "tp4-b") for f in families for s in f.samples)
    buckets = {s.labels["server"] for f in families for s in f.samples if s.name == P + "startup_duration_seconds_bucket"}
    assert buckets == {"tp4-a", "tp4-b"}
    assert text.count("# TYPE sglang_supervisor_state gauge") == 1


def test_a_group_nodes_etcd_reachability_and_leadership_are_gauges() -> None:
    """[group]: NaN without a group; etcd up once joined, 0 during an outage (which also ends
    a leadership); the leader's last decided generation."""
    metrics, registry = make()
    assert math.isnan(value(registry, "group_etcd_up")) and math.isnan(value(registry, "group_leader"))
    metrics.emit(typed("group_joined", {"group": "g", "node_rank": 1}))
    assert (value(registry, "group_etcd_up"), value(registry, "group_leader")) == (1, 0)
    metrics.emit(typed("group_leader", {"group": "g", "node_rank": 1}))
    metrics.emit(typed("group_generation", {"group": "g", "number": 4, "mem_fraction_static": 0.88, "hicache_size_gb": 0,
                                           "reason": "node 0: OOM", "delay_s": 10.0, "gave_up": False}))
    assert (value(registry, "group_leader"), value(registry, "group_generation")) == (1, 4)
    metrics.emit(typed("group_etcd_unreachable", {"error": "etcd 127.0.0.1:2379: get failed: unreachable"}))
    assert (value(registry, "group_etcd_up"), value(registry, "group_leader")) == (0, 0)
    assert value(registry, "events_total", event="group_etcd_unreachable") == 1
    metrics.emit(typed("group_etcd_recovered", {"down_s": 12.5}))
    assert value(registry, "group_etcd_up") == 1


def test_each_link_is_up_or_down_and_counts_its_outages() -> None:
    """link_up{link} is NaN until a link answers or fails; link_down sets it to 0 and counts
    one outage, link_up back to 1. The group's own outage events, the router's registration,
    the fleet's answers and the MQTT adapter's health hook feed the same series; a link the
    daemon does not have is no label."""
    from supervisor.core.events import LinkDown, LinkUp

    metrics, registry = make()
    assert all(math.isnan(value(registry, "link_up", link=link) or 0.0) for link in ("group", "router", "fleet", "mqtt"))
    assert all(value(registry, "link_outages_total", link=link) == 0 for link in ("group", "router", "fleet", "mqtt"))
    metrics.emit(typed("router_registered", {"worker_url": "http://h:1", "worker_id": "w"}))
    assert value(registry, "link_up", link="router") == 1
    metrics.emit(LinkDown(link="router", error="refused"))
    assert (value(registry, "link_up", link="router"), value(registry, "link_outages_total", link="router")) == (0, 1)
    metrics.emit(LinkUp(link="router", down_s=12.0))
    metrics.emit(LinkDown(link="fleet", error="etcd away"))
    assert (value(registry, "link_up", link="router"), value(registry, "link_up", link="fleet")) == (1, 0)
    metrics.emit(typed("group_joined", {"group": "g", "node_rank": 0}))
    metrics.emit(typed("group_etcd_unreachable", {"error": "unreachable"}))
    assert (value(registry, "link_up", link="group"), value(registry, "link_outages_total", link="group")) == (0, 1)
    metrics.emit(typed("group_etcd_recovered", {"down_s": 3.0}))
    assert value(registry, "link_up", link="group") == 1
    metrics.alerting_health("link", LinkDown(link="mqtt", error="broker away"))
    assert (value(registry, "link_up", link="mqtt"), value(registry, "link_outages_total", link="mqtt")) == (0, 1)
    metrics.alerting_health("link", LinkUp(link="mqtt", down_s=None))
    assert value(registry, "link_up", link="mqtt") == 1
    metrics.emit(LinkDown(link="elsewhere", error="?"))
    assert value(registry, "link_outages_total", link="elsewhere") is None
