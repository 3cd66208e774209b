"""Fleet memory end to end (issue 16, items 2 and 3): real daemons, the real simulator and
a real etcd (``tests/etcdlib.py``; a missing ``etcd`` fails, never skips).

Daemon A on configuration X runs out of CUDA memory at 0.93 (one long prefill, as the load
generator sends it) and learns 0.88: the record in etcd says 0.88, with where and when.
Daemon B, started later on X with a fresh state directory, launches at 0.88 at once and says
so (``fleet_applied``, ``status``). The same configuration on another GPU, or with another
SGLang version, is another record: it starts at 0.93.

The SGLang version is read from the package metadata of the server command's own Python,
as on a real host; here each "install" is a directory with an ``sglang-V.dist-info`` on the
server's PYTHONPATH ([server] env), the simulator told to be that version too.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from conftest import wait_until
from harness import REPO, DaemonRun, write_config

from supervisor.sim import simgpu
from supervisor.sim.loadgen import run_load
from tests.etcdlib import EtcdServer, etcd_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration


def fake_sglang(root: Path, version: str) -> Path:
    """A site directory where ``importlib.metadata.version('sglang')`` says ``version``."""
    site = root / f"site-{version}"
    info = site / f"sglang-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return site


def fleet_config(tmp: Path, etcd: EtcdServer | str, prefix: str, *, version: str = "0.5.23",
                 gpu_gb: float = 96, name: str = "x") -> Path:
    """Configuration X (or X on another GPU / SGLang version) in its own directory, with
    its own state and simulated GPUs, [fleet] on."""
    tmp.mkdir(parents=True, exist_ok=True)
    simgpu.ensure_gpus(tmp / "gpus", 8, gpu_gb)  # before write_config: it keeps an existing gpus.json
    endpoint = etcd if isinstance(etcd, str) else etcd.endpoint
    path = write_config(tmp, {"etcd": {"endpoints": [endpoint], "timeout_s": 2.0},
                              "fleet": {"enabled": True, "prefix": prefix}},
                        sim_args=("--sim-version", version, "--sim-gpu-total-gb", f"{gpu_gb:g}"), name=name)
    doc = tomllib.loads(path.read_text())
    site = fake_sglang(tmp.parent, version)
    doc["server"]["env"]["PYTHONPATH"] = f"{site}:{REPO}"
    path.write_text(tomli_w.dumps(doc))
    return path


def first_launch(d: DaemonRun) -> dict[str, Any]:
    return d.wait_for("launch", timeout=60)


def fraction_of(launch: dict[str, Any]) -> str:
    argv = launch["argv"]
    return argv[argv.index("--mem-fraction-static") + 1]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)


def records(config: Path) -> list[dict[str, Any]]:
    r = cli("fleet", "list", "--config", str(config), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["records"]


def oom_once(d: DaemonRun) -> None:
    """One 4000-token prefill: ~1 GB of activations, more than 0.93 leaves, less than 0.88."""
    d.wait_for("server_ready", mem_fraction_static=0.93, timeout=60)
    argv = d.find("launch")[0]["argv"]
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    result = asyncio.run(run_load(url, short=0, long=1, deadline_s=60))
    assert result.completed == 1, result


def test_a_fleet_learns_once_and_every_daemon_of_that_configuration_starts_there(tmp_path, etcd_server, no_leftovers):  # noqa: F811
    """A's OOM at 0.93 puts 0.88 in etcd; B on the same X starts at 0.88; another GPU or
    SGLang version does not share it."""
    prefix = "/test-fleet"
    a_cfg = fleet_config(tmp_path / "a", etcd_server, prefix, name="x")
    with DaemonRun(a_cfg) as a:
        oom_once(a)
        crash = a.wait_for("crash")
        assert crash["cause"] == "cuda_oom_runtime" and crash["next_mem_fraction_static"] == 0.88
        updated = a.wait_for("fleet_updated", timeout=30)
        a.wait_for("server_ready", mem_fraction_static=0.88)
        assert not a.find("fleet_applied")  # nothing known before its own OOM
        assert a.stop() == 0
    (record,) = records(a_cfg)
    key = record["key"]
    assert key == updated["key"] and key.startswith(prefix + "/moonshotai_Kimi-K2.5/0.5.23/Simulated_GPU_96GB-98304MiB/tp2-")
    assert record["rung"] == 0.88
    (oom,) = record["ooms"]
    assert (oom["fraction"], oom["next_fraction"], oom["cause"]) == (0.93, 0.88, "cuda_oom_runtime")
    assert oom["server"] == "x" and oom["config"] == "x" and oom["host"] and oom["when"]

    b_cfg = fleet_config(tmp_path / "b", etcd_server, prefix, name="x")  # X again, a fresh state dir
    gpu_cfg = fleet_config(tmp_path / "gpu", etcd_server, prefix, gpu_gb=141, name="x")
    ver_cfg = fleet_config(tmp_path / "ver", etcd_server, prefix, version="0.5.6", name="x")
    with DaemonRun(b_cfg) as b, DaemonRun(gpu_cfg) as other_gpu, DaemonRun(ver_cfg) as other_version:
        launch = first_launch(b)
        assert launch["attempt"] == 1 and fraction_of(launch) == "0.88"
        (applied,) = b.find("fleet_applied")
        assert applied["key"] == key and applied["mem_fraction_static"] == 0.88
        assert applied["own_mem_fraction_static"] == 0.93 and applied["source"].endswith("/x (x)")
        for d in (other_gpu, other_version):
            launch = first_launch(d)
            assert fraction_of(launch) == "0.93", d.config
            assert not d.find("fleet_applied") and not d.find("fleet_error"), d.find("fleet_error")
        b.wait_for("server_ready", mem_fraction_static=0.88)
        assert grpc_loaded(b.proc.pid)  # [fleet] on: etcd's client is in the daemon
        for d in (b, other_gpu, other_version):
            assert d.stop() == 0
    # the other GPU and the other version wrote records of their own: their memory models
    # (start-up facts), no rung and no OOM; X's rung is still 0.88
    by_key = {r["key"]: r for r in records(a_cfg)}
    assert by_key[key]["rung"] == 0.88 and len(by_key) == 3
    assert all(r["rung"] is None and not r["ooms"] and r["points"] for k, r in by_key.items() if k != key)
    status = cli("status", "--config", str(b_cfg), "--verbose")
    assert "fleet:" in status.stdout and "0.88" in status.stdout and key in status.stdout, status.stdout
    state = json.loads(cli("status", "--config", str(b_cfg), "--json").stdout)
    assert state["learned"]["fleet"]["applied"] is True and state["learned"]["fraction"] == 0.88


def grpc_loaded(pid: int) -> bool:
    """Whether gRPC's extension (etcd's client) is mapped into process ``pid``."""
    return "cygrpc" in Path(f"/proc/{pid}/maps").read_text()


def test_without_fleet_the_running_daemon_never_loads_etcds_client(tmp_path, no_leftovers):
    """Not only at import: a daemon that launched and serves, [fleet] off, has no gRPC."""
    with DaemonRun(write_config(tmp_path)) as d:
        d.wait_for("server_ready", timeout=60)
        assert not grpc_loaded(d.proc.pid)
        assert d.stop() == 0


def test_an_oom_while_etcd_is_away_reaches_the_record_when_it_returns(tmp_path, no_leftovers):
    """etcd down: the launch goes ahead (a read error), the OOM's write fails and is retried;
    etcd back: the record gets it, nothing lost."""
    etcd = EtcdServer(tmp_path / "etcd")  # its ports chosen, not started yet
    try:
        cfg = fleet_config(tmp_path / "a", etcd.endpoint, "/test-fleet-away", name="x")
        with DaemonRun(cfg) as a:
            assert a.wait_for("fleet_error", op="read", timeout=60)["error"]
            oom_once(a)
            # (the memory model's write at READY failed before it, with nothing pending)
            failed = a.wait_for("fleet_error", op="write", pending=1, timeout=60)
            assert failed["retry_s"]
            a.wait_for("server_ready", mem_fraction_static=0.88)
            etcd.start()
            a.wait_for("fleet_updated", timeout=90)
            assert a.stop() == 0
        (record,) = records(cfg)
        assert record["rung"] == 0.88 and [o["fraction"] for o in record["ooms"]] == [0.93]
        state = json.loads(cli("status", "--config", str(cfg), "--json").stdout)
        assert state["learned"].get("fleet_pending", []) == []  # nothing left to share (and then not written)
    finally:
        etcd.stop()


def test_a_second_daemon_starts_with_the_first_ones_memory_model(tmp_path, etcd_server, no_leftovers):  # noqa: F811
    """A serves X at 0.93: its start-up facts go into the record. B, on X at 0.88 with a
    fresh state directory, has two fractions after its own first launch (0.93 from the
    fleet, 0.88 its own), and the record holds both for the next one."""
    prefix = "/test-fleet-model"
    a_cfg = fleet_config(tmp_path / "a", etcd_server, prefix, name="x")
    with DaemonRun(a_cfg) as a:
        a.wait_for("server_ready", timeout=60)
        updated = a.wait_for("fleet_updated", timeout=30)
        assert updated["points"] == 1 and updated["fractions"] == []
        assert a.stop() == 0
    b_cfg = fleet_config(tmp_path / "b", etcd_server, prefix, name="x")
    doc = tomllib.loads(b_cfg.read_text())
    doc["server"]["mem_fraction_static"] = 0.88
    b_cfg.write_text(tomli_w.dumps(doc))
    with DaemonRun(b_cfg) as b:
        assert fraction_of(first_launch(b)) == "0.88"
        b.wait_for("server_ready", timeout=60)
        b.wait_for("fleet_updated", points=2, timeout=30)
        # two fractions (one of them A's) and, once the GPU monitor saw B serve, its peak:
        # a recommendation after B's first launch
        told = wait_until(lambda: [r for r in b.find("recommended_fraction") if r["fraction"] is not None], 60, 0.2,
                          "a recommendation with a fraction")
        assert told[-1]["points"] == 2 and told[-1]["mem_fraction_static"] == 0.88, told[-1]
        assert not b.find("fleet_error"), b.find("fleet_error")
        assert b.stop() == 0
    (record,) = records(a_cfg)
    assert [p["fraction"] for p in record["points"]] == [0.88, 0.93]
    assert record["points"][0]["kv_tokens"] < record["points"][1]["kv_tokens"]
    state = json.loads(cli("status", "--config", str(b_cfg), "--json").stdout)
    assert sorted(p["fraction"] for p in state["learned"]["capacity"]["points"]) == [0.88, 0.93]
    rec = state["recommended"]  # what status says of it, from the state file
    assert rec["fraction"] is not None and rec["current"] == 0.88 and not rec["missing"], rec
    shown = cli("fleet", "list", "--config", str(a_cfg)).stdout
    assert "memory model: 0.88:" in shown and "0.93:" in shown, shown
