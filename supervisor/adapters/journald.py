"""journald's native protocol, stdlib only: one log line as one datagram with its fields.

When systemd connects a service's stderr to the journal it sets ``JOURNAL_STREAM`` to
``DEVICE:INODE`` of that stream (systemd.exec(5)); a process whose fd 2 is still that
stream may then write to ``/run/systemd/journal/socket`` instead, as sd_journal_send(3)
does, and give every line its ``PRIORITY=`` and fields of its own (``journalctl -p err``,
``journalctl SGLANG_SUPERVISOR_EVENT=gave_up``).

The protocol (systemd's "Native Journal Protocol"): a datagram of ``KEY=value\\n`` entries;
a value holding a newline is written ``KEY\\n``, its length as 64-bit little endian, the
bytes, ``\\n``. A datagram too big for the socket (``EMSGSIZE``) goes as a sealed memfd
passed with ``SCM_RIGHTS`` and an empty datagram. Keys are upper-case letters, digits and
``_``, not starting with ``_`` (those are journald's own trusted fields).

``JournalSocket.send`` never raises and never blocks (a non-blocking socket): it returns
False when the line did not go out (no socket, journald gone, its queue full), and the
caller writes the line to stderr instead (``supervisor.sinks.logs``), so no line is lost.
Why this and not a library: bench/bench_journal.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import struct
from collections.abc import Mapping

JOURNAL_SOCKET = "/run/systemd/journal/socket"
_KEY = re.compile(r"[A-Z0-9][A-Z0-9_]*\Z")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def stderr_is_journal(environ: Mapping[str, str] = os.environ, fd: int = 2) -> bool:
    """Whether ``fd`` is the journal stream systemd gave this service (``JOURNAL_STREAM``
    names its device and inode; a redirected stderr, or a child that inherited the
    variable with another stderr, does not match)."""
    dev, sep, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError):
        return False


def encode(fields: Mapping[str, str]) -> bytes:
    """The datagram for ``fields`` (an invalid key is left out; multi-line values binary-safe)."""
    out = bytearray()
    for key, value in fields.items():
        if not _KEY.match(key):
            continue
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class JournalSocket:
    """Sends log entries to journald's native socket (see the module docstring)."""

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        self.path = path
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, fd: int = 2) -> JournalSocket | None:
        """A sender when stderr is the journal (``stderr_is_journal``), else None."""
        return cls() if stderr_is_journal(environ, fd) else None

    def send(self, fields: Mapping[str, str]) -> bool:
        """One entry; True if journald has it. Never raises, never blocks."""
        payload = encode(fields)
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            try:
                self._sock.sendto(payload, self.path)
            except OSError as exc:
                if exc.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                    raise
                self._send_memfd(payload)
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                self.close()  # journald restarted, or is gone: a fresh socket next time
            return False
        return True

    def _send_memfd(self, payload: bytes) -> None:
        """A big entry: its bytes in a sealed memfd, the fd passed over the socket."""
        assert self._sock is not None
        fd = os.memfd_create("journal-entry", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._sock.sendmsg([b""], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))], 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
