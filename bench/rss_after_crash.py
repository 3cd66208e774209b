"""The daemon's RSS in a given install, serving and after 10 crashes diagnosed (issue 26,
item 3; issue 36, item 2: <= 40 MB). ``make bench`` measures this tree's production install
(``bench/bench_rss.py``, the ``rss`` section); this measures any other, for example a release:

    python3 -m venv /tmp/prodvenv && /tmp/prodvenv/bin/pip install .
    .venv/bin/python -m bench.rss_after_crash /tmp/prodvenv
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from .bench_rss import CRASHES, GOAL_MB, SETTLE_S, measure
from .common import Settings


def main(venv: str) -> int:
    work = Path(tempfile.mkdtemp(prefix="rss-"))
    try:
        serving, after, causes = measure(Settings(quick=False, repeats=1, work=work, tag=uuid.uuid4().hex),
                                         work, Path(venv), CRASHES, SETTLE_S)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"daemon RSS ({venv}): serving {serving:.1f} MB; serving again after {CRASHES} crashes diagnosed "
          f"{after:.1f} MB (causes: {', '.join(causes)}; goal <= {GOAL_MB:g} MB)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m bench.rss_after_crash VENV (an install: pip install .)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
