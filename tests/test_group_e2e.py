"""A two-node group on the simulator, coordinated through a real etcd: two real daemons, each
owning one node's rank (``[group]``), the simulator in its multi-node mode (a rendezvous at
--dist-init-addr, a dummy /health on node 1, a peer's death failing the other's collective).

Killing either node's scheduler ends the generation on both nodes; the leader chooses the
killed node's own finding as the root cause, never the echo on its peer, and both relaunch
as one new generation after one backoff. A daemon SIGKILLed loses its lease and ends the
generation too. While etcd is down the servers keep serving and nothing is relaunched.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import free_port, wait_until
from harness import DaemonRun, write_config

from tests.etcdlib import EtcdServer, etcd_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

READY_S = 60.0


def node_configs(tmp_path: Path, etcd: EtcdServer) -> list[Path]:
    dist = f"127.0.0.1:{free_port()}"
    configs = []
    for rank in (0, 1):
        tmp = tmp_path / f"node{rank}"
        tmp.mkdir()
        configs.append(write_config(tmp, {
            "server": {"tp_size": 1},
            "policy": {"backoff_initial_s": 0.5, "backoff_max_s": 1.0},
            "group": {"name": "g", "node_rank": rank, "nnodes": 2, "dist_init_addr": dist, "lease_ttl_s": 10},
            "etcd": {"endpoints": [etcd.endpoint], "timeout_s": 3.0},
        }, name=f"node{rank}"))
    return configs


def scheduler_of(main_pid: int) -> psutil.Process:
    for child in psutil.Process(main_pid).children(recursive=True):
        if " ".join(child.cmdline()).startswith("sglang::scheduler"):
            return child
    raise AssertionError(f"no sglang::scheduler under pid {main_pid}")


def generation(nodes: list[DaemonRun], number: int) -> dict[str, Any]:
    """The leader's ``group_generation`` event for ``number`` (from whichever node leads)."""
    found = [e for d in nodes for e in d.find("group_generation", number=number)]
    assert found, f"no group_generation {number}"
    return found[0]


def both_ready(nodes: list[DaemonRun], attempt: int) -> None:
    for d in nodes:
        d.wait_for("server_ready", READY_S, attempt=attempt)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_node_ends_the_generation_for_both_and_is_named_the_root_cause(
    tmp_path: Path, etcd_server: EtcdServer, victim: int,  # noqa: F811
) -> None:
    configs = node_configs(tmp_path, etcd_server)
    with DaemonRun(configs[0]) as n0, DaemonRun(configs[1]) as n1:
        nodes = [n0, n1]
        both_ready(nodes, 1)
        leaders = [d for d in nodes if d.find("group_leader")]
        assert len(leaders) == 1  # one leader, whichever node it is
        main = int(nodes[victim].wait_for("launch")["pid"])
        killed_at = time.monotonic()
        scheduler_of(main).kill()
        wait_until(lambda: all(len(d.find("launch")) >= 2 for d in nodes), 60, 0.05, "both nodes relaunched")
        relaunched = max(d.find("launch")[1]["mono"] for d in nodes) - killed_at
        both_ready(nodes, 2)
        ready = max(d.find("server_ready", attempt=2)[0]["mono"] for d in nodes) - killed_at
        gen = generation(nodes, 2)
        assert gen["root_node"] == victim, gen
        causes = {r["node"]: (r["cause"], r["rank"]) for r in gen["reports"]}
        assert causes[1 - victim][1] == "echo", causes  # the peer's log named the echo only
        assert causes[victim][1] != "echo", causes
        # one generation for both, launched with the same flags
        argvs = [d.find("launch")[1]["argv"] for d in nodes]
        assert [a[a.index("--mem-fraction-static") + 1] for a in argvs] == ["0.93", "0.93"]
        print(f"victim node {victim}: both relaunched {relaunched:.2f} s after the kill, both READY {ready:.2f} s; "
              f"reports {causes}; root cause node {gen['root_node']}: {gen['reason']}")
        for d in nodes:
            assert d.stop() == 0


def test_a_daemon_killed_loses_its_lease_and_the_group_restarts(tmp_path: Path, etcd_server: EtcdServer) -> None:  # noqa: F811
    configs = node_configs(tmp_path, etcd_server)
    with DaemonRun(configs[0]) as n0:
        n1 = DaemonRun(configs[1])
        try:
            both_ready([n0, n1], 1)
            n1.kill()  # SIGKILL: its server runs on, its lease expires after lease_ttl_s
            ended = n0.wait_for("group_generation_ended", 60)  # node 0 leads now, whoever led before
            assert ended["reason"].startswith("node 1 lost"), ended
            n0.wait_for("state_changed", 60, to="WAITING")  # its rank stopped, waiting for the group
            gen = n0.wait_for("group_generation", 60, number=2)
            assert gen["root_node"] == 1, gen  # the lost node, not node 0's own stop
            n1b = DaemonRun(configs[1])  # systemd restarts it; it joins the next generation
            try:
                n0.wait_for("server_ready", READY_S, attempt=2)
                n1b.wait_for("server_ready", READY_S)
            finally:
                n1b.stop()
        finally:
            n1.stop()


def test_etcd_down_keeps_the_servers_and_starts_nothing(tmp_path: Path, etcd_server: EtcdServer) -> None:  # noqa: F811
    configs = node_configs(tmp_path, etcd_server)
    with DaemonRun(configs[0]) as n0, DaemonRun(configs[1]) as n1:
        both_ready([n0, n1], 1)
        etcd_server.stop()
        for d in (n0, n1):
            d.wait_for("group_etcd_unreachable", 30)
        time.sleep(12.0)  # longer than the lease TTL
        etcd_server.start()
        for d in (n0, n1):
            d.wait_for("group_etcd_recovered", 60)
        time.sleep(3.0)
        for d in (n0, n1):
            assert len(d.find("launch")) == 1, "nothing was relaunched because leases lapsed"
            assert d.find("server_down") == []
            assert d.states()[-1] == "READY"


def test_a_node_reexecs_in_place_keeping_its_lease_and_the_group_notices_nothing(
    tmp_path: Path, etcd_server: EtcdServer,  # noqa: F811
) -> None:
    """Node 1's daemon re-execs (docs/upgrade.md): it joins again on the same lease, its
    server is adopted, and past a whole lease TTL no generation has ended on either node."""
    import subprocess
    import sys

    from harness import REPO

    configs = node_configs(tmp_path, etcd_server)
    with DaemonRun(configs[0]) as n0, DaemonRun(configs[1]) as n1:
        both_ready([n0, n1], 1)
        joined = n1.wait_for("group_joined")
        pids = [d.find("launch")[-1]["pid"] for d in (n0, n1)]
        done = subprocess.run([sys.executable, "-m", "supervisor.cli", "reexec", "--config", str(configs[1]),
                               "--timeout", "60"], capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        said = n1.wait_for("reexec", 30)
        assert said["adopted"] and not said.get("relaunching")
        again = n1.wait_for("group_joined", 30, count=2)
        assert again["lease"] == joined["lease"] != ""  # the same lease: its node key never went away
        time.sleep(12.0)  # past lease_ttl_s (10): a lapsed lease would have ended the generation by now
        assert not n0.find("group_generation_ended") and not n1.find("group_generation_ended")
        assert [d.find("launch")[-1]["pid"] for d in (n0, n1)] == pids
        assert len(n0.find("launch")) == 1 and len(n1.find("launch")) == 1
