"""Scenario: the metrics path with a real Prometheus. The lab's Prometheus scrapes the engine,
router and operator pods at their IPs with the scrape configs the Prometheus Operator makes of
the chart's two ServiceMonitors, and evaluates the chart's PrometheusRule. The operator is the
chart's (two replicas, one leading, in a namespace of their own) with operator.prometheusUrl:
a pool at zero wakes for the requests the router holds and returns to zero when the load
stops, reading only Prometheus. On the way every shipped query is evaluated:

- each KEDA trigger the operator renders for the pool returns, at Prometheus' first scrape
  after a reading, the value the builtin autoscaler reads from the pods themselves (the
  router's queue at zero, the engine's waiting and running requests under load);
- the operator's own series arrive with the ModelDeployment's labels: one replica leads (the
  Lease's holder), the pool's desired, ready and current replicas are what the operator wrote
  to the ModelDeployment's status (under load, and back at zero), each scaling decision is
  counted once with its reason, and a ModelDeployment it refuses counts reconcile errors;
- the engine killed fires PagefleetEngineDown for that pod alone, and nothing fired before it
  (not while the engine loaded its model, when Prometheus already scraped it); the refused
  ModelDeployment fires PagefleetReconcileErrors, alone;
- under load each dashboard panel's expression (Grafana's variables substituted as Grafana
  does, run as Grafana runs a panel: a range query at $__interval) returns the series it is
  meant to, with the labels its legend and grouping use; its variables offer the namespace
  and the model.

What it catches: a renamed metric or label (a panel, trigger or alert returns nothing), a
relabeling missing from a ServiceMonitor (pagefleet_io_pool, namespace, pod; the operator's
honorLabels), a trigger whose value differs from what the autoscaler computes, operator series
that disagree with its status, an operator that cannot wake or drain a pool through
Prometheus, and an alert that never fires or fires on starting engines."""

from __future__ import annotations

import contextlib
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

from pagefleet.operator.autoscale import ScaleReason
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
    MD,
    Load,
    helm_template,
    md_pods,
    metrics,
    prepare_namespace,
    ready,
    router_url,
    simulated_deployment,
)
from .lab import wait_for
from .prometheus import PROMETHEUS_PORT, LabPrometheus
from .servicemonitor import scrape_configs

NS, NAME, MODEL, POOL = "serving", "watched", "tiny", "colocated"
REFUSED = "refused"  # a ModelDeployment the operator refuses: a hostPath it does not allow
# The chart's release, its operator with it, in a namespace of its own (watching NS): the
# operator's series name NS only if its ServiceMonitor honours their labels.
RELEASE_NS = "pagefleet-system"
SCRAPE_S = 1
OPERATORS = 2  # the chart's default: one leads
OPERATOR_JOB = "pf-pagefleet-operator"  # its Service, the job of its targets
OP = "pagefleet_operator:"
REASONS = {str(reason) for reason in ScaleReason}
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


def chart_values(prometheus_url: str) -> dict:
    """The chart as a user installs it with Prometheus: ServiceMonitors and rules on, scraped
    every second and alerting after a second, so the scenario does not wait minutes; the
    operator reads queues from that Prometheus, every half second, and watches NS. The
    ModelDeployments are the scenario's own."""
    alerts = {"engineDown": {"for": "1s"}, "reconcileErrors": {"for": "1s"}}
    return {
        "serviceMonitor": {"enabled": True, "interval": f"{SCRAPE_S}s", "scrapeTimeout": "1s"},
        "prometheusRule": {"enabled": True, "alerts": alerts},
        "operator": {
            "prometheusUrl": prometheus_url,
            "autoscaleInterval": 0.5,
            "watchNamespaces": [NS],
        },
        "modelDeployment": {"enabled": False},
        "modelCache": {"enabled": False},
    }


def chart_objects(tmp_path: Path, prometheus_url: str) -> tuple[list[dict], list[dict], list]:
    """The chart's ServiceMonitors, its PrometheusRule's rule groups (both the Prometheus
    Operator's to read), and the rest: what the API gets (the CRD is installed already)."""
    values = tmp_path / "metrics-values.yaml"
    values.write_text(yaml.safe_dump(chart_values(prometheus_url)))
    docs = helm_template("pf", RELEASE_NS, values)
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    rest = [
        d
        for d in docs
        if d["apiVersion"].split("/")[0] not in {"monitoring.coreos.com", "apiextensions.k8s.io"}
    ]
    return monitors, rule["spec"]["groups"], rest


