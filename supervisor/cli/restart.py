"""``sglang-supervisor restart``: ask the running daemon (over its control socket) for a
planned restart, and follow the state file until the server is READY again."""

from __future__ import annotations

import asyncio
import sys
from typing import IO

from supervisor.cli.common import fail
from supervisor.core.config import Config


def restart(cfg: Config, *, wait: bool = True, timeout_s: float = 3600.0, out: IO[str] | None = None) -> int:
    """Ask the running daemon for a planned restart; with ``wait``, until READY again."""
    import time

    from supervisor.adapters.control import ControlError, request, socket_path
    from supervisor.adapters.store import StateStore

    out = out or sys.stdout
    try:
        answer = asyncio.run(request(socket_path(cfg.state.dir), {"cmd": "restart", "reason": "sglang-supervisor restart"}))
    except ControlError as exc:
        return fail(f"restart: {exc} (is the daemon for {cfg.name} running?)", 1)
    if not answer.get("ok"):
        return fail(f"restart: refused: {answer.get('error')}", 1)
    before = answer.get("attempt")
    print(f"restart accepted ({answer.get('state')}, launch {before})", file=out, flush=True)
    if not wait:
        return 0
    store = StateStore(cfg.state.dir)
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        data, _warning = store.load(move_aside=False)
        state = (data or {}).get("state")
        attempt = (data or {}).get("attempt")
        if state != seen:
            print(f"  {state}", file=out, flush=True)
            seen = state
        if state == "READY" and isinstance(attempt, int) and isinstance(before, int) and attempt > before:
            print(f"ready again (launch {attempt})", file=out)
            return 0
        if state in ("GAVE_UP", "STOPPED"):
            return fail(f"restart: the daemon is {state}: {(data or {}).get('reason', '')}", 1)
        time.sleep(0.2)
    return fail(f"restart: not READY again after {timeout_s:g} s (state {seen})", 1)


