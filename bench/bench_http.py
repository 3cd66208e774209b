"""The daemon's HTTP client, side by side: aiohttp (what it used until issue 36) against h11 over
asyncio streams (``supervisor/adapters/http.py``), on the daemon's own uses and faults.

    .venv/bin/python -m bench.bench_http [--n 2000] [--out bench/results-http.json]

One fake server (a child process, asyncio) answers what the daemon asks: ``/health`` (SGLang's
200), ``/metrics`` (an SGLang-sized page, 40 KB), ``/workers`` (the router's list). Each
client runs in a process of its own, so that its RSS is its own: the RSS after its imports,
then N probes one after the other, N/10 metrics reads and N/10 worker lists (its CPU per
exchange and its latency), then the RSS again. Then each fault of the chaos matrix once, with
a 1 s deadline: refused, reset, hung, a trickled head, an endless head, a huge 200, a huge
503, an answer cut short, garbage: each must be the outcome ``HEALTHY`` says, within its
deadline (exit 1 when the daemon's client gets one wrong).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 1.0
METRICS = b"".join(
    b'sglang:%s{model_name="m",tp_rank="%d"} %d.0\n' % (name, rank, rank)
    for name in (b"token_usage", b"num_queue_reqs", b"gen_throughput", b"cache_hit_rate", b"num_running_reqs")
    for rank in range(8)
) * 100
WORKERS = json.dumps({"workers": [{"id": f"w{i}", "url": f"http://10.0.0.{i}:30000", "is_healthy": True, "load": i}
                                  for i in range(8)], "total": 8}).encode()
FAULTS = ("refused", "reset", "hung", "trickled_head", "endless_head", "huge_200", "huge_503", "cut_short", "garbage")
# The outcome each fault must give: only a 200 is healthy, and its body is not read whole; an
# answer cut short of its Content-Length is a broken exchange (aiohttp's client returns the
# bytes it has and calls it a 200: the one difference, h11's is the stricter reading).
HEALTHY = {"huge_200": True}


# --- the fake server (a child) ---------------------------------------------------------------------


async def _serve(port_file: str) -> None:
    def answer(status: bytes, body: bytes, ctype: bytes = b"text/plain") -> bytes:
        return b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status, ctype, len(body)) + body

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            if path == b"/health":
                writer.write(answer(b"200 OK", b""))
            elif path == b"/metrics":
                writer.write(answer(b"200 OK", METRICS))
            elif path == b"/workers":
                writer.write(answer(b"200 OK", WORKERS, b"application/json"))
            elif path == b"/reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            elif path == b"/hung":
                await asyncio.sleep(3600)
            elif path == b"/trickled_head":
                for byte in b"HTTP/1.1 200 OK\r\n" * 100:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.05)
            elif path == b"/endless_head":
                writer.write(b"HTTP/1.1 200 OK\r\n")
                while True:
                    writer.write(b"X-Again: yes\r\n" * 1000)
                    await writer.drain()
            elif path in (b"/huge_200", b"/huge_503"):
                status = b"200 OK" if path == b"/huge_200" else b"503 Service Unavailable"
                writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n" % (status, 50 << 20))
                while True:
                    writer.write(b"z" * 65536)
                    await writer.drain()
            elif path == b"/cut_short":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
            else:
                writer.write(b"\x00\xffnot http at all\r\n\r\n")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    await asyncio.Event().wait()


# --- the two clients (each in a process of its own) ----------------------------------------------


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _client(kind: str, port: int, n: int) -> dict[str, Any]:
    base = f"http://127.0.0.1:{port}"
    start_rss = _rss_mb()
    if kind == "aiohttp":
        import aiohttp

        session: list[aiohttp.ClientSession] = []

        async def get(url: str, max_body: int) -> tuple[int, bytes]:
            if not session:  # what adapters/http.py's FreshSession was: no keep-alive, bounded head
                session.append(aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(force_close=True, limit=4),
                    timeout=aiohttp.ClientTimeout(total=DEADLINE_S), max_line_size=8190, max_field_size=8190))
            async with asyncio.timeout(DEADLINE_S):
                async with session[0].get(url, allow_redirects=False) as resp:
                    return resp.status, await resp.content.read(max_body)

        errors: tuple[type[BaseException], ...] = (TimeoutError, aiohttp.ClientError, OSError, ValueError)
    else:
        from supervisor.adapters import http

        async def get(url: str, max_body: int) -> tuple[int, bytes]:
            resp = await http.request(http.parse_url(url), timeout_s=DEADLINE_S, max_body=max_body)
            return resp.status, resp.body

        errors = (TimeoutError, http.HttpError)
    imported_rss = _rss_mb()

    async def main() -> dict[str, Any]:
        lat: dict[str, list[float]] = {"health": [], "metrics": [], "workers": []}
        cpu0 = time.process_time()
        for i in range(n):
            for what, every in (("health", 1), ("metrics", 10), ("workers", 10)):
                if i % every:
                    continue
                t = time.perf_counter()
                status, body = await get(f"{base}/{what}", 4 << 20)
                lat[what].append(time.perf_counter() - t)
                assert status == 200 and (body or what == "health"), (what, status)
        cpu = time.process_time() - cpu0
        exchanges = sum(len(v) for v in lat.values())
        served_rss = _rss_mb()
        faults: dict[str, dict[str, Any]] = {}
        for fault in FAULTS:
            url = f"http://127.0.0.1:{_free_port()}/" if fault == "refused" else f"{base}/{fault}"
            t = time.perf_counter()
            try:
                status, _ = await get(url, 64 * 1024)
                outcome = f"HTTP {status}"
                healthy = status == 200
            except errors as exc:
                outcome, healthy = type(exc).__name__, False
            faults[fault] = {"healthy": healthy, "outcome": outcome, "s": round(time.perf_counter() - t, 3)}
        if kind == "aiohttp" and session:
            await session[0].close()
        return {
            "client": kind, "n": n, "rss_start_mb": round(start_rss, 1), "rss_imported_mb": round(imported_rss, 1),
            "rss_served_mb": round(served_rss, 1), "rss_after_faults_mb": round(_rss_mb(), 1),
            "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "cpu_ms_per_exchange": round(1000 * cpu / exchanges, 3),
            "latency_ms": {k: {"p50": round(1000 * statistics.median(v), 3),
                               "p99": round(1000 * sorted(v)[int(0.99 * (len(v) - 1))], 3)} for k, v in lat.items()},
            "faults": faults,
        }

    return asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the run ---------------------------------------------------------------------------------------


def run(n: int, repeats: int) -> dict[str, Any]:
    port_file = Path(f"/tmp/bench-http-{os.getpid()}.port")
    server = subprocess.Popen([sys.executable, "-m", "bench.bench_http", "--serve", str(port_file)], cwd=REPO)
    try:
        for _ in range(100):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        port = int(port_file.read_text())
        runs: dict[str, list[dict[str, Any]]] = {"aiohttp": [], "h11": []}
        for _ in range(repeats):  # alternating, so that both see the same machine
            for kind in runs:
                out = subprocess.run([sys.executable, "-m", "bench.bench_http", "--client", kind, "--port", str(port),
                                      "--n", str(n)], cwd=REPO, capture_output=True, text=True, timeout=600)
                if out.returncode:
                    raise SystemExit(f"bench_http: the {kind} client failed: {out.stderr.strip()[-500:]}")
                runs[kind].append(json.loads(out.stdout))
    finally:
        server.kill()
        server.wait()
        port_file.unlink(missing_ok=True)
    return summarize(runs)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def med(kind: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[kind]), 3)

    rows = {key: {kind: med(kind, key) for kind in runs}
            for key in ("rss_imported_mb", "rss_served_mb", "rss_after_faults_mb", "cpu_ms_per_exchange")}
    for what in ("health", "metrics", "workers"):
        for p in ("p50", "p99"):
            rows[f"{what}_{p}_ms"] = {kind: round(statistics.median(r["latency_ms"][what][p] for r in runs[kind]), 3)
                                      for kind in runs}
    wrong = {kind: sorted({f for r in runs[kind] for f in FAULTS
                           if r["faults"][f]["healthy"] != HEALTHY.get(f, False) or r["faults"][f]["s"] > DEADLINE_S + 0.5})
             for kind in runs}
    return {"command": "python -m bench.bench_http", "n": runs["h11"][0]["n"], "repeats": len(runs["h11"]),
            "rows": rows, "faults_answered_wrong": wrong,
            "faults": {kind: runs[kind][-1]["faults"] for kind in runs}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="probes per client (default 2000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    if args.client:
        print(json.dumps(_client(args.client, args.port, args.n)))
        return 0
    results = run(args.n, args.repeats)
    print(f"{'':24} {'aiohttp':>10} {'h11':>10}")
    for key, row in results["rows"].items():
        print(f"{key:24} {row['aiohttp']:>10} {row['h11']:>10}")
    print("faults:", ", ".join(f"{f}: {results['faults']['aiohttp'][f]['outcome']} / {results['faults']['h11'][f]['outcome']}"
                               for f in FAULTS))
    for kind, wrong in results["faults_answered_wrong"].items():
        print(f"{kind}: faults answered wrong or past the deadline: {', '.join(wrong) or 'none'}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if results["faults_answered_wrong"]["h11"] else 0


if __name__ == "__main__":
    sys.exit(main())
