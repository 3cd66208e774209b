"""``sglang-supervisor status``: each server's state from the state directory, one line
each in ``supervisorctl status``'s shape (name, state, pid, uptime, fraction, last cause),
its details with ``--verbose``, everything with ``--json``; works whether or not the daemon
runs.

Its exit code is the LSB convention that ``systemctl is-active`` and init scripts use, so a
monitor can act on it (the worst of the servers shown wins, in this order):

- 1: a server gave up, or the daemon is not running while the state says it should be
  (it was killed: the last state is not STOPPED);
- 4: no state (never run here, or the wrong state directory);
- 3: a server is not running (stopped, held by an operator's ``stop``, starting, backing off);
- 0: every server is serving (READY).
"""

from __future__ import annotations

import json
import sys
import time
from typing import IO, Any

from supervisor.adapters import procstart
from supervisor.core.config import Config, select_server, unit_name
from supervisor.core.state import Learned

EXIT_SERVING, EXIT_DEAD, EXIT_NOT_RUNNING, EXIT_NO_STATE = 0, 1, 3, 4
_WORST = (EXIT_DEAD, EXIT_NO_STATE, EXIT_NOT_RUNNING, EXIT_SERVING)  # first = worst
PLANNED_CAUSES = ("operator_restart", "climb")  # planned before the history said so itself


def planned(h: dict[str, Any]) -> bool:
    """A history line of a relaunch made on purpose (not a crash)."""
    return bool(h.get("planned")) or h.get("cause") in PLANNED_CAUSES


def status(cfg: Config, *, server: str | None = None, as_json: bool = False, verbose: bool = False,
           out: IO[str] | None = None) -> int:
    """Each server's status (one of them with ``server``); the exit code says the worst."""
    out = out or sys.stdout
    units = select_server(cfg, server)
    read = [(unit_name(u), u, *_read(u)) for u in units]
    codes = [exit_code(data, running) for _name, _u, data, _warning, running in read]
    code = min(codes, key=_WORST.index)
    if as_json:
        objs = {name: _json(u, data, warning, running, c)
                for (name, u, data, warning, running), c in zip(read, codes, strict=True)}
        doc = objs[read[0][0]] if not cfg.units else {"servers": objs}
        print(json.dumps({**doc, "exit_code": code} if cfg.units else doc, indent=1), file=out)
        return code
    rows = [_row(name, data, warning, running) for name, _u, data, warning, running in read]
    widths = [max(len(r[0][i]) for r in rows) for i in range(2)]
    for (cells, notes), (_name, u, data, _warning, running) in zip(rows, read, strict=True):
        print(f"{cells[0].ljust(widths[0])}  {cells[1].ljust(widths[1])}  {cells[2]}".rstrip(), file=out)
        for note in notes:
            print(f"  {note}", file=out)
        if verbose and data is not None:
            _details(u, data, running, out)
    return code


def exit_code(data: dict[str, Any] | None, running: bool) -> int:
    """One server's LSB status code (the module's docstring)."""
    if data is None:
        return EXIT_NO_STATE
    state = data.get("state")
    if state == "GAVE_UP" or (not running and state != "STOPPED"):
        return EXIT_DEAD
    return EXIT_SERVING if running and state == "READY" else EXIT_NOT_RUNNING


def _read(cfg: Config) -> tuple[dict[str, Any] | None, str | None, bool]:
    from supervisor.adapters.store import StateStore

    store = StateStore(cfg.state.dir)
    data, warning = store.load(move_aside=False)
    return data, warning, store.locked_by_other()


def counts(history: list[dict[str, Any]]) -> dict[str, int]:
    """The history's lines by kind: crashes, planned relaunches (an operator's restart, a
    climb, a step-down for headroom), and the step-downs among those."""
    made = [h for h in history if planned(h)]
    return {"crashes": len(history) - len(made), "planned": len(made),
            "step_downs": sum(1 for h in history if h.get("cause") == "headroom_low")}


def _json(cfg: Config, data: dict[str, Any] | None, warning: str | None, running: bool, code: int) -> dict[str, Any]:
    if data is None:
        return {"running": running, "state": None, "warning": warning, "exit_code": code}
    learned = data.get("learned", {})
    return {"running": running, **data, "recommended": _recommended(cfg, learned),
            "counts": counts(learned.get("history", [])), "exit_code": code}


def _row(name: str, data: dict[str, Any] | None, warning: str | None,
         running: bool) -> tuple[tuple[str, str, str], list[str]]:
    """One server's line (name, state, the rest) and the notes under it."""
    if data is None:
        return (name, "NO STATE", "never run here? (no state file)" + (f" - {warning}" if warning else "")), []
    state = str(data.get("state", "?"))
    learned = data.get("learned", {})
    parts = []
    pid = data.get("server_pid")
    if running and state in ("READY", "STARTING") and isinstance(pid, int):
        age = _server_age(data)
        up = f", uptime {_uptime(age)}" if age is not None else ""
        parts.append(f"pid {pid}{up}")
    fraction = learned.get("fraction")
    parts.append(f"fraction {'sglang' if fraction is None else f'{fraction:g}'}")
    c = counts(learned.get("history", []))
    last = next((h for h in reversed(learned.get("history", []))
                 if not planned(h)), None)
    parts.append(f"last {last['cause']} at {last['wall_time']}" if last else "no crash")
    on_purpose = f", {c['planned']} planned" if c["planned"] else ""
    parts.append(f"{c['crashes']} crash(es){on_purpose}")
    notes = []
    if not running:
        daemon = "the daemon is not running" + ("" if state == "STOPPED" else " (it was killed: the state is its last)")
        notes.append(daemon)
    held = data.get("held")
    if isinstance(held, dict):
        notes.append(f"held by an operator since {held.get('since')}: {held.get('reason')} "
                     f"('sglang-supervisor start' launches it)")
    gave_up = data.get("gave_up")
    if isinstance(gave_up, dict):
        notes.append(f"gave up at {gave_up.get('wall_time')}: {gave_up.get('reason')}")
        if gave_up.get("evidence"):
            notes.append(f"  evidence: {gave_up['evidence']}")
        if gave_up.get("command"):
            notes.append(f"  command:  {' '.join(map(str, gave_up['command']))}")
    elif state not in ("READY", "STOPPED") and data.get("reason"):
        notes.append(f"why: {data['reason']}")
    return (name, state if running else f"{state} (last known)", "   ".join(parts)), notes


