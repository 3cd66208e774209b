"""``python -m bench.bench_etcd [--seconds S] [--before TREE]``: etcd requests per minute per
node of a two-node group at rest, counted by etcd itself.

A two-node group on the simulator (``tests/test_group_e2e.py``'s setup) against a real etcd;
once both nodes are READY and a settle time has passed, the window's requests are etcd's own
``grpc_server_msg_received_total`` (every unary call and every message on a stream: lease
keep-alives, watch requests), summed over methods, before and after the window, divided by
the window and the two nodes. ``--before TREE`` measures another checkout of the package
(for example ``git worktree add /tmp/before <commit>``) in the same run, side by side,
alternating with this tree.

Writes ``bench/results-etcd.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the tests' harness imports its conftest

from harness import DaemonRun  # noqa: E402
from test_group_e2e import node_configs  # noqa: E402

from tests.etcdlib import EtcdServer  # noqa: E402

RESULTS = REPO / "bench" / "results-etcd.json"
METRIC = re.compile(r'^grpc_server_msg_received_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.MULTILINE)
READY_S = 90.0


def received(etcd: EtcdServer) -> Counter[str]:
    """etcd's count of received gRPC messages, per method."""
    with urllib.request.urlopen(f"http://127.0.0.1:{etcd.client_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    counts: Counter[str] = Counter()
    for m in METRIC.finditer(text):
        method = re.search(r'grpc_method="([^"]+)"', m["labels"])
        counts[method[1] if method else "?"] += int(float(m["value"]))
    return counts


def one(tmp: Path, tree: Path, seconds: float, settle_s: float) -> dict[str, Any]:
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    try:
        configs = node_configs(tmp, etcd)
        with DaemonRun(configs[0], tree=tree) as n0, DaemonRun(configs[1], tree=tree) as n1:
            for d in (n0, n1):
                d.wait_for("server_ready", READY_S)
            time.sleep(settle_s)
            start = received(etcd)
            time.sleep(seconds)
            end = received(etcd)
            for d in (n0, n1):
                d.stop()
        per_method = {k: round((end[k] - start[k]) * 60.0 / seconds / 2, 1) for k in sorted(end) if end[k] - start[k]}
        return {"tree": str(tree), "per_node_per_min": round(sum(per_method.values()), 1), "per_method": per_method}
    finally:
        etcd.stop()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_etcd", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="the window at rest (60)")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after READY before the window (10)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--before", type=Path, default=None, help="another checkout to measure side by side")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args()
    trees = [("before", args.before)] if args.before else []
    trees.append(("now", REPO))
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for label, tree in trees:
            with tempfile.TemporaryDirectory(prefix="sgl-etcd-") as tmp:
                row = {"label": label, "repeat": repeat, **one(Path(tmp), tree.resolve(), args.seconds, args.settle)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.results.write_text(json.dumps({"seconds": args.seconds, "rows": rows}, indent=2) + "\n")
    print("| tree | etcd requests per minute per node, at rest | by method |\n|---|---:|---|")
    for row in rows:
        methods = ", ".join(f"{k} {v:g}" for k, v in row["per_method"].items())
        print(f"| {row['label']} | {row['per_node_per_min']:g} | {methods} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
