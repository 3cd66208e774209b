"""The real night, compressed, for CI: ``tests/real/soak_real.py`` for 5 minutes
(``SOAK_MINUTES`` may say otherwise; ``SOAK_SEED`` picks the night, printed either way).

Two real SGLang servers owned by one daemon behind the real router, a real mosquitto, a
client at concurrency 2 through the router, a fault every 45-90 s. The goals: requests fail
only within the window of a hang (how many is reported), none for any other fault and none
outside a fault's window; every fault recovered; 0 alerts lost or duplicated (by id); 0
processes left; the foreign SGLang untouched; the daemon's RSS within 5 % (of its warm
sample, 10 s after its first READY).

Marked ``soak`` (``-m soak`` picks it alone); ``make test`` runs it in the real tier, and
``make soak-real`` runs the 30-minute night.

The night is the session's ``soak_night`` fixture (tests/real/conftest.py), which opens with
the router's two faults for ``test_real_router.py`` and holds the host-wide real-SGLang lock
for the whole night. A missing component (mosquitto, the router, SGLang) fails the test,
never skips. Every port is a free one (xdist-safe).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.real import soak_real
from tests.real.conftest import SOAK_TIMEOUT_S

pytestmark = pytest.mark.soak


@pytest.mark.timeout(SOAK_TIMEOUT_S)
def test_a_compressed_real_night_loses_no_request_outside_a_hang(tmp_path: Path, soak_night: dict[str, Any]) -> None:
    results = soak_night
    (tmp_path / "results.json").write_text(json.dumps(results, indent=1, default=str))
    out = os.environ.get("SOAK_RESULTS")
    if out:
        Path(out).write_text(json.dumps(results, indent=1, default=str))
    print(f"SOAK_SEED={results['seed']}")
    print(soak_real.table(results))

    faults = results["faults"]
    assert len([f for f in faults if f["kind"] != soak_real.FOREIGN]) >= 2, faults  # it was a night
    assert results["requests"]["ok"] > 0
    assert [f["kind"] for f in faults if f["error"]] == [], [(f["kind"], f["error"]) for f in faults if f["error"]]
    assert all(f["to_serving_s"] is not None for f in faults)
    # failures only in a hang's window; none for any other fault, none outside every window
    # (the router is the clients' only door: while it is away, killed and started again until the
    # daemon's next reconcile put the servers back, a request has nowhere to go; counted apart)
    assert {f["kind"]: f["failed"] - f["failed_router_away"] for f in faults
            if f["kind"] not in soak_real.MAY_FAIL and f["failed"] - f["failed_router_away"]} == {}, faults
    assert results["requests"]["unattributed"] == 0, results["requests"]
    alerts = results["alerts"]
    assert (alerts["lost"], alerts["duplicates"], alerts["unexpected"]) == (0, 0, 0), alerts
    if any(f["kind"] in soak_real.ALERTING for f in faults):  # a night without a crash may say nothing
        assert alerts["logged"] > 0 and alerts["received"] == alerts["logged"], alerts
    assert results["leftovers"] == []
    if results["foreign"]["started"]:
        assert results["foreign"]["untouched"], results["foreign"]
    # from the daemon's warm sample (10 s after its first READY loaded the diagnosis's tables, once)
    pct = results["daemon"]["rss_warm_change_pct"]
    assert pct is not None and abs(pct) <= 5.0, results["daemon"]
    assert results["report"]["rc"] == 0, results["report"]
    assert soak_real.goals_met(results) == []