def _server_age(data: dict[str, Any]) -> float | None:
    """How long the server has run. By its start in this boot's ticks where the daemon
    recorded one (``server_started``): no step of the wall clock moves it. Else (a state file
    from an older daemon) by the spawn's wall time, the clock this process shares with it."""
    start, boot, since = data.get("server_started"), data.get("server_boot"), data.get("server_since")
    if isinstance(start, int) and isinstance(boot, str) and boot == procstart.boot_id():
        return procstart.age_s(start)
    return time.time() - since if isinstance(since, int | float) else None


def _uptime(seconds: float) -> str:
    s = max(0, int(seconds))
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days} day{'s' if days != 1 else ''}, {text}" if days else text


def _details(cfg: Config, data: dict[str, Any], running: bool, out: IO[str]) -> None:
    """``--verbose``: what the daemon learned, the capacity model, the fleet, the history."""
    learned = data.get("learned", {})
    print(f"  instance:  {cfg.name}  ({cfg.state.dir}; daemon "
          f"{'running, pid ' + str(data.get('daemon_pid')) if running else 'not running'})", file=out)

    def frac(value: object) -> str:
        return "SGLang's own choice" if value is None else str(value)

    print(f"  fraction:  {frac(learned.get('fraction'))}  (configured {frac(learned.get('base_fraction'))}; "
          f"ran out of CUDA memory at: {', '.join(map(str, learned.get('oom_fractions', []))) or 'none'})", file=out)
    print(f"  hicache:   {learned.get('hicache_size_gb')} GB per rank   restarts: {learned.get('restarts', 0)}",
          file=out)
    capacity = _capacity_line(cfg, learned)
    if capacity:
        print(f"  capacity:  {capacity}", file=out)
    fleet_line = _fleet_line(learned)
    if fleet_line:
        print(f"  fleet:     {fleet_line}", file=out)
    history = learned.get("history", [])
    c = counts(history)
    print(f"  history:   {c['crashes']} crash(es); {c['planned']} planned relaunch(es): restarts, climbs and "
          f"{c['step_downs']} step-down(s) for headroom", file=out)
    if history:
        rows = [("time", "kind", "cause", "phase", "exit", "fraction", "next", "location")]
        rows.extend(
            (
                h["wall_time"], "planned" if planned(h) else "crash",
                h["cause"], h["phase"], h["exit"], "sglang" if h["fraction"] is None else f"{h['fraction']:g}",
                "-" if h["next_fraction"] is None else f"{h['next_fraction']:g}", h.get("location") or "-",
            )
            for h in history[-20:]
        )
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("    " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


def _learned(learned: dict[str, Any]) -> Learned | None:
    try:
        return Learned.from_dict(learned)
    except (KeyError, TypeError, ValueError):
        return None


def _recommended(cfg: Config, learned: dict[str, Any]) -> dict[str, Any] | None:
    known = _learned(learned)
    if known is None:
        return None
    rec = known.recommendation(cfg)
    return {"fraction": rec.fraction, "current": rec.current, "kv_tokens_now": rec.kv_tokens_now,
            "kv_tokens_at": rec.kv_tokens_at, "headroom_gb": rec.headroom_gb, "rank": rec.rank,
            "missing": rec.missing, "words": rec.words()}


def _capacity_line(cfg: Config, learned: dict[str, Any]) -> str:
    """The memory model's recommended fraction with its arithmetic (docs/capacity.md)."""
    known = _learned(learned)
    if known is None:
        return ""
    points = ", ".join(f"{p.fraction:g}" for p in sorted(known.capacity.points, key=lambda p: p.fraction))
    seen = f"  (launches at {points})" if points else ""
    return known.recommendation(cfg).words() + seen


def _fleet_line(learned: dict[str, object]) -> str:
    """What the fleet's record said at the last launch ([fleet]; docs/fleet.md), and the
    OOMs of ours it does not hold yet."""
    note = learned.get("fleet")
    pending = learned.get("fleet_pending") or []
    parts = []
    if isinstance(note, dict):
        where = f" (reached by {note.get('source') or '?'} at {note.get('when') or '?'})"
        if note.get("applied"):
            parts.append(f"started at the fleet's {note.get('fraction')}, below our own {note.get('own_fraction')}"
                         f"{where}, applied {note.get('applied_at') or '?'}")
        else:
            parts.append(f"the fleet's rung is {note.get('fraction')}, not below ours{where}")
        parts.append(f"key {note.get('key')}")
    if isinstance(pending, list) and pending:
        parts.append(f"{len(pending)} OOM(s) of ours not yet in the fleet's record (retried)")
    return "; ".join(parts)
