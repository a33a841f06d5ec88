"""The lab's stand-ins for the Prometheus Operator and Kubernetes discovery, checked without a
lab: the scrape config made of the chart's ServiceMonitor, run through the real Prometheus
relabeling (`promtool check service-discovery`) on the targets `role: endpoints` discovery
makes of an engine Service, gives exactly the engines' HTTP ports with the labels the dashboard
and the alerts group by; and a ServiceMonitor field the translator does not read is refused."""

from __future__ import annotations

import copy
import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from prometheus_tools import prometheus_binaries

from .fleet import HELM, helm_template
from .prometheus import endpoints_targets, with_lab_discovery
from .servicemonitor import UnsupportedField, scrape_configs

NS = "serving"


@pytest.fixture(scope="module")
def monitors(tmp_path_factory) -> dict[str, dict]:
    """The chart's ServiceMonitors by name."""
    assert HELM  # installed by `make test` (the helm target) or tests/test_helm_chart.py
    values = tmp_path_factory.mktemp("values") / "values.yaml"
    values.write_text(yaml.safe_dump({"serviceMonitor": {"enabled": True}}))
    docs = helm_template("pf", NS, values)
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}


@pytest.fixture(scope="module")
def monitor(monitors) -> dict:
    """The engines' and routers'."""
    return monitors["pf-pagefleet"]


def engine_pod(name: str, ip: str, ready: bool, phase: str = "Running") -> dict:
    labels = {
        "app.kubernetes.io/component": "engine",
        "pagefleet.io/deployment": "llama",
        "pagefleet.io/model": "llama-3-8b",
        "pagefleet.io/pool": "colocated",
        "pagefleet.io/role": "both",
    }
    ports = [("http", 8000), ("kv-events", 5557), ("kv-transfer", 5600)]
    container = {
        "name": "engine",
        "image": "ghcr.io/pagefleet/pagefleet:0.1.0",
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
    }
    return {
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "labels": labels},
        "spec": {"nodeName": "node-a", "containers": [container]},
        "status": {
            "phase": phase,
            "podIP": ip,
            "hostIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": str(ready)}],
        },
    }


def service(name: str, component: str = "engine") -> dict:
    labels = {
        "app.kubernetes.io/name": "pagefleet",
        "app.kubernetes.io/managed-by": "pagefleet-operator",
        "app.kubernetes.io/component": component,
        "pagefleet.io/deployment": "llama",
    }
    return {"metadata": {"name": name, "namespace": NS, "labels": labels}}


def endpoints(name: str, pods: list[dict]) -> dict:
    def address(pod):
        ref = {"kind": "Pod", "name": pod["metadata"]["name"], "namespace": NS}
        return {"ip": pod["status"]["podIP"], "targetRef": ref}

    ready = [p for p in pods if p["status"]["conditions"][0]["status"] == "True"]
    subset = {
        "addresses": [address(p) for p in ready],
        "notReadyAddresses": [address(p) for p in pods if p not in ready],
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
    }
    return {"metadata": {"name": name, "namespace": NS}, "subsets": [subset]}


def relabeled(monitor: dict, groups: list[dict], tmp_path) -> list[dict]:
    """The targets Prometheus keeps for the monitor's job after its relabelings (their
    labels, and __address__), with discovery answering `groups`: promtool runs the real
    discovery and relabeling."""
    body = json.dumps(groups).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (config,) = with_lab_discovery(
            scrape_configs(monitor), f"http://127.0.0.1:{server.server_port}"
        )
        path = tmp_path / "prometheus.yaml"
        path.write_text(yaml.safe_dump({"scrape_configs": [config]}))
        promtool = prometheus_binaries()["promtool"]
        # promtool reports what discovery found within --timeout: one answer is all there is.
        argv = [str(promtool), "check", "service-discovery", "--timeout=3s"]
        out = subprocess.run(
            [*argv, str(path), config["job_name"]], capture_output=True, text=True, timeout=60
        )
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr
    return [
        {k: v for k, v in t["labels"].items() if not k.startswith("__") or k == "__address__"}
        for t in json.loads(out.stdout)
        if t.get("labels")
    ]


def test_the_operators_relabelings_keep_the_engines_http_ports_with_the_grouping_labels(
    monitor, tmp_path
):
    engines = [
        engine_pod("llama-colocated-a", "10.1.0.2", ready=True),
        engine_pod("llama-colocated-b", "10.1.0.3", ready=False),  # loading: scraped too
        engine_pod("llama-colocated-c", "10.1.0.4", ready=False, phase="Succeeded"),
    ]
    other = [engine_pod("llama-download-a", "10.1.0.5", ready=True)]
    targets = [
        *endpoints_targets(
            endpoints("llama-colocated", engines),
            service("llama-colocated"),
            {p["metadata"]["name"]: p for p in engines},
        ),
        # A Service of another component, and Endpoints without a Service: not selected.
        *endpoints_targets(
            endpoints("llama-download", other),
            service("llama-download", "download"),
            {p["metadata"]["name"]: p for p in other},
        ),
        *endpoints_targets(endpoints("orphan", other), None, {}),
    ]
    # Discovery offers every container port of the pods it resolves; only http is kept.
    assert len(targets) == 3 * 3 + 3 + 1
    groups = [{"targets": [t.pop("__address__")], "labels": t} for t in targets]
    kept = relabeled(monitor, groups, tmp_path)
    common = {
        "namespace": NS,
        "service": "llama-colocated",
        "job": "llama-colocated",
        "container": "engine",
        "endpoint": "http",
        "pagefleet_io_deployment": "llama",
        "pagefleet_io_model": "llama-3-8b",
        "pagefleet_io_pool": "colocated",
        "pagefleet_io_role": "both",
    }
    assert sorted(kept, key=lambda t: t["pod"]) == [
        {**common, "pod": f"llama-colocated-{x}", "instance": ip, "__address__": ip}
        for x, ip in (("a", "10.1.0.2:8000"), ("b", "10.1.0.3:8000"))
    ]


@pytest.mark.parametrize(
    ("where", "field"),
    [("spec", "sampleLimit"), ("endpoint", "metricRelabelings"), ("endpoint", "relabelings")],
)
def test_a_field_the_translator_does_not_read_is_refused(monitor, where, field):
    changed = copy.deepcopy(monitor)
    target = changed["spec"] if where == "spec" else changed["spec"]["endpoints"][0]
    target[field] = [] if field.endswith("abelings") else 100
    with pytest.raises(UnsupportedField, match=field):
        scrape_configs(changed)


def test_the_operators_monitor_keeps_its_own_labels_on_its_metrics_port(monitors):
    """The operator's ServiceMonitor translates whole (no field left out) into a job that
    honours the operator's labels (its series name the ModelDeployment's namespace) and keeps
    only the port named metrics of the chart's operator Service."""
    assert set(monitors) == {"pf-pagefleet", "pf-pagefleet-operator"}
    (config,) = scrape_configs(monitors["pf-pagefleet-operator"])
    assert config["honor_labels"] is True
    assert config["kubernetes_sd_configs"] == [{"role": "endpoints", "namespaces": {"names": [NS]}}]
    relabel = config["relabel_configs"]
    assert {
        "action": "keep",
        "source_labels": ["__meta_kubernetes_endpoint_port_name"],
        "regex": "metrics",
    } in relabel
    kept = {tuple(r["source_labels"]): r["regex"] for r in relabel if r.get("action") == "keep"}
    component = (
        "__meta_kubernetes_service_label_app_kubernetes_io_component",
        "__meta_kubernetes_service_labelpresent_app_kubernetes_io_component",
    )
    assert kept[component] == "(operator);true"
