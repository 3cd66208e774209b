"""The daemon's event vocabulary: one stream feeds the log, the metrics and the alerts.

The pure core returns ``Emit(event, fields)`` actions; the daemon hands each one to every
``EventSink`` (structlog logger, Prometheus metrics, MQTT alerts). A sink's ``emit`` must
never block and never raise: it is called on the event loop, in the middle of a restart
decision. Field values are JSON-able (str, int, float, bool, None, lists, dicts).

Every event also carries ``host`` and ``instance`` (added by the daemon).

| event               | fields (at least)                                                         |
|---------------------|---------------------------------------------------------------------------|
| daemon_started      | version, config, pid                                                      |
| launch              | argv, mem_fraction_static, hicache_size_gb, attempt, pid, rung            |
| state_changed       | from, to, reason, mem_fraction_static, restarts, last_cause               |
| server_ready        | startup_s, mem_fraction_static, hicache_size_gb, attempt                  |
| recovered           | like server_ready, plus cause (of the crash it recovered from)            |
| startup_facts       | ranks {rank: {...RankFacts}}, avail_mem_after_capture_gb,                 |
|                     | max_total_num_tokens, kv_cache_tokens, progress                           |
| crash               | cause, remedy, phase, exit_code, signal, evidence [str], evidence_lineno, |
|                     | location, rank, exc_type, exc_message, mem_fraction_static,               |
|                     | hicache_size_gb, attempt, next_mem_fraction_static, next_hicache_size_gb, |
|                     | next_retry_s (None when giving up), consecutive_failures                  |
| restart_scheduled   | delay_s, cause, mem_fraction_static (the next one), hicache_size_gb,      |
|                     | attempt (the next one), rung                                              |
| gave_up             | reason, cause, mem_fraction_static                                        |
| headroom_low        | avail_mem_gb, threshold_gb, rank, action ("step_down"|"warn"),            |
|                     | mem_fraction_static, next_mem_fraction_static                             |
| gpu_memory_stuck    | gpus [{index, uuid, free_bytes, total_bytes}], timeout_s                  |
| gpu_sample          | gpus [{index, uuid, total_bytes, free_bytes, used_bytes}] (not logged     |
|                     | at info: it comes every [gpu] interval_s)                                 |
| gpu_low_free        | index, uuid, free_bytes, threshold_bytes (once per episode)               |
| gpu_probe_error     | error, degraded (bool)                                                    |
| probe               | ok, duration_s, status (HTTP code or None), error (not logged at info)    |
| preflight_failed    | checks [{name, ok, detail}], permanent                                    |
| foreign_gpu_process | pid, gpu, used_bytes, name                                                |
| server_stopped      | reason, exit_code, signal                                                 |
| server_down         | pid, title ("main" or sglang::...), how, phase, mem_fraction_static: the   |
|                     | moment a process of the server's tree is seen dead (before the diagnosis) |
| port_in_use         | port, holders [{pid, name, cmdline, reason}]: not ours, so never killed   |
|                     | unless [gpu] kill_foreign                                                 |
| fraction_learned    | mem_fraction_static, source (SGLang chose it; read from its server_args)  |
| daemon_failed       | task, error, exit_code (an internal task failed: the server is stopped,  |
|                     | the daemon exits non-zero and systemd restarts it)                        |
| restart_requested   | reason (an operator's planned restart: drained, not counted as a crash)   |
| config_reloaded     | ok, error                                                                 |
| daemon_stopping     | reason                                                                    |
| preflight_retry     | cause, detail, delay_s (a retryable preflight/GPU failure, on backoff)    |
| stable              | after_s (READY long enough: the backoff streak is reset)                  |
| orphans_killed      | pids, titles, reasons (stale servers of ours cleared before a launch)     |
| state_write_failed  | error (once per episode; supervision goes on with state in memory)        |
| server_log_write_failed | error (once per episode; the in-memory tail still feeds diagnosis)    |

Log-only lines (not events): daemon_refused, server_stopping, metrics_listening,
metrics_unavailable, task_failed, sink_failed, state_corrupt, state_unreadable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

ALERT_KINDS: dict[str, str] = {
    # daemon event -> MQTT event kind (topic .../event/{kind})
    "crash": "crash",
    "restart_scheduled": "restart",
    "recovered": "recovered",
    "gave_up": "gave_up",
    "headroom_low": "headroom_low",
    "gpu_memory_stuck": "gpu_memory_stuck",
    "server_down": "down",  # noticed at once; the "crash" alert with its cause follows
    "port_in_use": "port_in_use",  # a process that is not ours holds the server's port
    "daemon_failed": "daemon_failed",  # a task of the daemon failed: it stops its server and exits 1
}

# Events too frequent for the info log (they still reach metrics).
QUIET_EVENTS = frozenset({"probe", "gpu_sample"})


class EventSink(Protocol):
    """Receives every event. Must not block and must not raise."""

    def emit(self, event: str, fields: Mapping[str, Any]) -> None: ...
