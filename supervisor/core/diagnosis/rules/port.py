"""A port someone else holds (HTTP, dist-init, ZMQ)."""

from __future__ import annotations

from supervisor.core.diagnosis.rule import _ci, _Rule
from supervisor.core.model import Cause

RULES: tuple[_Rule, ...] = (
    # -- a port someone else holds (HTTP, dist-init, ZMQ)
    _Rule("port", Cause.PORT_IN_USE, ("address already in use", "eaddrinuse", "errno 98", "address in use"),
          origin="kernel",
          cites=(("address already in use", "glibc strerror(EADDRINUSE): 'Address already in use'"),
                 ("eaddrinuse", "errno name EADDRINUSE (torch TCPStore: 'name: EADDRINUSE')"),
                 ("errno 98", "CPython OSError: '[Errno 98] Address already in use'"),
                 ("address in use", "zmq: 'Address in use' (zmq.error.ZMQError)"))),
    _Rule("port_taken", Cause.PORT_IN_USE, ("already in use",), pattern=_ci(r"\bport\b[^\n]{0,60}?already in use"),
          cites=(("already in use", "sglang server_args.py / utils: 'port ... is already in use'"),)),
)
