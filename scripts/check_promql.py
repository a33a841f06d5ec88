"""`make lint`'s PromQL check: every alert of the chart's PrometheusRule and every query of its
Grafana dashboard (Grafana's variables substituted as Grafana does) through `promtool check
rules`. The functions here are also what the tests use to read the chart's rules and to turn
the dashboard's expressions into the PromQL Grafana sends.

    python scripts/check_promql.py   # exit 1, naming the expression, if one does not parse
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "pagefleet"
DASHBOARD = CHART / "dashboards" / "pagefleet.json"
BIN = ROOT / ".venv" / "bin"
# Grafana's regex escaping of a variable's value inside =~ (its Prometheus data source).
_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


@dataclass(frozen=True)
class PanelQuery:
    """One target of one dashboard panel."""

    panel: str
    expr: str  # with Grafana's variables
    legend: str


def render_rules(helm: Path, values: dict | None = None) -> list[dict]:
    """The `groups` of the chart's PrometheusRule, rendered by helm with the rule enabled and
    `values` on top: what the Prometheus Operator writes to a rule file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "values.yaml"
        path.write_text(yaml.safe_dump(values or {}))
        cmd = [str(helm), "template", "pf", str(CHART), "-f", str(path)]
        cmd += ["--set", "prometheusRule.enabled=true"]
        cmd += ["--show-only", "templates/prometheusrule.yaml"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    (rule,) = [d for d in yaml.safe_load_all(out) if d]
    return rule["spec"]["groups"]


def panel_queries(dashboard: dict | None = None) -> list[PanelQuery]:
    dashboard = dashboard or json.loads(DASHBOARD.read_text())
    return [
        PanelQuery(panel["title"], target["expr"], target.get("legendFormat", ""))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def variable_selectors(dashboard: dict | None = None) -> dict[str, str]:
    """Each query variable's `label_values(SELECTOR, LABEL)`: {name: SELECTOR}, the series
    whose LABEL values the variable offers."""
    dashboard = dashboard or json.loads(DASHBOARD.read_text())
    out = {}
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"].strip())
            assert found, f"variable {var['name']}: not a label_values() query: {var['query']}"
            out[var["name"]] = found[1]
    return out


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms" if seconds < 1 else f"{round(seconds)}s"


def grafana_expr(
    expr: str, variables: dict[str, list[str]], interval_s: float, scrape_interval_s: float
) -> str:
    """`expr` as Grafana sends it: a multi-value variable in a regex matcher becomes the
    regex-escaped values joined as (a|b) (one value: itself), and $__interval and
    $__rate_interval (max($__interval + scrape interval, 4 x scrape interval)) become
    durations."""
    rate_interval = max(interval_s + scrape_interval_s, 4 * scrape_interval_s)
    builtins = {
        "__rate_interval": _duration(rate_interval),
        "__interval": _duration(interval_s),
    }

    def value(match: re.Match) -> str:
        name = match[1] or match[2]
        if name in builtins:
            return builtins[name]
        # Escaped for the regex, then the backslash for the PromQL string literal.
        values = [_REGEX_SPECIAL.sub(r"\\\\\1", v) for v in variables[name]]
        return values[0] if len(values) == 1 else f"({'|'.join(values)})"

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def check_rules(promtool: Path, groups: list[dict]) -> subprocess.CompletedProcess:
    """`promtool check rules` on a rule file holding `groups`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rules.yaml"
        path.write_text(yaml.safe_dump({"groups": groups}))
        return subprocess.run(
            [str(promtool), "check", "rules", str(path)], capture_output=True, text=True
        )


def dashboard_rule_groups(dashboard: dict | None = None) -> list[dict]:
    """Every dashboard query (and variable selector) as a recording rule, Grafana's variables
    substituted, so that promtool parses it."""
    variables = {name: ["serving", "other"] for name in variable_selectors(dashboard)}
    rules = [
        {"record": f"dashboard:panel_{i}", "expr": grafana_expr(q.expr, variables, 15, 15)}
        for i, q in enumerate(panel_queries(dashboard))
    ]
    rules += [
        {"record": f"dashboard:variable_{name}", "expr": grafana_expr(selector, variables, 15, 15)}
        for name, selector in variable_selectors(dashboard).items()
    ]
    return [{"name": "dashboard", "rules": rules}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--helm", type=Path, default=BIN / "helm")
    parser.add_argument("--promtool", type=Path, default=BIN / "promtool")
    args = parser.parse_args(argv)
    failed = False
    for what, groups in (
        ("the chart's PrometheusRule", render_rules(args.helm)),
        ("the Grafana dashboard's queries", dashboard_rule_groups()),
    ):
        out = check_rules(args.promtool, groups)
        print(f"{what}: {(out.stdout + out.stderr).strip()}")
        failed |= out.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
