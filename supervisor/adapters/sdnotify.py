"""Telling systemd the truth about the daemon: the sd_notify protocol, stdlib only.

A ``Type=notify`` service gets ``NOTIFY_SOCKET`` (a unix datagram socket: a path, or an
abstract name written with a leading ``@``) and, with ``WatchdogSec=``, ``WATCHDOG_USEC``
and ``WATCHDOG_PID``. Each message is one datagram of ``KEY=VALUE`` lines:

- ``READY=1`` once the daemon supervises (not once SGLang serves: see docs/systemd.md),
- ``STATUS=<one line>`` on every change (``systemctl status`` shows it),
- ``WATCHDOG=1`` every ``WATCHDOG_USEC / 2`` from the event loop (``watchdog_loop``), so a
  wedged loop stops the pings and systemd restarts the daemon,
- ``RELOADING=1`` + ``MONOTONIC_USEC=`` on SIGHUP, then ``READY=1`` after the reload,
- ``STOPPING=1`` on shutdown, ``EXTEND_TIMEOUT_USEC=`` to stretch a start or stop.

Without ``NOTIFY_SOCKET`` every call is a no-op. A send never raises and never blocks
(the socket is non-blocking: a full receive queue drops the message); the first failure
of a run of failures is logged, later ones are not until a send succeeds again.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

STATUS_MAX_CHARS = 256


def _one_line(text: str, limit: int = STATUS_MAX_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _socket_address(value: str) -> str | None:
    """The ``sendto`` address for a ``NOTIFY_SOCKET`` value, or None when unsupported."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # e.g. "vsock:..." (systemd >= 253): not used on a host


def _positive_int(value: str | None) -> int | None:
    try:
        number = int(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and number > 0 else None


class Notifier:
    """Sends sd_notify messages to systemd; every method is a no-op without a socket."""

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        """``address`` is a ``NOTIFY_SOCKET`` value (path or ``@abstract``); None disables."""
        self._address = _socket_address(address) if address else None
        if address and self._address is None:
            log.warning("sd_notify disabled: unsupported NOTIFY_SOCKET %r", address)
        self._watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._failing = False
        self._last_status: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, *, pid: int | None = None) -> Notifier:
        """A notifier for this process from ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``.

        The watchdog counts only when ``WATCHDOG_PID`` is unset or names this process
        (``pid``, default ``os.getpid()``): a child that inherited the variables stays quiet.
        """
        usec = _positive_int(environ.get("WATCHDOG_USEC"))
        watchdog_pid = environ.get("WATCHDOG_PID")
        if watchdog_pid is not None and _positive_int(watchdog_pid) != (pid if pid is not None else os.getpid()):
            usec = None
        return cls(environ.get("NOTIFY_SOCKET") or None, watchdog_usec=usec)

    @property
    def enabled(self) -> bool:
        """Whether messages go anywhere."""
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings (half of ``WATCHDOG_USEC``), or None if off."""
        if self._address is None or self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def ready(self, status: str | None = None) -> bool:
        """``READY=1`` (optionally with a ``STATUS=`` line in the same datagram)."""
        return self._send({"READY": "1"}, status)

    def status(self, text: str) -> bool:
        """``STATUS=`` one line (whitespace collapsed, bounded); unchanged text is not resent."""
        line = _one_line(text)
        if line == self._last_status:
            return True
        return self._send({}, line)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the daemon's event loop is alive."""
        return self._send({"WATCHDOG": "1"})

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: the daemon is shutting down."""
        return self._send({"STOPPING": "1"}, status)

    def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC``; call ``ready()`` when the reload is done."""
        return self._send({"RELOADING": "1", "MONOTONIC_USEC": str(_monotonic_usec())}, status)

    def extend_timeout(self, usec: int) -> bool:
        """``EXTEND_TIMEOUT_USEC``: the current start/stop needs ``usec`` more from now."""
        return self._send({"EXTEND_TIMEOUT_USEC": str(max(0, int(usec)))})

    def close(self) -> None:
        """Close the socket (a later send opens a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, fields: dict[str, str], status: str | None = None) -> bool:
        """Send one datagram; True if it went out (or there is nowhere to send)."""
        if self._address is None:
            return True
        if status is not None:
            fields = {**fields, "STATUS": _one_line(status)}
        payload = "".join(f"{k}={v}\n" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            self._note_failure(exc)
            return False
        if self._failing:
            log.info("sd_notify: sending to %s works again", self._printable_address())
        self._failing = False
        if "STATUS" in fields:
            self._last_status = fields["STATUS"]
        return True

    def _note_failure(self, exc: OSError) -> None:
        if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
            self.close()  # a fresh socket next time (e.g. after systemd re-created its own)
        if not self._failing:
            log.warning("sd_notify: cannot send to %s: %s (further failures not logged)",
                        self._printable_address(), exc)
        self._failing = True

    def _printable_address(self) -> str:
        return (self._address or "").replace("\0", "@", 1)
