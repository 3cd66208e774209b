"""Structured logging: JSON lines by default, a console renderer on a TTY.

``LogSink`` turns the daemon's events into log lines with stable event names. Values
that may hold secrets (``--api-key`` style arguments) are redacted before they are logged.

Under journald (``configure(journal=...)``, which the composition root passes when stderr
is the journal) every line is the same JSON, sent as one journal entry with its syslog
``PRIORITY`` and the fields ``SGLANG_SUPERVISOR_EVENT``, ``_SERVER``, ``_CAUSE`` and
``_INSTANCE`` (``journal_fields``); a line the journal socket does not take goes to stderr
instead, prefixed ``<N>`` so journald still gets its priority (``SyslogLevelPrefix=``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import IO, Any, Protocol, TextIO, cast

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
    "reexec_refused": "warning",
    "state_write_failed": "warning",
    "server_log_write_failed": "warning",
    "fleet_error": "warning",
}
# syslog priorities (journalctl -p): a give-up is crit, a crash err.
PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}
FIELD_PREFIX = "SGLANG_SUPERVISOR_"
IDENTIFIER = "sglang-supervisor"


def _add_monotonic(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    event_dict.setdefault("mono", round(time.monotonic(), 6))
    return event_dict


class JournalPort(Protocol):
    """Where journal entries go (``supervisor.adapters.journald.JournalSocket``)."""

    def send(self, fields: Mapping[str, str]) -> bool: ...


def journal_fields(event_dict: EventDict, message: str, *, server: str = "") -> dict[str, str]:
    """The journal entry of one log line: the rendered line as ``MESSAGE``, its priority,
    and the event, server, cause and instance as fields of their own (``server``: the name
    for lines that carry none, i.e. a daemon's single ``[server]``)."""
    fields = {
        "MESSAGE": message,
        "PRIORITY": str(PRIORITIES.get(str(event_dict.get("level", "info")), 6)),
        "SYSLOG_IDENTIFIER": IDENTIFIER,
        FIELD_PREFIX + "EVENT": str(event_dict.get("event", "")),
    }
    for key, value in (("SERVER", event_dict.get("server") or server), ("CAUSE", event_dict.get("cause")),
                       ("INSTANCE", event_dict.get("instance"))):
        if isinstance(value, str) and value:
            fields[FIELD_PREFIX + key] = value
    return fields


class _JournalRenderer:
    """The last processor under journald: renders the line as usual and hands the logger
    the journal entry's fields with it."""

    def __init__(self, renderer: Processor, server: str) -> None:
        self.renderer = renderer
        self.server = server

    def __call__(self, logger: WrappedLogger, name: str, event_dict: EventDict) -> tuple[tuple[str], dict[str, Any]]:
        message = str(self.renderer(logger, name, dict(event_dict)))
        return (message,), {"fields": journal_fields(event_dict, message, server=self.server)}


class JournalLogger:
    """structlog's logger under journald: each line one journal entry; when the socket does
    not take it, the line goes to ``stream`` (the journal's stderr stream) with a ``<N>``
    priority prefix, so it is never lost."""

    def __init__(self, journal: JournalPort, stream: IO[str]) -> None:
        self.journal = journal
        self.stream = stream

    def msg(self, message: str, fields: Mapping[str, str] | None = None) -> None:
        if fields is not None and self.journal.send(fields):
            return
        priority = fields.get("PRIORITY", "6") if fields is not None else "6"
        try:
            self.stream.write(f"<{priority}>{message}\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # stderr gone too: nowhere left to write

    log = debug = info = warning = warn = error = critical = exception = fatal = failure = err = msg


def configure(fmt: str = "auto", level: str = "info", stream: IO[str] | None = None, *,
              journal: JournalPort | None = None, server: str = "") -> structlog.typing.FilteringBoundLogger:
    """Configure structlog for the process and return the daemon's logger. ``journal``:
    send each line to journald with its priority and fields (see the module docstring);
    ``server``: the ``SGLANG_SUPERVISOR_SERVER`` of lines that name none."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer: Processor = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    factory: Any = (
        # PrintLogger only writes and flushes, which any IO[str] does; its stub asks for TextIO.
        structlog.PrintLoggerFactory(cast(TextIO, stream)) if journal is None
        else (lambda *_args: JournalLogger(journal, stream))
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_monotonic,
            structlog.processors.format_exc_info,
            renderer if journal is None else _JournalRenderer(renderer, server),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=factory,
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
