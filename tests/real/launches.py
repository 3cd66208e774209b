"""How many real SGLang servers the real tier launches (issue 36, item 6): the tier's cost is
its launches (each 10-40 s of a CPU server's start), so the count has a stated budget and a
test that fails past it (``test_launch_budget.py``, run last): the next scenario that adds
launches shows its cost, and shares a server instead or raises the budget on purpose.

A thread of the pytest process looks at the process table every ``POLL_S``: a process running
``sglang.launch_server`` and carrying this run's tag (``tests/leftovers.py``'s ``RUN_VAR``,
which every process the tests start inherits) is one launch, charged to the test running when
it was first seen. A real server lives for seconds before it can do anything, so none is
missed at this period; the scan costs a few milliseconds.
"""

from __future__ import annotations

import collections
import os
import threading

import psutil

from supervisor.adapters.procstart import started
from tests.leftovers import RUN_VAR

POLL_S = 0.25
# Launches of a whole real tier on this tree: measured (make test, the tier's summary line
# prints the count and the tests that launch most), plus a margin for the scenarios whose
# launch count depends on timing (a crash seen before or after READY) or on the seeded night's
# draw. 54-56 before the real night carried the router's faults and one group all of its
# faults (9 fewer); ~47 since.
BUDGET = 54


class LaunchCounter:
    def __init__(self) -> None:
        self.by_test: collections.Counter[str] = collections.Counter()
        self._seen: set[tuple[int, int]] = set()  # (pid, start since boot)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="launch-counter", daemon=True)

    @property
    def total(self) -> int:
        return sum(self.by_test.values())

    @property
    def run_id(self) -> str:
        """This run's tag (set by ``tests/leftovers.py``'s ``pytest_configure``; an xdist
        worker's is ``<run>.<worker>``, and its launches carry that)."""
        return os.environ.get(RUN_VAR, "")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.scan()  # what started since the last look

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self.scan()

    def scan(self) -> None:
        test = os.environ.get("PYTEST_CURRENT_TEST", "(between tests)").rsplit(" (", 1)[0]
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmdline = p.info["cmdline"] or []
                if "sglang.launch_server" not in cmdline:
                    continue
                key = (p.pid, started(p.pid))  # not create_time: a clock step would count it again
                if key in self._seen:
                    continue
                tag = p.environ().get(RUN_VAR, "")
            except (psutil.Error, OSError):
                continue
            run_id = self.run_id
            if run_id and (tag == run_id or tag.startswith(run_id + ".")):
                self._seen.add(key)
                self.by_test[test] += 1

    def summary(self, most: int = 5) -> str:
        top = ", ".join(f"{name.split('::')[-1]} {n}" for name, n in self.by_test.most_common(most) if n > 0)
        return f"real SGLang launches: {self.total} (budget {BUDGET}); most: {top or 'none'}"


COUNTER = LaunchCounter()
