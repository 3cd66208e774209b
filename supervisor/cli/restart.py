"""``sglang-supervisor restart``: ask the running daemon (over its control socket) for a
planned restart, and follow the state files until each server is READY again.

With several servers the daemon restarts them one at a time (a rolling restart: out of
the router, drained, stopped, relaunched, READY, back in the router, then the next one);
``--server NAME`` restarts that one only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import IO, Any

from supervisor.cli.common import fail
from supervisor.core.config import Config, select_server, unit_name


def restart(
    cfg: Config, *, server: str | None = None, wait: bool = True, timeout_s: float = 3600.0, out: IO[str] | None = None,
) -> int:
    """Ask the running daemon for a planned restart; with ``wait``, until READY again."""
    from supervisor.adapters.control import ControlError, request, socket_path

    out = out or sys.stdout
    units = {unit_name(u): u for u in select_server(cfg, server)}  # an unknown name: one line, exit 2
    ask: dict[str, Any] = {"cmd": "restart", "reason": "sglang-supervisor restart"}
    if server is not None:
        ask["server"] = server
    try:
        answer = asyncio.run(request(socket_path(cfg.state.dir), ask))
    except ControlError as exc:
        return fail(f"restart: {exc} (is the daemon for {cfg.name} running?)", 1)
    if not answer.get("ok"):
        return fail(f"restart: refused: {answer.get('error')}", 1)
    servers = answer.get("servers") or [{"name": next(iter(units)), "state": answer.get("state"),
                                         "attempt": answer.get("attempt")}]
    many = len(units) > 1 or bool(cfg.units)
    for s in servers:
        who = f"{s['name']}: " if many else ""
        print(f"restart accepted ({who}{s.get('state')}, launch {s.get('attempt')})", file=out, flush=True)
    if not wait:
        return 0
    deadline = time.monotonic() + timeout_s
    for s in servers:
        unit = units.get(str(s.get("name")))
        if unit is None:
            return fail(f"restart: the daemon named a server this config does not have: {s.get('name')!r}", 1)
        code = _follow(unit, s.get("attempt"), deadline, timeout_s, f"{s['name']}: " if many else "", out)
        if code:
            return code
    return 0


def _follow(cfg: Config, before: object, deadline: float, timeout_s: float, who: str, out: IO[str]) -> int:
    """Follow one server's state file until it is READY at a later launch than ``before``."""
    from supervisor.adapters.store import StateStore

    store = StateStore(cfg.state.dir)
    seen = None
    while time.monotonic() < deadline:
        data, _warning = store.load(move_aside=False)
        state = (data or {}).get("state")
        attempt = (data or {}).get("attempt")
        later = isinstance(attempt, int) and isinstance(before, int) and attempt > before
        if state != seen:
            print(f"  {who}{state}", file=out, flush=True)
            seen = state
        if state == "READY" and later:
            print(f"{who}ready again (launch {attempt})", file=out, flush=True)
            return 0
        if state in ("GAVE_UP", "STOPPED"):
            return fail(f"restart: {who}the daemon is {state}: {(data or {}).get('reason', '')}", 1)
        time.sleep(0.2)
    return fail(f"restart: {who}not READY again after {timeout_s:g} s (state {seen})", 1)
