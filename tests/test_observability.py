"""The alert rules (deploy/prometheus/alerts.yml) and the Grafana dashboard
(deploy/grafana/cube.json) stay true to what the services export: promtool checks the rules
and every dashboard query (as recording rules), promtool's rule tests check that alerts fire,
and every metric name they use is one the collectors produce."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from cube.agent.metrics import AgentCollector, AgentCounters
from cube.client import Attempt, ClientStats
from cube.client._core import PieceOutcome
from cube.client.prometheus import ClientCollector
from cube.server.metrics import ServerCollector
from cube.server.service import Counters
from cube.transfer.metrics import RolloutCounters, TransferCollector

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "cube.json"
RULE_TESTS = Path(__file__).parent / "prometheus" / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool comes with Debian's prometheus package (make debs)"
)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run promtool (the tests calling this are skipped without it)."""
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


METRIC = re.compile(r"\bcube_[a-z0-9_]+")


def exported_names() -> set[str]:
    """Every sample name the server and transfer collectors produce (from real counters)."""
    counters = Counters()
    counters.api["seek"].error(grpc.StatusCode.UNAVAILABLE)
    worker = {
        "worker": 0,
        "metrics": counters.snapshot(),
        "lane": {"connections": 1},
        "serving": True,
        "loading": False,
        "versions": {
            "current": {
                "version": "1",
                "record_count": 1,
                "data_bytes": 8,
                "load_seconds": 0.1,
                "mapped_bytes": 64,
                "locked_bytes": 0,
            }
        },
    }
    rollouts = RolloutCounters()
    rollouts.ended("committed", {"build_start": 0, "built": 1, "downloaded": 2}, 3.0)
    transfer = {
        "dict": "d",
        "live_version": "1",
        "live_since": 3.0,
        "phase": "download",
        "rollout_started": 2.0,
        "counters": rollouts.snapshot(),
        "retry": {"awaiting": 1, "next_at": 4.0},
        "instances": {"0_0": {"status": "Init", "version": "1", "reachable": True,
                              "catch_up_failures": 0}},
    }  # fmt: skip
    agent_counters = AgentCounters()
    agent_counters.task_ended("download", True, "", 1.0)
    agent = {"counters": agent_counters.snapshot(), "running": {}, "versions": 1,
             "disk": {"data": 1, "downloads": 1},
             "space": [{"deploy_path": "/d", "capacity": 2, "available": 1}]}  # fmt: skip
    stats = ClientStats()
    stats.call("ok", 0.001)
    stats.round([0], [PieceOutcome(None, (Attempt("a:1", "UNAVAILABLE", "down"),))])
    collectors = (
        ServerCollector(lambda: [worker]),
        TransferCollector(lambda: transfer),
        AgentCollector(lambda: agent),
        ClientCollector(stats),
    )
    names: set[str] = set()
    for collector in collectors:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names.update(sample.name for sample in family.samples)
    return names


def test_every_metric_is_documented() -> None:
    text = (REPO / "docs" / "METRICS.md").read_text()
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in exported_names()}
    missing = sorted(f for f in families if f"`{f}" not in text)
    assert not missing, f"docs/METRICS.md lacks {missing}"


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def test_every_metric_used_is_exported() -> None:
    names = exported_names()
    for where, queries in (("alerts.yml", alert_queries()), ("cube.json", dashboard_queries())):
        used = {m for q in queries for m in METRIC.findall(q)}
        assert used, where
        assert used <= names, f"{where} uses metrics nobody exports: {sorted(used - names)}"


def test_metric_names_follow_the_conventions() -> None:
    for name in exported_names():
        assert name.startswith(("cube_server_", "cube_transfer_", "cube_agent_", "cube_client_"))
        if "seconds" in name or "bytes" in name:
            assert re.search(r"_(seconds|bytes)(_total|_bucket|_sum|_count)?$", name), name


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert panel["targets"] and panel["gridPos"]["w"] > 0, panel["title"]
        for target in panel["targets"]:
            for variable in re.findall(r"\$\{?(\w+)", json.dumps(target)):
                assert variable in variables, (panel["title"], variable)


@needs_promtool
def test_promtool_checks_the_rules_and_every_dashboard_query(tmp_path: Path) -> None:
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    # dashboard queries as recording rules: promtool parses each as PromQL
    records = [
        {"record": f"cube:dashboard_query_{i}", "expr": query.replace("$job", ".*")}
        for i, query in enumerate(dashboard_queries())
    ]
    rules = tmp_path / "dashboard_rules.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    done = promtool("check", "rules", str(rules))
    assert done.returncode == 0, done.stdout + done.stderr


def alert_names() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["alert"] for group in rules["groups"] for rule in group["rules"]]


def test_every_alert_has_a_rule_test_firing_and_one_not() -> None:
    """tests/prometheus/alerts_test.yml has, for each alert of alerts.yml, an evaluation where
    it fires and one where it does not (and names no alert the file lacks)."""
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    names = alert_names()
    assert len(names) == len(set(names)), "an alert name is used twice"
    untested = [name for name in names if cases.get(name) != {True, False}]
    assert not untested, f"alerts_test.yml lacks firing and not firing cases of {untested}"
    assert set(cases) <= set(names), sorted(set(cases) - set(names))


def test_every_alert_has_a_runbook_line() -> None:
    """The chart's README says, for each alert, what it means and what to do."""
    readme = (REPO / "deploy" / "helm" / "cube" / "README.md").read_text()
    section = readme.split("\n## Alerts\n", 1)[1]
    rows = re.findall(r"^\| `(Cube\w+)` \|", section, flags=re.MULTILINE)
    assert rows == alert_names()


@needs_promtool
def test_alerts_fire_on_the_series_they_watch() -> None:
    done = promtool("test", "rules", str(RULE_TESTS), cwd=RULE_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
