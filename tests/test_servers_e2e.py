"""One real daemon owning two simulated servers (``[[server]]``), driven from the command
line as an operator would: each server on its own simulated GPU, ``status`` and ``run
--dry-run`` per server, metrics under a ``server`` label, ``restart --server`` touching one
server only, and an unknown server name refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, wait_until
from harness import REPO, DaemonRun, merge_servers, write_config
from prometheus_client.parser import text_string_to_metric_families

from supervisor.sim import simgpu

pytestmark = pytest.mark.integration


def cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False)


def pair(tmp_path: Path) -> tuple[Path, str]:
    listen = f"127.0.0.1:{free_port()}"
    configs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        configs.append(write_config(tmp_path / name, {"server": {"tp_size": 1}}, name=name))
    merged = merge_servers(configs, tmp_path / "pair.toml", ((0,), (1,)))
    merged.write_text(merged.read_text().replace("[metrics]\nenabled = false", f'[metrics]\nenabled = true\nlisten = "{listen}"'))
    return merged, listen


def scrape(listen: str) -> dict[tuple[str, str], float]:
    """(server, state) -> value of sglang_supervisor_state."""
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "sglang_supervisor_state":
            for sample in family.samples:
                out[(sample.labels["server"], sample.labels["state"])] = sample.value
    return out


def test_two_servers_in_one_daemon_as_an_operator_sees_them(tmp_path: Path) -> None:
    config, listen = pair(tmp_path)
    dry = json.loads(cli("run", "--config", str(config), "--dry-run").stdout)
    assert sorted(dry) == ["a", "b"] and dry["a"] != dry["b"]
    with DaemonRun(config) as d:
        for name in ("a", "b"):
            d.wait_for("server_ready", 60, server=name)
        # each server's schedulers hold memory on its own simulated GPU only
        gpus = tmp_path / "a" / "gpus"
        used = sorted(sorted(p.allocations) for p in simgpu.read_processes(gpus) if p.alive)
        assert used == [[0], [1]], used

        shown = cli("status", "--config", str(config))
        assert shown.returncode == 0, shown  # every server serving
        assert [line.split()[:2] for line in shown.stdout.splitlines()] == [["a", "READY"], ["b", "READY"]]
        one = json.loads(cli("status", "--config", str(config), "--server", "b", "--json").stdout)
        assert list(one["servers"]) == ["b"] and one["servers"]["b"]["state"] == "READY"

        states = wait_until(lambda: (s := scrape(listen)).get(("a", "READY")) == 1 and s.get(("b", "READY")) == 1 and s,
                            10, 0.1, "both READY in the metrics")
        assert states[("a", "STARTING")] == 0 and states[("b", "STARTING")] == 0

        bad = cli("restart", "--config", str(config), "--server", "c")
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "known: a, b" in bad.stderr

        done = cli("restart", "--config", str(config), "--server", "b", timeout=120)
        assert done.returncode == 0, done.stderr
        assert "b: ready again (launch 2)" in done.stdout
        assert len(d.find("launch", server="b")) == 2
        assert len(d.find("launch", server="a")) == 1  # a was never touched
        assert d.find("server_down") == [] and d.find("crash") == []
        assert d.stop() == 0
