"""What diagnoses leave in the heap is bounded (issue 36, item 1).

A daemon diagnoses every crash of a night from the committed catalogue, whose rows it reads
from the file when a line's words bring them up. Here 200 crashes, each a different real
log of the corpus (``tests/data/crashlogs``: so each brings up rows and patterns of its
own, the worst case for a cache), are diagnosed one after the other, the heap traced with
tracemalloc: what is left after each stays under a bound set by the two caches' sizes
(rows kept, regexes compiled). Then the same 200 once more: once the caches are let go,
that second night has left nothing at all (the first one leaves what is read once: the
module table, the interned strings' table grown to its size).
"""

from __future__ import annotations

import gc
import re
import tracemalloc

from diagnosis_corpus import entries

from supervisor.core.diagnosis import catalogue as cat

CRASHES = 200
# rows (about 800 B each with their strings) and compiled regexes (about 1 KB) at most
BOUND_MB = (cat.FileRows.KEEP * 800 + cat.COMPILED_KEPT * 1000) / 1e6 + 1.0


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
    assert kept <= cat.FileRows.KEEP and compiled <= cat.COMPILED_KEPT
    assert second <= 0.05  # all a diagnosis leaves is in the two bounded caches
