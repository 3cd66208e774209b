"""``sglang-supervisor stop`` and ``start``: an operator's hold on a server while the daemon
stays up (``services/maintenance.py``), asked over the control socket; each prints the
states the server passes until it is stopped and held, or serving again."""

from __future__ import annotations

import asyncio
import contextlib
from typing import IO, Any

from supervisor.cli.common import fail
from supervisor.core.config import Config, select_server, unit_name


def maintenance(cmd: str, cfg: Config, *, server: str | None, wait: bool, timeout_s: float, reason: str,
                out: IO[str]) -> int:
    """Ask the running daemon to stop (hold) or start ``server`` (every server when None)."""
    units = [unit_name(u) for u in select_server(cfg, server)]  # an unknown name: one line, exit 2
    return asyncio.run(_ask(cmd, cfg, units, server, wait, timeout_s, reason, out))


async def _ask(cmd: str, cfg: Config, units: list[str], server: str | None, wait: bool, timeout_s: float,
               reason: str, out: IO[str]) -> int:
    from supervisor.adapters.control import ControlError, converse, socket_path

    ask: dict[str, Any] = {"cmd": cmd, "reason": reason, "wait": wait}
    if server is not None:
        ask["server"] = server
    many = len(units) > 1 or bool(cfg.units)
    try:
        async with contextlib.aclosing(converse(socket_path(cfg.state.dir), ask, then_timeout_s=timeout_s)) as lines:
            answer = await anext(lines)
            if not answer.get("ok"):
                return fail(f"{cmd}: refused: {answer.get('error')}", 1)
            for s in answer.get("servers") or []:
                who = f"{s.get('name')}: " if many else ""
                print(f"{cmd} accepted ({who}{s.get('state')}, launch {s.get('attempt')})", file=out, flush=True)
            if not wait:
                return 0
            async for line in lines:
                if line.get("done"):
                    if not line.get("ok"):
                        return fail(f"{cmd}: {line.get('detail')}", 1)
                    print(line.get("detail"), file=out, flush=True)
                    return 0
                who = f"{line['server']}: " if many and line.get("server") else ""
                print(f"  {who}{line.get('state')}", file=out, flush=True)
    except ControlError as exc:
        if "no more from the daemon" in str(exc):
            return fail(f"{cmd}: not done after {timeout_s:g} s", 1)
        return fail(f"{cmd}: {exc} (is the daemon for {cfg.name} running?)", 1)
    return fail(f"{cmd}: the daemon closed the connection before it was done", 1)
