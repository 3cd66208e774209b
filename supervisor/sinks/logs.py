"""Structured logging: JSON lines by default, a console renderer on a TTY.

``LogSink`` turns the daemon's events into log lines with stable event names. Values
that may hold secrets (``--api-key`` style arguments) are redacted before they are logged.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, TextIO, cast

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

from supervisor.core.argv import SECRET_FLAGS, redact_argv
from supervisor.core.events import Event

__all__ = ["SECRET_FLAGS", "LogSink", "configure", "redact_argv"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
EVENT_LEVELS = {
    "crash": "error",
    "gave_up": "critical",
    "gpu_memory_stuck": "error",
    "headroom_low": "warning",
    "gpu_low_free": "warning",
    "gpu_probe_error": "warning",
    "preflight_failed": "warning",
    "foreign_gpu_process": "warning",
    "port_in_use": "warning",
    "server_down": "warning",
    "link_down": "warning",
    "daemon_failed": "error",
    "state_write_failed": "warning",
    "server_log_write_failed": "warning",
    "fleet_error": "warning",
}
def _add_monotonic(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    event_dict.setdefault("mono", round(time.monotonic(), 6))
    return event_dict


def configure(fmt: str = "auto", level: str = "info", stream: IO[str] | None = None) -> structlog.typing.FilteringBoundLogger:
    """Configure structlog for the process and return the daemon's logger."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer: Processor = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_monotonic,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        # PrintLogger only writes and flushes, which any IO[str] does; its stub asks for TextIO.
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, stream)),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger("sglang-supervisor")


class LogSink:
    """EventSink writing each event as one structured log line."""

    def __init__(self, logger: FilteringBoundLogger) -> None:
        self.log = logger

    def emit(self, event: Event) -> None:
        try:
            data = event.fields()
            if "argv" in data:
                data["argv"] = redact_argv(data["argv"])
            level = "debug" if event.quiet else EVENT_LEVELS.get(event.kind, "info")
            getattr(self.log, level)(event.kind, **data)
        except Exception:  # noqa: BLE001 - a log line must never break supervision
            pass
