"""A real Prometheus scrapes the supervisor's metrics through the seed night's OOM.

The first test drives our metrics server with the night's events in-process (it proves the
Prometheus fixture, the exposition and the alert rules loading into a real server). The
second runs the real daemon's demo against the simulator through the CLI contract
``python -m supervisor.cli demo --hold 20 --set metrics.listen=... --set state.dir=...`` and
checks what Prometheus recorded: the cuda_oom_runtime crash counter rising and the fraction
going 0.93 -> 0.88.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from supervisor.sinks.metrics import Metrics
from supervisor.sinks.metrics_endpoint import start_metrics_server
from tests.conftest import free_port, require_binary
from tests.harness import STOP_SLACK_S, stop_daemon
from tests.prom import JOB, PrometheusServer, rose, went
from tests.test_alert_rules import REQUIRED_ALERTS, RULES
from tests.test_metrics import feed, night

pytestmark = pytest.mark.integration

OOM_CRASHES = 'sglang_supervisor_crashes_total{cause="cuda_oom_runtime"}'
FRACTION = "sglang_supervisor_mem_fraction_static"


def oom_night_seen(prom: PrometheusServer) -> bool:
    """Prometheus holds the OOM crash counter rising from 0 and the fraction going 0.93 -> 0.88."""
    return rose(prom.history(OOM_CRASHES)) and went(prom.history(FRACTION), 0.93, 0.88)


@pytest.fixture
def prometheus_binary() -> str:
    return require_binary("prometheus")


async def test_prometheus_scrapes_our_metrics_server_through_the_oom(
    prometheus_binary: str, tmp_path: Path, no_leftovers: None
) -> None:
    """Prometheus scrapes the metrics server fed with the night's events, sees the OOM and loads the rules."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    events = night()
    crash = next(i for i, (event, _) in enumerate(events) if event == "crash")
    server = await start_metrics_server("127.0.0.1:0", registry)
    prom = PrometheusServer(prometheus_binary, tmp_path, [f"127.0.0.1:{server.port}"], rule_files=[RULES])
    try:
        await asyncio.to_thread(prom.start)
        feed(metrics, events[:crash])  # serving at 0.93
        await asyncio.to_thread(
            prom.wait_for, lambda: prom.query(f"{FRACTION} == 0.93"), 60, "a scrape at 0.93"
        )
        feed(metrics, events[crash:])  # the OOM, the restart at 0.88
        await asyncio.to_thread(prom.wait_for, lambda: oom_night_seen(prom), 60, "the OOM night in Prometheus")

        up = await asyncio.to_thread(prom.query, f'up{{job="{JOB}"}}')
        assert [r["value"][1] for r in up] == ["1"]
        groups = (await asyncio.to_thread(prom.api, "rules"))["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"] if r["type"] == "alerting"}
        assert REQUIRED_ALERTS <= set(rules)
        assert all(r["health"] == "ok" and r["annotations"]["summary"] for r in rules.values())
    finally:
        await asyncio.to_thread(prom.stop)
        await server.close()


@contextlib.contextmanager
def demo_daemon(port: int, workdir: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The daemon's demo as a subprocess serving metrics on ``port``; its group is killed if it outlives the test."""
    state = workdir / "state"
    state.mkdir(parents=True)
    log = workdir / "daemon.log"
    argv = [
        sys.executable, "-m", "supervisor.cli", "demo", "--hold", "20",
        "--set", f'metrics.listen="127.0.0.1:{port}"',
        "--set", f"state.dir={state}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the daemon stops its server on SIGTERM
            stop_daemon(proc, log, STOP_SLACK_S + 60)  # SIGKILLs the group and fails the test if it hangs


@pytest.mark.timeout(420)
def test_prometheus_scrapes_the_daemon_demo_through_the_oom(
    prometheus_binary: str, tmp_path: Path, no_leftovers: None
) -> None:
    """A real Prometheus scraping the running demo sees the cuda_oom_runtime crash and 0.93 -> 0.88; the demo exits 0."""
    port = free_port()
    # Prometheus first, so that it is already scraping when the daemon launches at 0.93.
    with PrometheusServer(prometheus_binary, tmp_path / "prom", [f"127.0.0.1:{port}"]) as prom, \
            demo_daemon(port, tmp_path / "daemon") as (proc, log):

        def daemon_log() -> str:
            return log.read_text(errors="replace")[-4000:]

        def daemon_exited() -> str | None:
            return None if proc.poll() is None else f"the daemon exited with {proc.returncode}"

        try:
            prom.wait_for(lambda: oom_night_seen(prom), 240, "the demo's OOM night in Prometheus", abort=daemon_exited)
            returncode = proc.wait(timeout=120)  # --hold 20, then a clean exit
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            pytest.fail(f"{exc}\n--- daemon output ---\n{daemon_log()}")
        assert returncode == 0, daemon_log()
