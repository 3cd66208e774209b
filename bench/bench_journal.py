"""journald transports side by side (issue 33, item 5): what each costs the daemon.

``python -m bench.bench_journal [--python PY] [--lines N] [--repeats R]`` (root: it runs the
per-line part in a private mount namespace, ``unshare --mount``, with a tmpfs on /run and a
fake journald bound at /run/systemd/journal/socket, because libsystemd's sd_journal_send,
which both libraries call, has that path built in). ``--python`` is an interpreter that
has the libraries to compare (``systemd-python``, ``cysystemd``) besides structlog; a
transport it lacks is reported as absent. The transports:

- ``stderr-json``: today's JSON line on stderr (journald's stream socket: priority 6 for all),
- ``stderr-prefix``: the same line with ``<N>`` in front (``SyslogLevelPrefix=``: the priority,
  no fields),
- ``native``: ``supervisor.adapters.journald`` (stdlib socket, the native protocol),
- ``systemd-python``: ``systemd.journal.send`` (the C extension over libsystemd),
- ``cysystemd``: ``cysystemd.journal.send`` (Cython over libsystemd).

Per line: the daemon's structlog chain (``supervisor.sinks.logs``) rendering one crash-like
event and handing it to the transport, through a drainer in another process (journald's
end: a datagram socket and a stream socket). Import: the transport's modules in a fresh
interpreter (median of ``--repeats``), with the RSS they add. Results:
bench/results-journal.json and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRANSPORTS = ("stderr-json", "stderr-prefix", "native", "systemd-python", "cysystemd")
IMPORTS = {
    "stderr-json": "import supervisor.sinks.logs",
    "stderr-prefix": "import supervisor.sinks.logs",
    "native": "import supervisor.sinks.logs, supervisor.adapters.journald",
    "systemd-python": "import supervisor.sinks.logs, systemd.journal",
    "cysystemd": "import supervisor.sinks.logs, cysystemd.journal",
}
SOCKET = "/run/systemd/journal/socket"
# The host's net.unix.max_dgram_qlen may be 10 (systemd raises it to 512 at boot): lines go in
# batches a 10-datagram queue holds, with an untimed pause for the drainer, so what is timed is
# the sender's own cost, not waiting for a consumer (the libraries block; ours falls back).
BATCH = 8
PAUSE_S = 0.004
STREAM = "/run/systemd/journal/stdout"

_IMPORT_CODE = """
import time, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1])
import structlog  # the daemon's logging library: loaded in every case
r0 = rss(); t0 = time.perf_counter()
try:
    exec(sys.argv[1])
except ImportError:
    print('absent'); raise SystemExit
print(time.perf_counter() - t0, rss() - r0)
"""

_DRAIN_CODE = """
import os, selectors, socket, sys
sel = selectors.DefaultSelector()
d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); d.bind(sys.argv[1])
d.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind(sys.argv[2]); s.listen()
sel.register(d, selectors.EVENT_READ); sel.register(s, selectors.EVENT_READ)
print('ready', flush=True)
count = 0
while True:
    for key, _ in sel.select():
        if key.fileobj is d:
            data = d.recv(1 << 20)
            if data == b'STOP=1\\n':
                print(count, flush=True); raise SystemExit
            count += 1
        elif key.fileobj is s:
            c, _ = s.accept(); sel.register(c, selectors.EVENT_READ)
        else:
            data = key.fileobj.recv(1 << 20)
            count += data.count(b'\\n')
            if not data:
                sel.unregister(key.fileobj)
"""

_LINE_CODE = """
import io, socket, sys, time
sys.path.insert(0, sys.argv[3])
from supervisor.sinks import logs
transport, n = sys.argv[1], int(sys.argv[2])
stream_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); stream_sock.connect('@STREAM@')
stream = stream_sock.makefile('w', buffering=1)

class Lib:
    def __init__(self, send): self._send = send
    def send(self, fields):
        self._send(**fields); return True

journal = None
if transport == 'native':
    from supervisor.adapters.journald import JournalSocket
    journal = JournalSocket()
elif transport == 'systemd-python':
    from systemd import journal as sj
    journal = Lib(sj.send)
elif transport == 'cysystemd':
    from cysystemd import journal as cj
    journal = Lib(lambda **f: cj.send(**f))
log = logs.configure('json', 'info', stream, journal=journal, server='kimi')
if transport == 'stderr-prefix':
    log = logs.configure('json', 'info', stream, journal=type('NoSocket', (), {'send': lambda self, f: False})(),
                         server='kimi')
BATCH, PAUSE_S = @BATCH@, @PAUSE@
def timed(one):
    # seconds spent in one() over n calls, in batches the drainer's queue holds (the
    # pauses between them, for the drainer to catch up, are not counted)
    spent = 0.0
    for start in range(0, n, BATCH):
        t0 = time.perf_counter()
        for i in range(start, min(n, start + BATCH)):
            one(i)
        stream.flush()
        spent += time.perf_counter() - t0
        time.sleep(PAUSE_S)
    return spent
