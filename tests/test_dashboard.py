"""The Grafana dashboard: valid dashboard JSON whose queries name only exported metrics.

Structure is checked from the JSON; every PromQL expression is reduced to the metric names
it selects and compared with a scrape of a ``Metrics`` registry fed with a night's events
(plus an explicit list of SGLang's own metrics, which Prometheus scrapes from SGLang and the
daemon never re-exports), and parsed by the real promtool (as recording rules) so a typo
cannot hide in a string.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.sinks.metrics import Metrics
from tests.conftest import require_binary
from tests.edge import typed
from tests.test_metrics import STARTUP_FACTS, feed, night

DASHBOARD = Path(__file__).resolve().parent.parent / "etc" / "grafana" / "sglang-supervisor.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's variables, replaced by something PromQL accepts.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$instance": ".*", "$server": "a"}
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
            "group_right", "offset", "bool", "inf", "nan"}
# The panels the issue asks for: (panel type or None for any, a word in the title).
REQUIRED_PANELS = [
    ("state-timeline", "state"),
    (None, "up"),
    (None, "restarts by cause"),
    (None, "mem_fraction_static"),
    (None, "per-rank free gpu memory"),
    (None, "startup duration"),
    (None, "kv capacity"),
    (None, "probe failures"),
    ("state-timeline", "router registration"),
    (None, "router removal time"),
    (None, "failed router calls"),
    (None, "running and queued requests"),
    (None, "kv token usage"),
    (None, "generation throughput"),
]
# SGLang's own metrics (``--enable-metrics``, its /metrics; sglang/srt/observability/
# metrics_collector.py) that the dashboard may query: Prometheus scrapes them from SGLang
# (the ``sglang`` job of etc/prometheus/prometheus.example.yml), the daemon does not export them.
SGLANG_METRICS = {
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:gen_throughput",
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def query_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            yield panel


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and the variables' queries."""
    exprs = [t["expr"] for p in query_panels(dashboard) for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(re.fullmatch(r"label_values\((.*),\s*\w+\)", query).group(1))
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    text = re.sub(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\b", " ", text)  # numbers
    names = re.findall(r"(?<![\w:])[A-Za-z_:][\w:]*(?![\w:])(?!\s*\()", text)
    return {n for n in names if n.lower() not in KEYWORDS}


def exported_names() -> set[str]:
    """Sample names of a scrape after a night's events (_total, _bucket, _count, _sum, _created...)."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    feed(metrics, night())
    metrics.emit(typed("startup_facts", STARTUP_FACTS))  # rank series exist only once a run reports them
    metrics.emit(typed("gpu_sample", {"gpus": [{"index": 0, "uuid": "GPU-a", "total_bytes": 2, "free_bytes": 1}]}))
    text = generate_latest(registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metric_name_extraction_sees_through_promql() -> None:
    """The extractor keeps selectors and drops functions, keywords, labels, ranges and numbers."""
    expr = ('histogram_quantile(0.95, sum by (le) (rate(a_bucket{instance=~"$instance", x="y z"}[$__rate_interval])))'
            " / on (instance) group_left b_total * 1e9 > bool c unless d offset 5m")
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}


def test_dashboard_is_grafana_json_with_a_templated_prometheus_datasource(dashboard: dict[str, Any]) -> None:
    """Top-level fields are there, with a Prometheus datasource variable and an instance variable."""
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    assert variables["instance"]["datasource"] == DATASOURCE


def test_every_panel_queries_the_templated_datasource(dashboard: dict[str, Any]) -> None:
    """Panels have unique ids and a grid position; every query panel and target uses ${datasource}."""
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}, panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
    for panel in query_panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_dashboard_has_the_panels_the_issue_asks_for(dashboard: dict[str, Any]) -> None:
    """State timeline, up, restarts by cause, fraction, per-rank free memory, startup, KV capacity, probe failures."""
    panels = [(p["type"], p["title"].lower()) for p in query_panels(dashboard)]
    for kind, word in REQUIRED_PANELS:
        assert any(word in title and kind in (None, t) for t, title in panels), (kind, word)


def test_every_query_names_only_metrics_the_daemon_exports(dashboard: dict[str, Any]) -> None:
    """Each metric name in each PromQL expression appears in a scrape of the Metrics registry,
    or is one of the listed SGLang metrics."""
    exported = exported_names()
    for expr in expressions(dashboard):
        names = metric_names(expr)
        assert names, expr
        assert names <= exported | SGLANG_METRICS, (expr, names - exported - SGLANG_METRICS)


def test_sglang_metrics_are_on_the_dashboard_and_never_re_exported(dashboard: dict[str, Any]) -> None:
    """The SGLang panels query SGLang's own names; the daemon's scrape has none of them, nor a copy."""
    used = {name for expr in expressions(dashboard) for name in metric_names(expr)}
    assert {"sglang:num_running_reqs", "sglang:token_usage", "sglang:gen_throughput"} <= used
    exported = exported_names()
    assert not {name for name in exported if ":" in name}
    for name in SGLANG_METRICS:
        assert not any(name.removeprefix("sglang:") in mine for mine in exported), name


def test_every_panel_query_is_filtered_by_the_instance_variable(dashboard: dict[str, Any]) -> None:
    """Each selector in a panel query carries instance=~"$instance", so the variable applies everywhere."""
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            selectors = re.findall(r"(?<![\w:])(?:sglang_supervisor_\w+|sglang:\w+)(\{[^}]*\})?", target["expr"])
            assert selectors and all('instance=~"$instance"' in s for s in selectors), target["expr"]


def test_every_query_is_per_server_and_a_row_repeats_for_each_server(dashboard: dict[str, Any]) -> None:
    """A daemon may own several servers (``[[server]]``; every series has a ``server``
    label): each selector carries the server variable, every aggregation keeps the server
    apart, and a row of panels repeats once per server."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "server)" in variables["server"]["definition"] and variables["server"]["includeAll"]
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            selectors = re.findall(r"(?<![\w:])(?:sglang_supervisor_\w+|sglang:\w+)(\{[^}]*\})?", target["expr"])
            assert all(re.search(r'server=~?"\$server"', s) for s in selectors), target["expr"]
            for grouping in re.findall(r"\b(?:sum|max|min|avg) by \(([^)]*)\)", target["expr"]):
                labels = {x.strip() for x in grouping.split(",")}
                assert "instance" not in labels or "server" in labels, target["expr"]
    rows = [p for p in dashboard["panels"] if p["type"] == "row" and p.get("repeat") == "server"]
    assert len(rows) == 1 and "$server" in rows[0]["title"]
    start = dashboard["panels"].index(rows[0])
    repeated = []
    for panel in dashboard["panels"][start + 1:]:
        if panel["type"] == "row":
            break
        repeated.append(panel)
    assert {p["type"] for p in repeated} >= {"state-timeline", "timeseries"}
    for panel in repeated:  # one server each: its own series only
        assert all('server="$server"' in t["expr"] for t in panel["targets"]), panel["title"]


def test_every_query_parses_as_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool accepts every expression (variables substituted) as a recording rule."""
    promtool = require_binary("promtool")
    rules = []
    for n, expr in enumerate(expressions(dashboard)):
        for var, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:query_{n}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