def deployment() -> dict:
    md = simulated_deployment(NAME, NS, {"replicas": 0, "autoscaling": AUTOSCALING})
    md["spec"]["engineArgs"].update(ENGINE_ARGS)
    return md


def refused_deployment() -> dict:
    md = simulated_deployment(REFUSED, NS, {"replicas": 1})
    md["spec"]["model"] = {"name": "other", "source": "hostPath", "path": "/srv/models/tiny"}
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


def direct_readings(lab) -> tuple[dict[str, float], set[str]]:
    """What the builtin autoscaler reads without Prometheus: each ready engine pod's /metrics
    and each running router pod's queue, under the KEDA triggers' names; and the pods read."""
    engines = ready_pod_ips(md_pods(lab, NS, NAME))
    routers = running_pod_ips(md_pods(lab, NS, NAME, "router"))
    pool = lab.in_lab(PodScraper().read, PoolPods(NS, NAME, POOL, MODEL, engines))
    queue = lab.in_lab(RouterScraper().read_queue, RouterPods(NS, NAME, MODEL, routers))
    assert queue.read and pool.pods == len(engines)
    readings = {
        "engines-waiting": pool.waiting,
        "engines-running": pool.running,
        "router-queued": queue.queued,
    }
    return readings, {*engines, *routers}


def compare_triggers(lab, prom: LabPrometheus, triggers: dict[str, str]) -> dict | None:
    """Each trigger's value at Prometheus' first scrape after a direct reading, with the
    reading: {name: (direct, prometheus)}; None when the pods changed in between (no verdict).
    Prometheus must have discovered every pod read (a new pod's series are missing until then)."""
    before, pods = direct_readings(lab)
    moment = time.time()
    scraped = lambda: prom.scraped_since(moment, hosts=pods)  # noqa: E731
    lab.wait_for(scraped, 30, "a scrape of every pod read after the reading")
    seen = {name: sum(s.value for s in prom.query(q)) for name, q in triggers.items()}
    after, pods_after = direct_readings(lab)
    if (before, pods) != (after, pods_after):
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


def dashboard_gaps(prom: LabPrometheus, start: float, end: float, engines: set[str]) -> list:
    """What the dashboard fails to show over the load, as Grafana runs each query (a range
    query at $__interval); empty when every variable and panel answers."""
    gaps: list = []
    for name, selector in check_promql.variable_selectors().items():
        label = {"namespace": "namespace", "model": "model_name"}[name]
        expr = check_promql.grafana_expr(selector, GRAFANA, SCRAPE_S, SCRAPE_S)
        offered = prom.api(f"label/{label}/values", **{"match[]": expr}, start=start, end=end)
        if GRAFANA[name][0] not in offered:
            gaps.append(f"variable {name}: {expr} offers {offered}")
    for query in check_promql.panel_queries():
        expr = check_promql.grafana_expr(query.expr, GRAFANA, SCRAPE_S, SCRAPE_S)
        series = prom.query_range(expr, start, end, SCRAPE_S)
        where = f"panel {query.panel!r} ({query.legend}): {expr}"
        legend = legend_labels(query.legend)
        if not series:
            gaps.append(f"{where} returned no series under load")
        for labels, values in series:
            if not all(labels.get(k) for k in legend):
                gaps.append((where, labels))
            if not any(math.isfinite(v) for v in values):
                gaps.append((where, labels, values))
        if "pod" in legend and {labels["pod"] for labels, _ in series} != engines:
            gaps.append((where, "one series per engine", series))
        if "pagefleet_io_pool" in legend and [
            (labels["pagefleet_io_pool"], max(values)) for labels, values in series
        ] != [(POOL, len(engines))]:
            gaps.append((where, "the pool's replicas", series))
        if "model_name" in legend and [labels["model_name"] for labels, _ in series] != [MODEL]:
            gaps.append((where, "one series for the model", series))
    return gaps


def check_dashboard(prom: LabPrometheus, start: float, engines: set[str]) -> None:
    """Wait until every panel shows the load. A ratio such as the prefix-cache hit rate is
    NaN (0/0) in windows where no request was admitted, which on a slow machine can be every
    window so far, so the range grows with the load until each panel has a value."""
    gaps: list = []

    def shown() -> bool:
        gaps[:] = dashboard_gaps(prom, start, time.time(), engines)
        return not gaps

    with contextlib.suppress(AssertionError):
        wait_for(shown, 60, "every panel to show the load", interval=SCRAPE_S)
    assert not gaps, gaps