n_measured = n
n = 200
timed(lambda i: log.error('crash', cause='cuda_oom_runtime', mem_fraction_static=0.93, n=i))  # warm-up
n = n_measured
took = timed(lambda i: log.error('crash', cause='cuda_oom_runtime', mem_fraction_static=0.93, n=i))
# the transport alone: one prepared entry (a real journal() of the chain above), sent n times
fields = logs.journal_fields({'event': 'crash', 'level': 'error', 'cause': 'cuda_oom_runtime'}, '{"event": "crash", '
                             '"cause": "cuda_oom_runtime", "mem_fraction_static": 0.93, "level": "error"}', server='kimi')
line = fields['MESSAGE'] + '\\n'
if transport == 'stderr-json':
    send = lambda i: stream.write(line)
elif transport == 'stderr-prefix':
    send = lambda i: stream.write('<3>' + line)
else:
    send = lambda i: journal.send(fields) or stream.write('<3>' + line)  # what JournalLogger does
raw = timed(send)
print(took / n * 1e6, raw / n * 1e6)
""".replace("@STREAM@", STREAM).replace("@BATCH@", str(BATCH)).replace("@PAUSE@", str(PAUSE_S))


def measure_import(python: str, transport: str, repeats: int) -> dict[str, float] | None:
    times, rss = [], []
    for _ in range(repeats):
        out = subprocess.run([python, "-c", _IMPORT_CODE, IMPORTS[transport]], capture_output=True, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, check=True).stdout.split()
        if out == ["absent"]:
            return None
        times.append(float(out[0]) * 1000)
        rss.append(float(out[1]))
    return {"import_ms": statistics.median(times), "import_rss_kb": statistics.median(rss)}


def inner(python: str, lines: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """In the private namespace: each transport's per-line cost, ``repeats`` times, in turns."""
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run"], check=True)
    os.makedirs("/run/systemd/journal")
    out: dict[str, list[tuple[float, float]]] = {t: [] for t in TRANSPORTS}
    for _ in range(repeats):
        for transport in TRANSPORTS:
            for path in (SOCKET, STREAM):
                if os.path.exists(path):
                    os.unlink(path)
            drain = subprocess.Popen([python, "-c", _DRAIN_CODE, SOCKET, STREAM], stdout=subprocess.PIPE, text=True)
            try:
                assert drain.stdout is not None and drain.stdout.readline().strip() == "ready"
                r = subprocess.run([python, "-c", _LINE_CODE, transport, str(lines), str(REPO)], capture_output=True,
                                   text=True, timeout=300)
                if r.returncode != 0:
                    print(f"{transport}: {r.stderr[-600:]}", file=sys.stderr)
                    continue
                us, raw_us = (float(x) for x in r.stdout.split()[-2:])
                import socket

                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    s.sendto(b"STOP=1\n", SOCKET)
                received = int(drain.stdout.readline())
                if received < 2 * lines + 200:  # a transport that lost lines does not get a time
                    print(f"{transport}: only {received} of {2 * lines + 200} lines arrived", file=sys.stderr)
                    continue
                out[transport].append((us, raw_us))
            finally:
                drain.kill()
                drain.wait()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--lines", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(REPO / "bench" / "results-journal.json"))
    a = p.parse_args()
    if a.inner:
        print(json.dumps(inner(a.python, a.lines, a.repeats)))
        return 0
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-m", "bench.bench_journal",
                        "--inner", "--python", a.python, "--lines", str(a.lines), "--repeats", str(a.repeats)],
                       capture_output=True, text=True, cwd=REPO, timeout=1800, check=True)
    sys.stderr.write(r.stderr)
    per_line = json.loads(r.stdout.splitlines()[-1])
    rows = {}
    for transport in TRANSPORTS:
        imp = measure_import(a.python, transport, a.repeats * 3)
        us = per_line.get(transport) or []
        rows[transport] = None if imp is None or not us else {
            **imp, "per_line_us": statistics.median(u for u, _ in us), "per_send_us": statistics.median(r for _, r in us),
            "runs": us}
    base = rows["stderr-json"]
    print(f"{'transport':16s} {'import ms':>10s} {'+RSS KiB':>8s} {'µs/line':>8s} {'×':>6s} {'µs/send':>8s} {'×':>6s}"
          "   (line: the structlog chain + transport; send: the transport alone; ×: against stderr-json)")
    for transport, row in rows.items():
        if row is None:
            print(f"{transport:16s} {'absent':>10s}")
            continue
        line_ratio = row["per_line_us"] / base["per_line_us"] if base else float("nan")
        send_ratio = row["per_send_us"] / base["per_send_us"] if base else float("nan")
        print(f"{transport:16s} {row['import_ms']:10.1f} {row['import_rss_kb']:8.0f} {row['per_line_us']:8.1f} "
              f"{line_ratio:6.2f} {row['per_send_us']:8.2f} {send_ratio:6.2f}")
    Path(a.out).write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "python": a.python, "lines": a.lines, "repeats": a.repeats, "rows": rows},
                                      indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
