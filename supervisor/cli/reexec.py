"""``sglang-supervisor reexec``: have the running daemon re-execute itself in place (the code
installed now, the same pid), its servers serving on (docs/upgrade.md).

It asks over the control socket; the daemon checks the installed code, waits for a safe
point, hands over and execs; the connection ends with the exec. Then the new program is
asked (``hello``) until it answers: the same pid, one more exec, and each server adopted
where it stood (pid and launch unchanged) or, with why, relaunched.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import IO, Any

from supervisor.cli.common import fail
from supervisor.core.config import Config


def reexec(cfg: Config, *, timeout_s: float, reason: str, out: IO[str]) -> int:
    return asyncio.run(_reexec(cfg, timeout_s, reason, out))


async def _reexec(cfg: Config, timeout_s: float, reason: str, out: IO[str]) -> int:
    from supervisor.adapters.control import ControlError, converse, request, socket_path

    path = socket_path(cfg.state.dir)
    try:
        before = await request(path, {"cmd": "hello"})
    except ControlError as exc:
        return fail(f"reexec: {exc} (is the daemon for {cfg.name} running?)", 1)
    if not before.get("ok"):
        return fail(f"reexec: the daemon does not know 'hello' ({before.get('error')}): it is older than re-exec", 1)
    try:
        async with contextlib.aclosing(converse(path, {"cmd": "reexec", "reason": reason, "wait": True},
                                                then_timeout_s=timeout_s)) as lines:
            answer = await anext(lines)
            if not answer.get("ok"):
                return fail(f"reexec: refused: {answer.get('error')}", 1)
            print(f"reexec accepted (pid {answer.get('pid')}, version {answer.get('version')}): checking the "
                  "installed code, then handing over at a safe point", file=out, flush=True)
            async for line in lines:
                if line.get("done") and not line.get("ok"):
                    return fail(f"reexec: refused: {line.get('error')}", 1)
    except ControlError:
        pass  # the connection ends with the exec
    after = await _hello_after(path, before, time.monotonic() + timeout_s)
    if after is None:
        return fail(f"reexec: the daemon did not answer again within {timeout_s:g} s", 1)
    return _said(before, after, out)


async def _hello_after(path: Any, before: dict[str, Any], deadline: float) -> dict[str, Any] | None:
    """The new program's ``hello``: once one answers that started after ``before``'s."""
    from supervisor.adapters.control import ControlError, request

    while time.monotonic() < deadline:
        with contextlib.suppress(ControlError):
            hello = await request(path, {"cmd": "hello"}, timeout_s=2.0)
            if hello.get("ok") and float(hello.get("program_started") or 0) > float(before.get("program_started") or 0):
                return hello
        await asyncio.sleep(0.2)
    return None


def _said(before: dict[str, Any], after: dict[str, Any], out: IO[str]) -> int:
    same = after.get("pid") == before.get("pid")
    print(f"re-executed in place: pid {after.get('pid')}{' (unchanged)' if same else ' (CHANGED)'}, "
          f"version {before.get('version')} -> {after.get('version')}", file=out, flush=True)
    was = {s.get("name"): s for s in before.get("servers") or []}
    relaunched = []
    for s in after.get("servers") or []:
        # what was handed over at the safe point, not what stood when asked: a launch or stop
        # under way then (an operator's restart) ends first, and its server is the one adopted
        asked = was.get(s.get("name")) or {}
        handed = s.get("handed_over") or asked
        kept = s.get("adopted") and s.get("pid") == handed.get("pid") and s.get("attempt") == handed.get("attempt")
        if not kept:
            relaunched.append(str(s.get("name")))
        what = "adopted" if kept else "relaunched"
        if kept and handed.get("attempt") != asked.get("attempt"):
            what += f" (launch {asked.get('attempt')}, under way when asked, ended first)"
        print(f"  {s.get('name')}: {s.get('state')}, pid {s.get('pid')}, launch {s.get('attempt')}: {what}",
              file=out, flush=True)
    if relaunched:
        return fail(f"reexec: not adopted, relaunched: {', '.join(relaunched)} ({after.get('why_not') or '?'})", 1)
    return 0 if same else 1