def fired(prom: LabPrometheus, alert: str, label: str = "pod", window_s: int = 300) -> set[str]:
    """The `label` of each series `alert` fired for in the last `window_s` (the ALERTS series
    keeps a firing that has already resolved)."""
    expr = f'max_over_time(ALERTS{{alertname="{alert}",alertstate="firing"}}[{window_s}s])'
    return {s.labels.get(label, "") for s in prom.query(expr)}


def operator_pods(lab) -> list[dict]:
    return ready(lab.kube.pods(RELEASE_NS, "app.kubernetes.io/component=operator"))


def check_leader(lab, prom: LabPrometheus) -> None:
    """Every operator replica is scraped; exactly one says it leads: the Lease's holder."""
    up = prom.query(f'up{{job="{OPERATOR_JOB}"}} == 1')
    assert len(up) == OPERATORS, up
    (leader,) = prom.query(f"{OP}leader == 1")
    lease = lab.kube.get("coordination.k8s.io/v1", "Lease", RELEASE_NS, OPERATOR_JOB)
    assert leader.labels["pod"] == lease["spec"]["holderIdentity"], (leader, lease)
    assert len(prom.query(f"{OP}leader == 0")) == OPERATORS - 1


def pool_status(lab) -> dict:
    md = lab.kube.get(*MD, NS, NAME)
    return ((md.get("status") or {}).get("pools") or {}).get(POOL) or {}


def operator_pool(prom: LabPrometheus) -> dict[str, float]:
    """The operator's gauges of the pool, as Prometheus has them, under the status' keys."""
    labels = f'namespace="{NS}",pagefleet_io_deployment="{NAME}",pagefleet_io_pool="{POOL}"'
    found: dict[str, float] = {}
    for key, series in (
        ("desiredReplicas", "pool_desired_replicas"),
        ("readyReplicas", "pool_ready_replicas"),
        ("replicas", "pool_replicas"),
    ):
        samples = prom.query(f'{OP}{series}{{{labels},model_name="{MODEL}"}}')
        assert len(samples) <= 1, samples  # one series per pool (one reason at a time)
        if samples:
            found[key] = samples[0].value
            if key == "desiredReplicas":
                assert samples[0].labels["reason"] in REASONS, samples
    return found


def operator_agrees(lab, prom: LabPrometheus, desired: int) -> dict:
    """Wait until Prometheus' operator gauges of the pool equal its status (desired replicas
    `desired`, at a scrape after the status was read); the status."""

    def agreed():
        status = pool_status(lab)
        moment = time.time()
        lab.wait_for(lambda: prom.scraped_since(moment), 30, "a scrape after the status")
        seen = operator_pool(prom)
        wanted = {k: status.get(k) for k in ("desiredReplicas", "readyReplicas", "replicas")}
        return status if seen == wanted and status.get("desiredReplicas") == desired else None

    return lab.wait_for(agreed, 60, f"the operator's series to show desired {desired}")


def decisions(prom: LabPrometheus, direction: str, reason: str) -> float:
    """The builtin autoscaler's decisions of the pool counted in the scenario, by whichever
    replica led: each pod's highest count (a restarted pod counts from 0 again), summed."""
    labels = f'pagefleet_io_deployment="{NAME}",pagefleet_io_pool="{POOL}"'
    wanted = f'{labels},direction="{direction}",reason="{reason}"'
    counted = f"max_over_time({OP}autoscaler_decisions_total{{{wanted}}}[15m])"
    (total,) = prom.query(f"sum({counted}) or vector(0)")
    return total.value


def restarts(pods: list[dict]) -> int:
    return sum(c["restartCount"] for p in pods for c in p["status"]["containerStatuses"])


def mark(timings: dict[str, float], what: str, started: float) -> None:
    timings[what] = round(time.monotonic() - started, 1)
    print(f"metrics path: {what} at {timings[what]} s")


def kill_engine(pod: dict) -> None:
    status = pod["status"]["containerStatuses"][0]
    os.kill(int(status["containerID"].split("//")[1]), signal.SIGKILL)


