"""The real daemon against the real simulator: every failure mode, what the policy promises.

Each test checks, besides its own promise, that no process of ours survives it
(``no_leftovers``) and that there were never two servers at once (``servers``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import psutil
import pytest
from conftest import wait_until
from harness import REPO, DaemonRun, ServerCounter, simulator_mains, write_config

from supervisor.sim import simgpu
from supervisor.sim.loadgen import run_load

pytestmark = pytest.mark.integration


@pytest.fixture
def servers(no_leftovers):
    counter = ServerCounter()
    yield counter
    assert counter.close() <= 1, "two servers ran at the same time"


def _port(d: DaemonRun) -> int:
    return int(d.find("launch")[0]["argv"][d.find("launch")[0]["argv"].index("--port") + 1])


def test_runtime_oom_under_load_steps_down_to_088_and_load_completes(tmp_path, no_leftovers, servers):
    """A burst of real requests OOMs the server at 0.93; it comes back at 0.88 and serves it."""
    cfg = write_config(tmp_path)
    with DaemonRun(cfg) as d:
        d.wait_for("server_ready", mem_fraction_static=0.93)
        url = f"http://127.0.0.1:{_port(d)}"
        result = asyncio.run(run_load(url, short=60, long=16, deadline_s=90))
        crash = d.wait_for("crash")
        assert crash["cause"] == "cuda_oom_runtime"
        assert crash["phase"] == "serving"
        assert crash["location"] and "deepseek_v2.py" in crash["location"]
        assert crash["next_mem_fraction_static"] == 0.88
        d.wait_for("server_ready", mem_fraction_static=0.88)
        assert result.failed == 0 and result.completed == 76
        assert d.find("recovered", cause="cuda_oom_runtime")
        assert d.stop() == 0
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "status", "--config", str(cfg)],
        capture_output=True, text=True, cwd=REPO,
    )
    assert done.returncode == 3, done  # stopped (LSB "not running")
    assert "cuda_oom_runtime" in done.stdout and "0.88" in done.stdout


def test_exit_zero_is_a_crash_and_is_restarted(tmp_path, no_leftovers, servers):
    """An exit the daemon did not ask for is a crash even with code 0."""
    cfg = write_config(tmp_path, sim_args=("--sim-fail", "exit0", "--sim-fail-after-s", "0.3"))
    with DaemonRun(cfg) as d:
        crash = d.wait_for("crash")
        assert crash["exit_code"] == 0
        d.wait_for("launch", attempt=2)
        assert d.stop() == 0


def test_hang_is_killed_without_grace_and_restarted(tmp_path, no_leftovers, servers):
    """Failed probes while serving mean a hang: the group is killed and relaunched."""
    cfg = write_config(tmp_path, sim_args=("--sim-fail", "hang", "--sim-fail-after-s", "0.3"))
    with DaemonRun(cfg) as d:
        crash = d.wait_for("crash", timeout=40)
        assert crash["cause"] == "hang"
        assert crash["next_mem_fraction_static"] == 0.93  # a hang is no reason to move the fraction
        d.wait_for("launch", attempt=2)
        assert d.stop() == 0


def test_kv_pool_startup_error_moves_fraction_up(tmp_path, no_leftovers, servers):
    """0.5.23's 'Loaded weights leave no GPU memory for the KV cache ... Raise
    --mem-fraction-static above Y' at startup: up to the next rung above Y, past the rung in
    between that is still below it."""
    cfg = write_config(
        tmp_path,
        {"server": {"mem_fraction_static": 0.70},
         "policy": {"fraction_ladder": [0.93, 0.88, 0.85, 0.82, 0.80, 0.75, 0.70]}},
    )
    with DaemonRun(cfg) as d:
        crash = d.wait_for("crash")
        assert crash["cause"] == "kv_pool_too_small"
        assert crash["phase"] == "starting"
        assert 0.75 < crash["min_fraction"] < 0.80, crash  # the simulated weights need ~0.754
        assert crash["next_mem_fraction_static"] == 0.80
        d.wait_for("server_ready", mem_fraction_static=0.80)
        assert d.stop() == 0


def test_host_oom_halves_the_hierarchical_cache(tmp_path, no_leftovers, servers):
    """A scheduler SIGKILLed by the kernel OOM killer means host RAM: hicache goes down."""
    kern = tmp_path / "kern.log"
    kern.write_text("")
    cfg = write_config(
        tmp_path,
        {
            "server": {"hicache_size_gb": 2},
            "policy": {"hicache_min_gb": 1},
            "gpu": {"host_ram_margin_gb": 0.0},
            "logging": {"kernel_log": str(kern)},
        },
        sim_args=("--sim-version", "0.5.23", "--sim-fail", "host_oom", "--sim-fail-after-s", "0.3",
                  "--sim-kernel-log", str(kern)),
    )
    with DaemonRun(cfg) as d:
        crash = d.wait_for("crash")
        assert crash["cause"] == "host_oom"
        assert crash["next_hicache_size_gb"] == 1
        launch = d.wait_for("launch", attempt=2)
        assert "--hicache-size" in launch["argv"] and launch["argv"][launch["argv"].index("--hicache-size") + 1] == "1"
        assert d.stop() == 0


def test_model_load_error_gives_up_and_waits_for_a_human(tmp_path, no_leftovers, servers):
    """A model that cannot load is not retried: GAVE_UP, and the daemon stays up."""
    cfg = write_config(tmp_path, sim_args=("--sim-fail", "model_load"))
    with DaemonRun(cfg) as d:
        gave = d.wait_for("gave_up")
        assert gave["cause"] == "model_load_error"
        assert len(d.find("launch")) == 1
        assert d.proc.poll() is None
        assert d.stop() == 0


def test_startup_timeout_restarts(tmp_path, no_leftovers, servers):
    """A server that is not ready within startup_timeout_s is stopped and relaunched."""
    cfg = write_config(
        tmp_path, {"health": {"startup_timeout_s": 1.0}}, sim_args=("--sim-load-s", "30"),
    )
    with DaemonRun(cfg) as d:
        crash = d.wait_for("crash")
        assert crash["cause"] == "startup_timeout"
        d.wait_for("launch", attempt=2)
        assert d.stop() == 0


def test_sigterm_ignored_by_server_is_killed_after_grace(tmp_path, no_leftovers, servers):
    """SIGTERM to the daemon: SGLang gets SIGTERM, then SIGKILL after the grace; exit 0."""
    cfg = write_config(tmp_path, {"server": {"stop_grace_s": 1.0}}, sim_args=("--sim-fail", "ignore_sigterm"))
    with DaemonRun(cfg) as d:
        d.wait_for("server_ready")
        assert d.stop() == 0
        stopped = d.find("server_stopped")
        assert stopped and stopped[0]["signal"] == signal.SIGKILL


def test_orphan_holding_gpu_memory_is_killed_before_relaunch(tmp_path, no_leftovers, servers):
    """A scheduler that outlives its parent is killed, its memory frees, then the relaunch."""
    cfg = write_config(tmp_path, sim_args=("--sim-fail", "orphan", "--sim-fail-after-s", "0.3"))
    with DaemonRun(cfg) as d:
        d.wait_for("crash")
        d.wait_for("server_ready", count=2)
        assert d.stop() == 0


def test_memory_that_never_frees_gives_up_with_gpu_memory_stuck(tmp_path, no_leftovers, servers):
    """Memory still held after release_timeout_s: gpu_memory_stuck, give up, call a human."""
    cfg = write_config(
        tmp_path, {"gpu": {"release_timeout_s": 1.0}}, sim_args=("--sim-fail", "stuck", "--sim-fail-after-s", "0.3"),
    )
    try:
        with DaemonRun(cfg) as d:
            stuck = d.wait_for("gpu_memory_stuck", timeout=40)
            assert any(g["free_bytes"] < g["total_bytes"] * 0.9 for g in stuck["gpus"])
            assert d.wait_for("gave_up")["cause"] == "gpu_memory_stuck"
            assert len(d.find("launch")) == 1
            assert d.stop() == 0
    finally:
        simgpu.reset(tmp_path / "gpus")


def test_daemon_killed_then_restarted_stops_the_old_server_first(tmp_path, no_leftovers, servers):
    """SIGKILL the daemon: its server lives on; the next daemon stops it before launching."""
    cfg = write_config(tmp_path)
    first = DaemonRun(cfg)
    try:
        first.wait_for("server_ready")
        old = simulator_mains()
        assert len(old) == 1
        first.kill()
        assert simulator_mains() == old  # the server survived its supervisor
        with DaemonRun(cfg) as second:
            second.wait_for("server_ready")
            killed = second.find("orphans_killed")
            assert killed and old[0] in killed[0]["pids"]
            assert not psutil.pid_exists(old[0]) or psutil.Process(old[0]).status() == psutil.STATUS_ZOMBIE
            assert second.stop() == 0
    finally:
        first.kill()


def test_second_daemon_on_the_same_state_dir_is_refused(tmp_path, no_leftovers, servers):
    """Two daemons on one state directory would mean two servers on the same GPUs."""
    cfg = write_config(tmp_path)
    with DaemonRun(cfg) as first:
        first.wait_for("server_ready")
        second = DaemonRun(cfg)
        assert second.proc.wait(20) == 1
        second.kill()
        assert "another sglang-supervisor" in second.log_path.read_text()
        assert first.stop() == 0


def test_sigterm_stops_server_and_exits_zero_with_no_leftovers(tmp_path, no_leftovers, servers):
    """systemctl stop: SGLang drains and exits, the daemon exits 0, nothing is left."""
    cfg = write_config(tmp_path)
    with DaemonRun(cfg) as d:
        d.wait_for("server_ready")
        pid = d.find("launch")[0]["pid"]
        assert d.stop() == 0
        wait_until(lambda: not psutil.pid_exists(pid), what="server gone")
        assert d.states()[-1] == "STOPPED"


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    """A bad value: one line naming key, value and rule; exit 2; no traceback."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nmodel_path = "m"\nport = 70000\n')
    bad.chmod(0o644)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "--config", str(bad)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "port" in r.stderr and "70000" in r.stderr
    assert "Traceback" not in r.stderr


