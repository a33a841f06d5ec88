"""The chart's PromQL with the real promtool: the PrometheusRule's alerts fire on the series
written for them and not on their near misses (`promtool test rules`, tests/prometheus/), every
alert has such a test, and every rule and dashboard query passes `promtool check rules` (what
`make lint` runs), which a broken expression fails."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_tools import check_promql, load_script, prometheus_binaries

HERE = Path(__file__).resolve().parent
UNIT_TESTS = HERE / "prometheus" / "alerts-test.yaml"


@pytest.fixture(scope="module")
def promtool() -> Path:
    return prometheus_binaries()["promtool"]


@pytest.fixture(scope="module")
def helm() -> Path:
    script = load_script("install_helm")
    return script.install_helm(Path(sys.executable).parent / "helm", script.default_cache())


@pytest.fixture(scope="module")
def groups(helm) -> list[dict]:
    return check_promql.render_rules(helm)


def promtool_test(promtool: Path, groups: list[dict], tmp_path: Path) -> str:
    """`promtool test rules` of tests/prometheus/ against `groups`; its output (asserts 0)."""
    (tmp_path / "pagefleet-rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    out = subprocess.run(
        [str(promtool), "test", "rules", UNIT_TESTS.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode, out.stdout + out.stderr


def alerts(groups: list[dict]) -> dict[str, dict]:
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_every_alert_fires_on_its_series_and_not_on_near_misses(promtool, groups, tmp_path):
    code, out = promtool_test(promtool, groups, tmp_path)
    assert code == 0, out
    assert "SUCCESS" in out


def test_every_shipped_alert_has_unit_tests(groups):
    tested = {
        case["alertname"]
        for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert tested == set(alerts(groups)), tested


def test_the_unit_tests_fail_when_an_alert_loses_its_guard(promtool, groups, tmp_path):
    """The engine-down alert without its "answered within the hour" guard fires for an engine
    still loading its model: the unit tests say so."""
    broken = copy.deepcopy(groups)
    rule = alerts(broken)["PagefleetEngineDown"]
    rule["expr"] = rule["expr"].split(" and on ")[0]
    code, out = promtool_test(promtool, broken, tmp_path)
    assert code != 0 and "llama-colocated-b" in out, out


def test_thresholds_durations_and_labels_come_from_values(helm):
    alerts_values = {
        "requestsWaiting": {"threshold": 3},
        "ttft": {"p90Seconds": 0.5},
        "engineDown": {"for": "30s"},
        "kvCacheFull": {"severity": "page"},
    }
    groups = check_promql.render_rules(helm, {"prometheusRule": {"alerts": alerts_values}})
    found = alerts(groups)
    assert found["PagefleetRequestsWaiting"]["expr"].rstrip().endswith("> 3")
    assert found["PagefleetTTFTHigh"]["expr"].rstrip().endswith("> 0.5")
    assert found["PagefleetEngineDown"]["for"] == "30s"
    assert found["PagefleetKVCacheFull"]["labels"] == {"severity": "page"}


def test_values_outside_the_schema_fail_the_install(helm):
    for bad in ('{"kvCacheFull": {"usage": 1.5}}', '{"ttft": {"for": "soon"}}'):
        argv = [str(helm), "template", "pf", str(check_promql.CHART)]
        out = subprocess.run(
            [*argv, "--set-json", f"prometheusRule.alerts={bad}"], capture_output=True, text=True
        )
        assert out.returncode != 0 and "/prometheusRule/alerts/" in out.stderr, (bad, out.stderr)


def test_promtool_checks_every_rule_and_dashboard_query(promtool, helm, capsys):
    assert check_promql.main(["--helm", str(helm), "--promtool", str(promtool)]) == 0
    out = capsys.readouterr().out
    assert "SUCCESS: 7 rules found" in out
    queries = len(check_promql.panel_queries()) + len(check_promql.variable_selectors())
    assert f"SUCCESS: {queries} rules found" in out


def test_promtool_check_fails_on_a_broken_dashboard_query(promtool):
    dashboard = json.loads(check_promql.DASHBOARD.read_text())
    dashboard["panels"][0]["targets"][0]["expr"] = "sum by (le (rate(vllm:x[$__rate_interval]))"
    out = check_promql.check_rules(promtool, check_promql.dashboard_rule_groups(dashboard))
    assert out.returncode != 0 and "parse error" in out.stdout + out.stderr


def test_grafana_variables_are_substituted_as_grafana_does():
    expr = 'rate(x{namespace=~"$namespace",model_name=~"${model}"}[$__rate_interval])'
    one = check_promql.grafana_expr(expr, {"namespace": ["serving"], "model": ["a.b"]}, 1, 1)
    assert one == 'rate(x{namespace=~"serving",model_name=~"a\\\\.b"}[4s])'
    many = check_promql.grafana_expr(expr, {"namespace": ["a", "b"], "model": ["m"]}, 30, 15)
    assert many == 'rate(x{namespace=~"(a|b)",model_name=~"m"}[60s])'


def test_the_install_script_needs_no_network_once_installed(tmp_path):
    script = load_script("install_prometheus")
    installed = prometheus_binaries()
    cache = tmp_path / "no-cache"
    paths = script.install_prometheus(Path(sys.executable).parent, cache)
    assert paths == installed and not cache.exists()