def test_prometheus_scrapes_the_lab_and_every_shipped_query_answers(tmp_path, model_store):
    timings: dict[str, float] = {}
    started = time.monotonic()
    load, loading_seen, operator_restarts = Load(""), None, None
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NS)
        lab.kube.create_namespace(RELEASE_NS)
        prometheus_url = f"http://{lab.node_ip}:{PROMETHEUS_PORT}"
        monitors, rule_groups, chart = chart_objects(tmp_path, prometheus_url)
        configs = [config for monitor in monitors for config in scrape_configs(monitor)]
        prom = LabPrometheus(lab, configs, rule_groups)
        try:
            for obj in chart:
                lab.kube.create(obj)
            lab.kube.create(refused_deployment())
            md = deployment()
            lab.kube.create(md)
            triggers = keda_triggers(md, prom.url)
            assert set(triggers) == {"engines-waiting", "router-queued", "engines-running"}
            lab.wait_for(lambda: len(operator_pods(lab)) == OPERATORS, 90, "the operator pods")
            mark(timings, "operators", started)
            url = router_url(lab, NS, NAME)
            assert replicas(lab) == 0

            # At zero the router holds the requests; Prometheus sees its queue as the router
            # reports it, and the operator wakes the pool from Prometheus alone.
            load.url = url
            load_started = time.time()
            stop, workers = load.run(lab, clients=CLIENTS)
            lab.wait_for(
                lambda: direct_readings(lab)[0]["router-queued"] == CLIENTS,
                60,
                "every client's request held at the router",
            )
            reading = triggers_agree(lab, prom, triggers, "router-queued")
            assert reading["router-queued"][0] == CLIENTS
            lab.wait_for(lambda: replicas(lab) == 1, 60, "the operator to wake the pool")
            mark(timings, "woken", started)
            # The operator counted that one scale-up, and why; one replica of two leads.
            lab.wait_for(lambda: decisions(prom, "up", "wake") == 1, 30, "the wake counted")
            check_leader(lab, prom)

            # The engine serves with requests waiting: the engines' triggers agree with it,
            # and the operator's series with its status.
            reading = triggers_agree(lab, prom, triggers, "engines-waiting", timeout=60)
            assert reading["engines-running"][0] > 0
            (engine,) = ready(md_pods(lab, NS, NAME))
            name = engine["metadata"]["name"]
            serving = operator_agrees(lab, prom, desired=1)
            assert serving["readyReplicas"] == 1, serving
            mark(timings, "queued on the engine", started)

            # Killed, the engine fires its alert, for it alone. Before, nothing fired: not
            # while it loaded its model (Prometheus scrapes pods that are not ready yet).
            # The refused ModelDeployment fired its own, alone.
            assert not fired(prom, "PagefleetEngineDown")
            refusals = fired(prom, "PagefleetReconcileErrors", "pagefleet_io_deployment")
            assert refusals == {REFUSED}, refusals
            errors = prom.query(f'{OP}reconcile_errors_total{{reason="HostPathNotAllowed"}}')
            assert [e.labels["pagefleet_io_deployment"] for e in errors] == [REFUSED]
            # The ModelDeployment's namespace, not the operator pod's (the ServiceMonitor's
            # honorLabels); that of the operator's own series is the pod's.
            assert errors[0].labels["namespace"] == NS
            assert {s.labels["namespace"] for s in prom.query(f"{OP}leader")} == {RELEASE_NS}
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
            check_dashboard(prom, load_started, {name})
            mark(timings, "dashboard", started)

            # The load stops: the operator, reading Prometheus, returns the pool to zero, and
            # its series say so as its status does, with one scale-down counted.
            stop.set()
            for w in workers:
                w.result(timeout=120)
            lab.wait_for(lambda: replicas(lab) == 0, 90, "the operator to return to zero")
            lab.wait_for(lambda: not md_pods(lab, NS, NAME), 90, "the engine pods gone")
            operator_agrees(lab, prom, desired=0)
            assert decisions(prom, "down", "scale_to_zero") == 1
            assert decisions(prom, "up", "wake") == 1
            mark(timings, "zero", started)
            assert load.ok > 0
            operator_restarts = restarts(
                lab.kube.pods(RELEASE_NS, "app.kubernetes.io/component=operator")
            )
        finally:
            prom.close()
    print(
        f"metrics path: {timings}, {load.sent} requests sent, loading seen: {loading_seen}, "
        f"operator restarts: {operator_restarts}"
    )
