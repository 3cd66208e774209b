"""``python -m bench.bench_router``: failed client requests behind SGLang's router, the
router alone beside the router kept true by the daemon, side by side.

The night (``tests/router_night.py``): two simulated SGLang 0.5.23 servers behind the real
``sglang-router`` 0.3.2, both owned by one daemon (two ``[[server]]`` entries), clients
sending ``/generate`` through the router at concurrency 1 and 4; a scheduler of one server
is SIGKILLed (its main process sleeps 5 s before it kills its tree, as SGLang's does with
its diagnostics on), then one ``sglang-supervisor restart`` rolls through both servers. "router alone": the servers given to the router with
``--worker-urls`` at its defaults (60 s health checks, 5 retries, a circuit breaker);
"router + daemon": ``[router] enabled``.

``--real``: the same night on two real SGLang 0.5.23 servers on the CPU (``make
real-sglang``; ~7 GB and both cores, the real-SGLang lock held throughout).

Writes ``bench/results-router.json`` (``--real``: ``results-router-real.json``) and prints a
Markdown table (the README's router rows).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import fcntl
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the tests' harness imports its conftest

import router_night  # noqa: E402

from tests.routerlib import routers  # noqa: E402

RESULTS = REPO / "bench" / "results-router.json"
LOCK = "/tmp/real-sglang.lock"  # one real-SGLang user of the host at a time


def real_configs(tmp: Path) -> list[Path]:
    """Two real servers ``a`` and ``b``, SGLang's crash diagnostics on (as the real night's)."""
    from tests.real import nights
    from tests.real.sglang_env import load
    from tests.real.soak_real import DIAGNOSTICS_ON

    real, configs = load(), []
    for name in ("a", "b"):
        (tmp / name).mkdir()
        configs.append(nights.real_config(tmp / name, real, {"server": {"stop_grace_s": 30.0}, "health": {"failures": 3}},
                                          env=DIAGNOSTICS_ON, name=name))
    return configs


async def one(tmp: Path, concurrency: int, integrated: bool, real: bool = False) -> dict[str, Any]:
    with routers(tmp) as start:
        if not real:
            return await router_night.night(tmp, start, concurrency, integrated)
        return await router_night.night(tmp, start, concurrency, integrated, configs=real_configs(tmp), ready_s=240.0, gpus=())


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | concurrency | scheduler killed: failed / ok | rolling restart: failed / ok "
        "| death → out of the router | death → SGLang's main exits |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        crash, restart = r["crash"], r["restart"]
        removed = f"{crash['removed_s'] * 1000:.0f} ms" if crash.get("removed_s") is not None else "never (router alone)"
        main_exit = f"{crash['main_exit_s']:.2f} s" if crash.get("main_exit_s") is not None else "?"
        lines.append(
            f"| {'router + daemon' if r['integrated'] else 'router alone'} | {r['concurrency']} "
            f"| **{crash['failed']}** / {crash['ok']} | **{restart['failed']}** / {restart['ok']} | {removed} | {main_exit} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_router", description=__doc__.splitlines()[0])
    p.add_argument("--real", action="store_true", help="two real SGLang servers (make real-sglang)")
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args(argv)
    results = args.results or (REPO / "bench" / "results-router-real.json" if args.real else RESULTS)
    rows = []
    for integrated in (False, True):
        for concurrency in (1, 4):
            with tempfile.TemporaryDirectory(prefix="sgl-bench-router-") as tmp:
                if args.real:
                    with open(LOCK, "a") as lock:
                        fcntl.flock(lock, fcntl.LOCK_EX)
                        row = asyncio.run(one(Path(tmp), concurrency, integrated, real=True))
                else:
                    row = asyncio.run(one(Path(tmp), concurrency, integrated))
            print(json.dumps(row), flush=True)
            rows.append(row)
    results.write_text(json.dumps({
        "when": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.bench_router" + (" --real" if args.real else ""),
        "rows": rows,
    }, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
