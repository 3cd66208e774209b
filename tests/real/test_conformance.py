"""The simulator held to the real server: the same night, the same config but for
``[server] command``, and the daemon must do the same things.

Compared: the state path, each crash's cause, phase and remedy, the failed-request counts
of the planned restart and stop, the daemon's exit code. Timings are not compared. The
comparison is written to ``conformance.json`` in the test's directory and printed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.real import nights


# Its budget holds the real night (the session's ``night`` fixture: five real launches, about
# 45 s each on this 2-core host) as well as the simulator's night.
@pytest.mark.timeout(900)
def test_the_simulator_does_what_the_real_server_does(night: nights.Night, real_sglang, tmp_path: Path,
                                                       no_leftovers) -> None:
    sim = nights.drive(nights.sim_config(tmp_path, real_sglang), ready_timeout=60.0)
    real_view, sim_view = night.conformance(), sim.conformance()
    diff = {k: {"real": real_view[k], "simulator": sim_view[k]} for k in real_view if real_view[k] != sim_view[k]}
    report = {"real": real_view, "simulator": sim_view, "diff": diff,
              "timings": {"real": night.timings, "simulator": sim.timings}}
    (tmp_path / "conformance.json").write_text(json.dumps(report, indent=1, default=str))
    print("\nconformance (real vs simulator):", json.dumps(diff or "no difference", default=str))
    assert diff == {}, json.dumps(diff, indent=1, default=str)
