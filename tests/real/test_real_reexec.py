"""Re-exec in place behind the real router (docs/upgrade.md): two real SGLang servers owned by
one daemon, the soak's clients through the router, the real mosquitto.

The daemon starts from a copy of this checkout whose version says ``+old``; the copy is then
upgraded to this checkout (what ``pip install -U`` does to a venv) and ``sglang-supervisor
reexec`` runs. The goals: 0 failed requests; 0 relaunches (the same server pids and launch
numbers); the same daemon pid; the new version running; then a scheduler SIGKILLed right
after the exec is noticed, diagnosed and relaunched as usual, still with 0 failed requests
(the router sends to the other server); 0 alerts lost; 0 processes left.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from tests.real import soak_real
from tests.real.sglang_env import RealSGLang

pytestmark = pytest.mark.timeout(1500)


def _tree(tmp: Path, version: str) -> Path:
    tree = tmp / "tree"
    shutil.copytree(soak_real.REPO / "supervisor", tree / "supervisor", ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)
    init = tree / "supervisor" / "__init__.py"
    text = init.read_text()
    old = next(line for line in text.splitlines() if line.startswith("__version__"))
    init.write_text(text.replace(old, f'__version__ = "{version}"'))
    return tree


def test_reexec_behind_the_real_router_under_load_relaunches_nothing_and_loses_nothing(
    tmp_path: Path, real_sglang: RealSGLang, real_lock: None,
) -> None:
    from supervisor import __version__

    night = soak_real.Night(real_sglang, tmp_path, 0, random.SystemRandom().randrange(1, 10**6))
    night.tree = _tree(tmp_path, f"{__version__}+old")
    try:
        night.setup()
        _tree(tmp_path, __version__)  # the upgrade: the installed code is this checkout's now
        reexec = night.inject("reexec")
        kill = night.inject("sigkill_scheduler")
        results = night.finish()
    except BaseException:
        night.abort()
        raise
    print(soak_real.table(results))
    assert reexec.error == "" and kill.error == "", (reexec.error, kill.error)
    assert (reexec.detail["from_version"], reexec.detail["version"]) == (f"{__version__}+old", __version__)
    assert sorted(reexec.detail["adopted"]) == sorted(soak_real.SERVERS)
    assert kill.detail.get("cause"), kill.detail  # the killed scheduler's death was diagnosed
    assert results["requests"]["ok"] > 0
    assert results["requests"]["failed"] == 0, results["requests"]
    assert [e["rc"] for e in results["daemon"]["exits"]] == [0]  # one daemon, one clean end
    assert results["alerts"]["lost"] == 0 and results["alerts"]["duplicates"] == 0, results["alerts"]
    assert results["leftovers"] == [], results["leftovers"]