def test_world_writable_config_is_refused(tmp_path):
    """The config sets a command line run as the service user: others must not write it."""
    cfg = write_config(tmp_path)
    os.chmod(cfg, 0o666)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "check-config", "--config", str(cfg)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "writable by group or others" in r.stderr


@pytest.mark.parametrize(("text", "files"), [
    ("0::/system.slice/sglang-supervisor@kimi.service\n",  # cgroup v2
     ["/sys/fs/cgroup/system.slice/sglang-supervisor@kimi.service/memory.events",
      "/sys/fs/cgroup/unified/system.slice/sglang-supervisor@kimi.service/memory.events"]),
    ("12:memory:/system.slice/x.service\n11:cpu,cpuacct:/system.slice/x.service\n0::/system.slice/x.service\n",  # hybrid
     ["/sys/fs/cgroup/memory/system.slice/x.service/memory.oom_control",
      "/sys/fs/cgroup/system.slice/x.service/memory.events",
      "/sys/fs/cgroup/unified/system.slice/x.service/memory.events"]),
    ("4:memory:/\n", ["/sys/fs/cgroup/memory/memory.oom_control"]),  # v1, root
    ("garbage\n", []),
])
def test_oom_kill_files_for_v1_v2_and_hybrid_hosts(text, files):
    """Where the OOM killer's count of the daemon's own cgroup lives, whatever the hierarchy."""
    from supervisor.adapters.cgroup import oom_kill_files

    assert oom_kill_files(text) == files


def test_cgroup_oom_kills_reads_both_formats(tmp_path):
    """v2's memory.events and v1's memory.oom_control both say ``oom_kill N``; unreadable is None."""
    from supervisor.adapters.cgroup import cgroup_oom_kills

    v2 = tmp_path / "memory.events"
    v2.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n")
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert (cgroup_oom_kills(str(v2)), cgroup_oom_kills(str(v1))) == (2, 5)
    assert cgroup_oom_kills(str(tmp_path / "missing")) is None
