"""The alert rules and the example Prometheus config, checked by the real promtool.

``promtool test rules`` runs the unit tests in etc/prometheus/alerts_test.yml (each alert
firing and staying quiet, with its rendered summary); the other checks make sure the rule
file, the example config and the tests cover what the issue asks for.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from supervisor.sinks.metrics import Metrics
from tests.conftest import require_binary
from tests.edge import typed

ETC = Path(__file__).resolve().parent.parent / "etc" / "prometheus"
RULES = ETC / "alerts.yml"
RULE_TESTS = ETC / "alerts_test.yml"
EXAMPLE = ETC / "prometheus.example.yml"
REQUIRED_ALERTS = {
    "SGLangServerDown",
    "SGLangCrashLoop",
    "SGLangSupervisorGaveUp",
    "SGLangHeadroomLow",
    "SGLangGpuMemoryStuck",
    "SGLangFractionAtFloor",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_binary("promtool")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, check=False)


def alert_names(text: str) -> list[str]:
    return re.findall(r"^\s*- alert:\s*(\S+)\s*$", text, flags=re.MULTILINE)


@pytest.mark.parametrize("args", [("check", "rules", str(RULES)), ("check", "config", str(EXAMPLE))])
def test_promtool_accepts_the_rules_and_the_example_config(args: tuple[str, ...]) -> None:
    """promtool validates alerts.yml and prometheus.example.yml (which loads the rules)."""
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_rule_unit_tests_pass() -> None:
    """Every case of alerts_test.yml passes under promtool test rules."""
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_rules_include_every_alert_the_issue_asks_for_each_with_summary_and_description() -> None:
    """The six required alerts exist, and every rule carries a summary and a description."""
    text = RULES.read_text()
    names = alert_names(text)
    assert REQUIRED_ALERTS <= set(names)
    assert len(names) == len(set(names))
    blocks = re.split(r"^\s*- alert:", text, flags=re.MULTILINE)[1:]
    for name, block in zip(names, blocks, strict=True):
        assert re.search(r"^\s+summary: \S", block, re.MULTILINE), name
        assert re.search(r"^\s+description: \S", block, re.MULTILINE), name


def test_every_alert_has_a_unit_test_that_expects_it_to_fire() -> None:
    """Each alert in alerts.yml is named by a promtool test case with a non-empty exp_alerts."""
    cases = re.findall(r"alertname: (\S+)\n\s+exp_alerts:\n", RULE_TESTS.read_text())
    assert set(alert_names(RULES.read_text())) <= set(cases)


def test_rules_name_only_metrics_the_supervisor_exports() -> None:
    """Every sglang_supervisor_* name in the rules is in a scrape of the Metrics registry."""
    registry = CollectorRegistry()
    Metrics(registry).emit(typed("startup_facts", {"ranks": {"TP0": {"avail_mem_after_capture_gb": 1.0}}}))
    exported = set(re.findall(r"^(sglang_supervisor_\w+)", generate_latest(registry).decode(), re.MULTILINE))
    named = set(re.findall(r"\bsglang_supervisor_\w+", RULES.read_text()))
    assert named and named <= exported, named - exported
