"""``sglang-supervisor restart``: ask the running daemon (over its control socket) for a
planned restart, and print its pass as the daemon reports it, until the pass is done.

With several servers the daemon restarts them one at a time (a rolling restart: out of
the router, drained, stopped, relaunched, READY, back in the router, then the next one);
``--server NAME`` restarts that one only.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import IO, Any

from supervisor.cli.common import fail
from supervisor.core.config import Config, select_server, unit_name


def restart(
    cfg: Config, *, server: str | None = None, wait: bool = True, timeout_s: float = 3600.0, out: IO[str] | None = None,
) -> int:
    """Ask the running daemon for a planned restart; with ``wait``, until the daemon's pass
    is done: every server READY again at a later launch and back in the router."""
    out = out or sys.stdout
    units = {unit_name(u): u for u in select_server(cfg, server)}  # an unknown name: one line, exit 2
    return asyncio.run(_restart(cfg, units, server, wait, timeout_s, out))


async def _restart(cfg: Config, units: dict[str, Config], server: str | None, wait: bool, timeout_s: float,
                   out: IO[str]) -> int:
    from supervisor.adapters.control import ControlError, converse, socket_path

    ask: dict[str, Any] = {"cmd": "restart", "reason": "sglang-supervisor restart", "wait": wait}
    if server is not None:
        ask["server"] = server
    many = len(units) > 1 or bool(cfg.units)
    deadline = time.monotonic() + timeout_s
    try:
        async with contextlib.aclosing(converse(socket_path(cfg.state.dir), ask, then_timeout_s=timeout_s)) as lines:
            answer = await anext(lines)
            if not answer.get("ok"):
                return fail(f"restart: refused: {answer.get('error')}", 1)
            servers = answer.get("servers") or [{"name": next(iter(units)), "state": answer.get("state"),
                                                 "attempt": answer.get("attempt")}]
            for s in servers:
                who = f"{s['name']}: " if many else ""
                print(f"restart accepted ({who}{s.get('state')}, launch {s.get('attempt')})", file=out, flush=True)
            if not wait:
                return 0
            before = {str(s.get("name")): s.get("attempt") for s in servers}
            async for line in lines:
                if line.get("done"):
                    return _ended(line, before, many, out)
                who = f"{line['server']}: " if many and line.get("server") else ""
                if "state" in line:
                    print(f"  {who}{line['state']}", file=out, flush=True)
                elif line.get("step") in ("waiting", "stopped", "unregistered"):
                    print(f"  {who}{line.get('detail')}", file=out, flush=True)
    except ControlError as exc:
        if "no more from the daemon" in str(exc):
            return fail(f"restart: the pass was not done after {timeout_s:g} s", 1)
        return fail(f"restart: {exc} (is the daemon for {cfg.name} running?)", 1)
    # A daemon from before the pass was reported answers once and closes: follow the state files.
    for s in servers:
        unit = units.get(str(s.get("name")))
        if unit is None:
            return fail(f"restart: the daemon named a server this config does not have: {s.get('name')!r}", 1)
        code = await asyncio.to_thread(_follow, unit, s.get("attempt"), deadline, timeout_s,
                                       f"{s['name']}: " if many else "", out)
        if code:
            return code
    return 0


def _ended(line: dict[str, Any], before: dict[str, Any], many: bool, out: IO[str]) -> int:
    """The daemon's last line: how the pass ended, with each server's state and launch."""
    for s in line.get("servers") or []:
        who = f"{s.get('name')}: " if many else ""
        attempt, was = s.get("attempt"), before.get(str(s.get("name")))
        if s.get("state") == "READY" and isinstance(attempt, int) and isinstance(was, int) and attempt > was:
            print(f"{who}ready again (launch {attempt})", file=out, flush=True)
    if not line.get("ok"):
        return fail(f"restart: {line.get('detail') or 'the pass did not end well'}", 1)
    return 0


def _follow(cfg: Config, before: object, deadline: float, timeout_s: float, who: str, out: IO[str]) -> int:
    """Follow one server's state file until it is READY at a later launch than ``before``
    (a daemon that does not report its pass)."""
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
