"""What diagnoses leave in the heap is bounded (issue 36, item 1).

A daemon diagnoses every crash of a night from the committed catalogue, whose rows it reads
from the file when a line's words bring them up. Here 200 crashes, each a different real
log of the corpus (``tests/data/crashlogs``: so each brings up rows and patterns of its
own, the worst case for a cache), are diagnosed one after the other, the heap traced with
tracemalloc: what is left after each stays under a bound set by the regexes compiled (a
bounded cache); the rows a diagnosis read are let go when it ends. Then the same 200 once
more: once the caches are let go, that second night has left nothing at all (the first one
leaves what is read once: the module table, the interned strings' table grown to its size).
"""

from __future__ import annotations

import gc
import re
import sys
import tracemalloc

from diagnosis_corpus import entries

from supervisor.core.diagnosis import catalogue as cat

CRASHES = 200
# compiled regexes (about 1 KB each) at most, and what is read once (the module table, ...)
BOUND_MB = cat.COMPILED_KEPT * 1000 / 1e6 + 2.5


def _let_go(rows: cat.FileRows) -> None:
    rows._kept.clear()
    cat.compile_pattern.cache_clear()
    re.purge()
    gc.collect()


def test_two_hundred_different_crashes_leave_a_bounded_heap() -> None:
    logs = [(e, e.path.read_bytes()) for e in entries()]
    assert len(logs) > CRASHES
    first, text = logs[0]
    first.diagnose(text)  # the catalogue's index loaded (the daemon loads it at the first launch)
    rows = cat.catalogue().entries
    assert isinstance(rows, cat.FileRows), "the committed catalogue is read through its index"
    night = logs[1:CRASHES + 1]
    _let_go(rows)  # a night from a fresh daemon's caches, whatever this worker's earlier tests left in them
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        left: list[float] = []
        for entry, data in night:
            entry.diagnose(data)
            left.append((tracemalloc.get_traced_memory()[0] - base) / 1e6)
        kept, compiled = len(rows._kept), cat.compile_pattern.cache_info().currsize
        _let_go(rows)
        once = tracemalloc.get_traced_memory()[0]
        for entry, data in night:
            entry.diagnose(data)
        _let_go(rows)
        second = (tracemalloc.get_traced_memory()[0] - once) / 1e6
    finally:
        tracemalloc.stop()
    print(f"heap left by diagnoses over {len(left)} crashes: max {max(left):.2f} MB, after the last "
          f"{left[-1]:.2f} MB (bound {BOUND_MB:.1f}; rows kept {kept}, regexes {compiled}); read once "
          f"{(once - base) / 1e6:.2f} MB; a second night of the same, caches let go: {second:.3f} MB")
    assert max(left) <= BOUND_MB
    assert kept == 0 and compiled <= cat.COMPILED_KEPT  # no row outlives its diagnosis
    assert second <= 0.05  # all a diagnosis leaves is in the two bounded caches


def test_a_read_log_holds_one_object_per_line() -> None:
    """A crash's tail is read as its lines (one string each), the lowered text and arrays of
    offsets, with no second list of lowered lines, no list of offsets nor timestamps as
    objects: the diagnosis's peak of small objects is what the allocator keeps resident
    after it (pymalloc frees an arena only once all of it is free). The real soak's daemon
    grew 2.6 MB over an incarnation's first two crashes, then stayed flat, while it held
    three objects per line of a 256 KiB tail (issue 36)."""
    from supervisor.core.diagnosis.log import _Log

    args = "server_args=ServerArgs(" + ", ".join(f"option_{i}={i}" for i in range(120)) + ")"  # > 600 chars: unmangled
    batch = "[2026-12-07 01:5{m}:{s:02d} TP0] Decode batch, #running-req: 2, #token: {t}, gen throughput (token/s): 9.1"
    lines = [args, "The server is fired up and ready to roll!"]
    lines += [batch.format(m=i // 600 % 10, s=i // 10 % 60, t=i) for i in range(2000)]
    text = "\n".join(lines)
    gc.collect()
    before = sys.getallocatedblocks()
    log = _Log(text)
    held = sys.getallocatedblocks() - before
    assert log.count == len(lines)
    assert log.low(5) == lines[5].lower() and log.text(5) == lines[5]
    print(f"a {len(text) // 1024} KiB log of {log.count} lines holds {held} heap blocks")
    assert held <= 1.05 * log.count + 100
