"""A real kernel OOM kill of a real SGLang scheduler, read as host_oom from the record the
kernel keeps in the service's memory cgroup (what the daemon can read under the hardened
unit, where the kernel log is out of reach).

The daemon runs inside a memory cgroup of the test's own (as systemd runs it inside the
service's). Once the server is READY, the scheduler is made the OOM killer's first choice
(``oom_score_adj`` 1000), the group's limit is set just above what it uses, and a process
inside allocates until the kernel acts. The daemon is told nothing: it compares the
cgroup's ``oom_kill`` count before the launch and after the death.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from supervisor.core.model import Cause
from tests.harness import DaemonRun
from tests.real import nights
from tests.real.memcg import CgroupUnavailable, MemoryCgroup


@pytest.fixture
def memcg() -> Iterator[MemoryCgroup]:
    try:
        group = MemoryCgroup.create()
    except CgroupUnavailable as exc:
        pytest.fail(f"a real OOM kill needs a writable memory cgroup (root): {exc}", pytrace=False)
    try:
        yield group
    finally:
        group.remove()


def test_a_real_oom_kill_of_the_scheduler_is_host_oom(real_sglang, tmp_path, memcg, no_leftovers) -> None:
    import fcntl

    cfg = nights.real_config(tmp_path, real_sglang, {"logging": {"memory_events": ""}}, name="oom")
    with open("/tmp/real-sglang.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with DaemonRun(cfg, wrapper=memcg.enter_argv()) as d:
            pid = int(d.wait_for("launch", attempt=1, timeout=60)["pid"])
            d.wait_for("server_ready", timeout=200)
            sched = nights.part(pid)
            ours = {p.pid for p in nights.tree(pid)}
            with open(f"/proc/{sched.pid}/oom_score_adj", "w") as f:
                f.write("1000")
            before = memcg.oom_kills()
            memcg.squeeze()
            hog = memcg.hog()
            try:
                down = d.wait_for("server_down", timeout=60)
            finally:
                hog.kill()
                hog.wait(10)
                memcg.release()
            assert memcg.oom_kills() > before  # the kernel's own record
            # Which death is seen first is the kernel's and SGLang's order, not the daemon's: the
            # killed scheduler's, the main process's (SGLang ends it when a child dies), or a
            # second victim's (the kernel may kill again while the first's memory is torn down:
            # a clean run saw the detokenizer's first). The promise is that the death is this
            # server's, and the cause and its remedy, whichever comes first.
            assert int(down["pid"]) in ours, (down, sorted(ours))
            crash = d.wait_for("crash", timeout=90)
            assert crash["cause"] == "host_oom", crash
            assert crash["remedy"] == str(Cause.HOST_OOM.remedy), crash
            assert any("oom_kill" in line for line in crash["evidence"]), crash
            d.wait_for("server_ready", count=2, timeout=200)
            assert d.stop() == 0
