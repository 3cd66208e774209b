"""The log flood child: ``python -I -S bench/flood.py N STAMPFILE MODE SETTLE_S [ANY...]``.

Prints SGLang's ready line, waits SETTLE_S seconds (a real server floods its log long
after its start, not while its supervisor is still busy launching it), then writes N
SGLang-like ``Decode batch`` lines as fast as it can,
1,000 lines per ``write(2)``, and appends the ``monotonic_ns`` of the first and the last
write to STAMPFILE: its wall time is how long its consumer (our daemon, supervisord,
``cat``, a file) kept it waiting. MODE ``format`` formats each chunk just before writing
it, as the simulator's ``--sim-flood`` (and a real server) does; ``raw`` formats all of
it before the clock starts, so the consumer is the only thing it waits for. It then
sleeps until killed, so that no supervisor restarts it mid-measurement. Extra arguments
(the SGLang flags a supervisor appends) are ignored.

The simulator's own ``--sim-flood`` runs after a simulated model load, whose ~1 s start
would blur a sub-second measurement; this child times only the flood.
"""

import itertools
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator

CHUNK = 1000


def lines(count: int) -> Iterator[str]:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for i in range(count):
        yield (f"[{stamp} TP0] Decode batch. #running-req: {i % 64}, #token: {i % 9000}, token usage: 0.01, "
               f"cuda graph: True, gen throughput (token/s): 1234.56, #queue-req: 0, \n")


def chunks(count: int) -> Iterator[bytes]:
    source = lines(count)
    while chunk := "".join(itertools.islice(source, CHUNK)):
        yield chunk.encode()


def write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def main(argv: list[str]) -> None:
    count, stamp_path, mode, settle_s = int(argv[0]), argv[1], argv[2], float(argv[3])
    write_all(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] The server is fired up and ready to roll!\n".encode())
    source: Iterable[bytes] = list(chunks(count)) if mode == "raw" else chunks(count)
    time.sleep(settle_s)
    start = time.monotonic_ns()
    for chunk in source:
        write_all(chunk)
    end = time.monotonic_ns()
    with open(stamp_path, "a") as f:
        f.write(f"{start}\n{end}\n")
    signal.pause()  # hold: the bench stops the supervisor (and so this child)


if __name__ == "__main__":
    main(sys.argv[1:])
