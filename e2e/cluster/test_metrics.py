"""Scenario: the metrics path with a real Prometheus. The lab's Prometheus scrapes the engine and
router pods at their IPs with the scrape config the Prometheus Operator makes of the chart's
ServiceMonitor, and evaluates the chart's PrometheusRule. The operator runs with
--prometheus-url: a pool at zero wakes for the requests the router holds and returns to zero
when the load stops, reading only Prometheus. On the way every shipped query is evaluated:

- each KEDA trigger the operator renders for the pool returns, at Prometheus' first scrape
  after a reading, the value the builtin autoscaler reads from the pods themselves (the
  router's queue at zero, the engine's waiting and running requests under load);
- the engine killed fires PagefleetEngineDown for that pod alone, and nothing fired before it
  (not while the engine loaded its model, when Prometheus already scraped it);
- under load each dashboard panel's expression (Grafana's variables substituted as Grafana
  does, run as Grafana runs a panel: a range query at $__interval) returns the series it is
  meant to, with the labels its legend and grouping use; its variables offer the namespace
  and the model.

What it catches: a renamed metric or label (a panel, trigger or alert returns nothing), a
relabeling missing from the ServiceMonitor (pagefleet_io_pool, namespace, pod), a trigger whose
value differs from what the autoscaler computes, an operator that cannot wake or drain a pool
through Prometheus, and an alert that never fires or fires on starting engines."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import time
from pathlib import Path

import yaml
from prometheus_tools import check_promql

from pagefleet.operator.metrics_source import (
    PodScraper,
    PoolPods,
    RouterPods,
    RouterScraper,
    ready_pod_ips,
    running_pod_ips,
)
from pagefleet.operator.reconcile import RenderOptions, desired_objects

from .conftest import open_lab
from .fleet import (
    Load,
    helm_template,
    md_pods,
    metrics,
    prepare_namespace,
    ready,
    router_url,
    simulated_deployment,
    start_operator,
)
from .prometheus import LabPrometheus
from .servicemonitor import scrape_configs

NS, NAME, MODEL, POOL = "serving", "watched", "tiny", "colocated"
SCRAPE_S = 1
# The chart as a user installs it with Prometheus: ServiceMonitor and rules on, scraped every
# second and alerting on a dead engine after a second, so the scenario does not wait minutes.
CHART_VALUES = {
    "serviceMonitor": {"enabled": True, "interval": f"{SCRAPE_S}s", "scrapeTimeout": "1s"},
    "prometheusRule": {"enabled": True, "alerts": {"engineDown": {"for": "1s"}}},
}
AUTOSCALING = {
    "mode": "builtin",
    "minReplicas": 0,
    "maxReplicas": 1,
    "targetWaitingPerReplica": 2,
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 60,  # no flapping under load; zero has its own window
    "scaleToZeroIdleSeconds": 3,
    "maxScaleUpStep": 1,
}
CLIENTS = 4  # on one engine of two slots: 2 running, 2 waiting
# Slower simulated steps: a request of 20 tokens runs ~2.5 s, so the queues hold still between
# a reading of the pods and Prometheus' next scrape.
ENGINE_ARGS = {"simulate-profile": json.dumps({"step_overhead_s": 0.12})}
# Grafana on a dashboard of the last minutes: $__interval is its minimum, the data source's
# scrape interval.
GRAFANA = {"namespace": [NS], "model": [MODEL]}


def chart_objects(tmp_path: Path) -> tuple[dict, list[dict]]:
    """The chart's ServiceMonitor and its PrometheusRule's rule groups."""
    values = tmp_path / "metrics-values.yaml"
    values.write_text(yaml.safe_dump(CHART_VALUES))
    docs = helm_template("pf", NS, values)
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return monitor, rule["spec"]["groups"]


def deployment() -> dict:
    md = simulated_deployment(NAME, NS, {"replicas": 0, "autoscaling": AUTOSCALING})
    md["spec"]["engineArgs"].update(ENGINE_ARGS)
    return md


def keda_triggers(md: dict, prometheus_url: str) -> dict[str, str]:
    """{trigger name: PromQL} of the ScaledObject the operator renders for the same pool with
    `autoscaling.mode: keda`."""
    keda = copy.deepcopy(md)
    keda["metadata"]["uid"] = "keda-variant"
    keda["spec"]["pools"][POOL]["autoscaling"]["mode"] = "keda"
    options = RenderOptions(prometheus_url=prometheus_url)
    (scaled,) = [o for o in desired_objects(keda, options) if o["kind"] == "ScaledObject"]
    return {t["name"]: t["metadata"]["query"] for t in scaled["spec"]["triggers"]}


def replicas(lab) -> int:
    found = lab.kube.get("apps/v1", "Deployment", NS, f"{NAME}-{POOL}")
    return found["spec"]["replicas"] if found else -1


def direct_readings(lab) -> dict[str, float]:
    """What the builtin autoscaler reads without Prometheus: each ready engine pod's /metrics
    and each running router pod's queue, under the KEDA triggers' names."""
    engines = ready_pod_ips(md_pods(lab, NS, NAME))
    routers = running_pod_ips(md_pods(lab, NS, NAME, "router"))
    pool = lab.in_lab(PodScraper().read, PoolPods(NS, NAME, POOL, MODEL, engines))
    queue = lab.in_lab(RouterScraper().read_queue, RouterPods(NS, NAME, MODEL, routers))
    assert queue.read and pool.pods == len(engines)
    return {
        "engines-waiting": pool.waiting,
        "engines-running": pool.running,
        "router-queued": queue.queued,
    }


def compare_triggers(lab, prom: LabPrometheus, triggers: dict[str, str]) -> dict | None:
    """Each trigger's value at Prometheus' first scrape after a direct reading, with the
    reading: {name: (direct, prometheus)}; None when the pods changed in between (no verdict)."""
    before = direct_readings(lab)
    moment = time.time()
    lab.wait_for(lambda: prom.scraped_since(moment), 30, "a scrape after the reading")
    seen = {name: sum(s.value for s in prom.query(q)) for name, q in triggers.items()}
    after = direct_readings(lab)
    if before != after:
        return None
    return {name: (before[name], seen[name]) for name in triggers}


def triggers_agree(lab, prom, triggers, nonzero: str, timeout: float = 30) -> dict:
    """Compare until a verdict in which trigger `nonzero` reads more than 0; every verdict
    on the way must agree."""

    def verdict():
        found = compare_triggers(lab, prom, triggers)
        if found is None:
            return None
        for name, (direct, seen) in found.items():
            assert seen == direct, f"{name}: {triggers[name]} is {seen}, the pods say {direct}"
        return found if found[nonzero][0] > 0 else None

    return lab.wait_for(verdict, timeout, f"a stable reading with {nonzero} > 0")


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def check_dashboard(prom: LabPrometheus, start: float, end: float, engines: set[str]) -> None:
    """Every panel query over the load, as Grafana runs it (a range query at $__interval)."""
    for name, selector in check_promql.variable_selectors().items():
        label = {"namespace": "namespace", "model": "model_name"}[name]
        expr = check_promql.grafana_expr(selector, GRAFANA, SCRAPE_S, SCRAPE_S)
        offered = prom.api(f"label/{label}/values", **{"match[]": expr}, start=start, end=end)
        assert GRAFANA[name][0] in offered, f"variable {name}: {expr} offers {offered}"
    for query in check_promql.panel_queries():
        expr = check_promql.grafana_expr(query.expr, GRAFANA, SCRAPE_S, SCRAPE_S)
        series = prom.query_range(expr, start, end, SCRAPE_S)
        where = f"panel {query.panel!r} ({query.legend}): {expr}"
        assert series, f"{where} returned no series under load"
        for labels, values in series:
            assert all(labels.get(k) for k in legend_labels(query.legend)), (where, labels)
            assert any(math.isfinite(v) for v in values), (where, labels, values)
        if "pod" in legend_labels(query.legend):  # one series per engine
            assert {labels["pod"] for labels, _ in series} == engines, where
        if "pagefleet_io_pool" in legend_labels(query.legend):
            ((labels, values),) = series
            assert labels["pagefleet_io_pool"] == POOL and max(values) == len(engines), where
        if "model_name" in legend_labels(query.legend):
            assert [labels["model_name"] for labels, _ in series] == [MODEL], where


def fired(prom: LabPrometheus, alert: str, window_s: int = 300) -> set[str]:
    """Pods `alert` fired for in the last `window_s` (the ALERTS series keeps a firing that
    has already resolved)."""
    expr = f'max_over_time(ALERTS{{alertname="{alert}",alertstate="firing"}}[{window_s}s])'
    return {s.labels.get("pod", "") for s in prom.query(expr)}


def mark(timings: dict[str, float], what: str, started: float) -> None:
    timings[what] = round(time.monotonic() - started, 1)
    print(f"metrics path: {what} at {timings[what]} s")


def kill_engine(pod: dict) -> None:
    status = pod["status"]["containerStatuses"][0]
    os.kill(int(status["containerID"].split("//")[1]), signal.SIGKILL)


def test_prometheus_scrapes_the_lab_and_every_shipped_query_answers(tmp_path, model_store):
    monitor, rule_groups = chart_objects(tmp_path)
    timings: dict[str, float] = {}
    started = time.monotonic()
    load, loading_seen = Load(""), None
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NS)
        prom = LabPrometheus(lab, scrape_configs(monitor), rule_groups)
        try:
            start_operator(lab, "--autoscale-interval", "0.5", "--prometheus-url", prom.url)
            md = deployment()
            lab.kube.create(md)
            triggers = keda_triggers(md, prom.url)
            assert set(triggers) == {"engines-waiting", "router-queued", "engines-running"}
            url = router_url(lab, NS, NAME)
            assert replicas(lab) == 0

            # At zero the router holds the requests; Prometheus sees its queue as the router
            # reports it, and the operator wakes the pool from Prometheus alone.
            load.url = url
            load_started = time.time()
            stop, workers = load.run(lab, clients=CLIENTS)
            lab.wait_for(
                lambda: direct_readings(lab)["router-queued"] == CLIENTS,
                60,
                "every client's request held at the router",
            )
            reading = triggers_agree(lab, prom, triggers, "router-queued")
            assert reading["router-queued"][0] == CLIENTS
            lab.wait_for(lambda: replicas(lab) == 1, 60, "the operator to wake the pool")
            mark(timings, "woken", started)

            # The engine serves with requests waiting: the engines' triggers agree with it.
            reading = triggers_agree(lab, prom, triggers, "engines-waiting", timeout=60)
            assert reading["engines-running"][0] > 0
            (engine,) = ready(md_pods(lab, NS, NAME))
            name = engine["metadata"]["name"]
            mark(timings, "queued on the engine", started)

            # Killed, the engine fires its alert, for it alone. Before, nothing fired: not
            # while it loaded its model (Prometheus scrapes pods that are not ready yet).
            assert not fired(prom, "PagefleetEngineDown")
            loading_seen = prom.query(f'min_over_time(up{{pod="{name}"}}[10m]) == 0') != []
            kill_engine(engine)
            lab.wait_for(
                lambda: fired(prom, "PagefleetEngineDown"), 60, "PagefleetEngineDown to fire"
            )
            assert fired(prom, "PagefleetEngineDown") == {name}
            mark(timings, "alerted", started)

            # Restarted, it serves the load again; every dashboard panel returns its series.
            lab.wait_for(
                lambda: (
                    (pod := lab.kube.get("v1", "Pod", NS, name))
                    and pod["status"]["containerStatuses"][0]["restartCount"] >= 1
                    and ready([pod])
                    and metrics(lab, pod).get("vllm:request_success_total", 0) >= 2
                ),
                90,
                "the restarted engine to answer again",
            )
            moment = time.time()
            lab.wait_for(lambda: prom.scraped_since(moment), 30, "a scrape after the answers")
            check_dashboard(prom, load_started, time.time(), {name})
            mark(timings, "dashboard", started)

            # The load stops: the operator, reading Prometheus, returns the pool to zero.
            stop.set()
            for w in workers:
                w.result(timeout=120)
            lab.wait_for(lambda: replicas(lab) == 0, 90, "the operator to return to zero")
            lab.wait_for(lambda: not md_pods(lab, NS, NAME), 90, "the engine pods gone")
            mark(timings, "zero", started)
            assert load.ok > 0
        finally:
            prom.close()
    print(f"metrics path: {timings}, {load.sent} requests sent, loading seen: {loading_seen}")
