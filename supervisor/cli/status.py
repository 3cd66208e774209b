"""``sglang-supervisor status``: the state, fraction and crash history from the state
directory (works whether or not the daemon runs)."""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from supervisor.core.config import Config, select_server, unit_name
from supervisor.core.state import Learned


def status(cfg: Config, *, server: str | None = None, as_json: bool = False, out: IO[str] | None = None) -> int:
    """One server's status, or each one's in turn (several ``[[server]]``; JSON: by name)."""
    out = out or sys.stdout
    units = select_server(cfg, server)
    if not cfg.units:
        return _status(units[0], as_json=as_json, out=out)
    if as_json:
        from io import StringIO

        merged = {}
        for unit in units:
            buf = StringIO()
            _status(unit, as_json=True, out=buf)
            merged[unit_name(unit)] = json.loads(buf.getvalue())
        print(json.dumps({"servers": merged}, indent=1), file=out)
        return 0
    for i, unit in enumerate(units):
        if i:
            print(file=out)
        print(f"server:    {unit_name(unit)}  ({unit.state.dir})", file=out)
        _status(unit, as_json=False, out=out)
    return 0


def _status(cfg: Config, *, as_json: bool, out: IO[str]) -> int:
    from supervisor.adapters.store import StateStore

    store = StateStore(cfg.state.dir)
    data, warning = store.load(move_aside=False)
    running = store.locked_by_other()
    if data is None:
        if as_json:
            print(json.dumps({"running": running, "state": None, "warning": warning}), file=out)
        else:
            print(f"no state in {cfg.state.dir} (never run here?)" + (f" - {warning}" if warning else ""), file=out)
        return 0
    learned = data.get("learned", {})
    if as_json:
        print(json.dumps({"running": running, **data, "recommended": _recommended(cfg, learned)}, indent=1), file=out)
        return 0
    state = data.get("state", "?")
    print(f"instance:  {cfg.name}  (daemon {'running, pid ' + str(data.get('daemon_pid')) if running else 'not running'})", file=out)
    print(f"state:     {state}{'' if running else ' (last known)'}  {data.get('reason', '')}", file=out)
    def frac(value: object) -> str:
        return "SGLang's own choice" if value is None else str(value)

    print(
        f"fraction:  {frac(learned.get('fraction'))}  (configured {frac(learned.get('base_fraction'))}; "
        f"ran out of CUDA memory at: {', '.join(map(str, learned.get('oom_fractions', []))) or 'none'})",
        file=out,
    )
    print(f"hicache:   {learned.get('hicache_size_gb')} GB per rank   restarts: {learned.get('restarts', 0)}", file=out)
    capacity = _capacity_line(cfg, learned)
    if capacity:
        print(f"capacity:  {capacity}", file=out)
    fleet_line = _fleet_line(learned)
    if fleet_line:
        print(f"fleet:     {fleet_line}", file=out)
    history = learned.get("history", [])
    print(f"history:   {len(history)} crash(es) and step-down(s)", file=out)
    if history:
        rows = [("time", "cause", "phase", "exit", "fraction", "next", "location")]
        rows.extend(
            (
                h["wall_time"], h["cause"], h["phase"], h["exit"], "sglang" if h["fraction"] is None else f"{h['fraction']:g}",
                "-" if h["next_fraction"] is None else f"{h['next_fraction']:g}", h.get("location") or "-",
            )
            for h in history[-20:]
        )
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)), file=out)
    return 0


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
