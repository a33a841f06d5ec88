"""A real Prometheus in the lab: the `prometheus` binary (Debian's build, installed by
scripts/install_prometheus.py) on the node, scraping pods at their IPs with the scrape configs
the Prometheus Operator generates from a ServiceMonitor (servicemonitor.py) and evaluating
rule files, plus what scenarios ask it through its HTTP API.

Debian builds Prometheus without its Kubernetes service discovery (no client-go), so the lab
stands in for that one piece: an HTTP service discovery endpoint on the node answers with the
targets and `__meta_kubernetes_*` labels that Prometheus' `role: endpoints` discovery derives
from the API's Endpoints, Services and Pods (its discovery/kubernetes/endpoints.go). The
Operator's relabelings, the scraping, the storage, PromQL and the rules run unchanged.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse, urlsplit

import httpx
import yaml
from prometheus_tools import prometheus_binaries

from .lab import Lab
from .servicemonitor import sanitize

PROMETHEUS_PORT, DISCOVERY_PORT = 9090, 9091
META = "__meta_kubernetes_"


def _object_labels(prefix: str, meta: dict) -> dict[str, str]:
    out = {}
    for kind, values in (("label", meta.get("labels")), ("annotation", meta.get("annotations"))):
        for key, value in (values or {}).items():
            out[f"{META}{prefix}_{kind}_{sanitize(key)}"] = value
            out[f"{META}{prefix}_{kind}present_{sanitize(key)}"] = "true"
    return out


def pod_labels(pod: dict) -> dict[str, str]:
    """The labels Prometheus attaches to every target backed by `pod`."""
    meta, status = pod["metadata"], pod.get("status") or {}
    ready = next(
        (c["status"] for c in status.get("conditions") or [] if c["type"] == "Ready"), "Unknown"
    )
    out = {
        f"{META}pod_name": meta["name"],
        f"{META}pod_ip": status.get("podIP", ""),
        f"{META}pod_ready": ready.lower(),
        f"{META}pod_phase": status.get("phase", ""),
        f"{META}pod_node_name": pod["spec"].get("nodeName", ""),
        f"{META}pod_host_ip": status.get("hostIP", ""),
        f"{META}pod_uid": meta.get("uid", ""),
    }
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if owner:
        out[f"{META}pod_controller_kind"] = owner["kind"]
        out[f"{META}pod_controller_name"] = owner["name"]
    return {**out, **_object_labels("pod", meta)}


def _container_labels(container: dict, port: dict) -> dict[str, str]:
    return {
        f"{META}pod_container_name": container["name"],
        f"{META}pod_container_image": container.get("image", ""),
        f"{META}pod_container_port_name": port.get("name", ""),
        f"{META}pod_container_port_number": str(port["containerPort"]),
        f"{META}pod_container_port_protocol": port.get("protocol", "TCP"),
    }


def endpoints_targets(
    endpoints: dict, service: dict | None, pods: dict[str, dict]
) -> list[dict[str, str]]:
    """Label sets (`__address__` included) of the targets `role: endpoints` discovery makes of
    one Endpoints object: one per address and port (ready or not), then one per container
    port of those pods that no endpoint port covered. `pods` by name, in its namespace."""
    meta = endpoints["metadata"]
    common = {f"{META}namespace": meta["namespace"], f"{META}endpoints_name": meta["name"]}
    if service is not None:
        common[f"{META}service_name"] = service["metadata"]["name"]
        common.update(_object_labels("service", service["metadata"]))
    common.update(_object_labels("endpoints", meta))
    targets: list[dict[str, str]] = []
    covered: dict[str, set[int]] = {}
    for subset in endpoints.get("subsets") or []:
        for port in subset.get("ports") or []:
            for ready, key in (("true", "addresses"), ("false", "notReadyAddresses")):
                for address in subset.get(key) or []:
                    target = {
                        "__address__": f"{address['ip']}:{port['port']}",
                        f"{META}endpoint_port_name": port.get("name", ""),
                        f"{META}endpoint_port_protocol": port.get("protocol", "TCP"),
                        f"{META}endpoint_ready": ready,
                    }
                    if address.get("hostname"):
                        target[f"{META}endpoint_hostname"] = address["hostname"]
                    ref = address.get("targetRef") or {}
                    if ref:
                        target[f"{META}endpoint_address_target_kind"] = ref["kind"]
                        target[f"{META}endpoint_address_target_name"] = ref["name"]
                    pod = pods.get(ref.get("name", "")) if ref.get("kind") == "Pod" else None
                    if pod is not None:
                        target.update(pod_labels(pod))
                        for container in pod["spec"]["containers"]:
                            found = [
                                p
                                for p in container.get("ports") or []
                                if p["containerPort"] == port["port"]
                            ]
                            if found:
                                target.update(_container_labels(container, found[0]))
                                break
                        covered.setdefault(pod["metadata"]["name"], set()).add(port["port"])
                    targets.append({**common, **target})
    for name, ports in covered.items():
        pod = pods[name]
        for container in pod["spec"]["containers"]:
            for port in container.get("ports") or []:
                if port["containerPort"] not in ports and pod["status"].get("podIP"):
                    targets.append(
                        {
                            **common,
                            "__address__": f"{pod['status']['podIP']}:{port['containerPort']}",
                            **pod_labels(pod),
                            **_container_labels(container, port),
                        }
                    )
    return targets


def discovered(lab: Lab, namespaces: list[str] | None) -> list[dict]:
    """HTTP service discovery's answer: a target group per target (each has its own labels)."""
    groups = []
    for ns in namespaces or [n["metadata"]["name"] for n in lab.kube.list("v1", "Namespace")]:
        services = {s["metadata"]["name"]: s for s in lab.kube.list("v1", "Service", ns)}
        pods = {p["metadata"]["name"]: p for p in lab.kube.pods(ns)}
        for endpoints in lab.kube.list("v1", "Endpoints", ns):
            service = services.get(endpoints["metadata"]["name"])
            for target in endpoints_targets(endpoints, service, pods):
                address = target.pop("__address__")
                groups.append({"targets": [address], "labels": target})
    return groups


def with_lab_discovery(configs: list[dict], discovery_url: str) -> list[dict]:
    """The scrape configs with Kubernetes discovery (`role: endpoints`) answered by the lab's
    discovery endpoint, for the same namespaces; everything else as generated."""
    out = []
    for config in configs:
        config = dict(config)
        http_sd = []
        for sd in config.pop("kubernetes_sd_configs"):
            assert sd["role"] == "endpoints", sd
            names = (sd.get("namespaces") or {}).get("names")
            query = f"?namespaces={','.join(names)}" if names else ""
            http_sd.append({"url": f"{discovery_url}/endpoints{query}", "refresh_interval": "1s"})
        config["http_sd_configs"] = http_sd
        out.append(config)
    return out


class _DiscoveryHandler(BaseHTTPRequestHandler):
    lab: Lab

    def do_GET(self) -> None:
        url = urlparse(self.path)
        names = parse_qs(url.query).get("namespaces")
        if url.path != "/endpoints":
            self.send_error(404)
            return
        body = json.dumps(discovered(self.lab, names[0].split(",") if names else None)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # Prometheus gave up
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # one line per second otherwise
        pass


@dataclass
class Sample:
    labels: dict[str, str]
    value: float


class LabPrometheus:
    """`prometheus` on the node at NODE_IP:9090, its discovery endpoint at :9091, and its API.

    scrape_configs: as the Prometheus Operator generates them (servicemonitor.py); rules: the
    `groups` of rule files (a PrometheusRule's spec), evaluated every `evaluation_interval`."""

    def __init__(
        self,
        lab: Lab,
        scrape_configs: list[dict],
        rule_groups: list[dict] | None = None,
        evaluation_interval: str = "1s",
    ) -> None:
        self.lab = lab
        self.url = f"http://{lab.node_ip}:{PROMETHEUS_PORT}"
        discovery = f"http://{lab.node_ip}:{DISCOVERY_PORT}"
        root = lab.root / "prometheus"
        root.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "global": {"evaluation_interval": evaluation_interval},
            "scrape_configs": with_lab_discovery(scrape_configs, discovery),
        }
        if rule_groups:
            (root / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}))
            config["rule_files"] = [str(root / "rules.yaml")]
        (root / "prometheus.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        handler = type("Handler", (_DiscoveryHandler,), {"lab": lab})
        # Created in the lab's namespace, so it listens there whichever thread serves it.
        self._discovery = lab.in_lab(ThreadingHTTPServer, (lab.node_ip, DISCOVERY_PORT), handler)
        threading.Thread(target=self._discovery.serve_forever, daemon=True).start()
        argv = [
            str(prometheus_binaries()["prometheus"]),
            f"--config.file={root / 'prometheus.yaml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address={lab.node_ip}:{PROMETHEUS_PORT}",
        ]
        self.process = lab.start_process("prometheus", argv)
        lab.wait_for(self._ready, 60, "Prometheus ready")

    def close(self) -> None:
        self.lab.stop_process(self.process)
        self._discovery.shutdown()
        self._discovery.server_close()

    def _ready(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return self.lab.in_lab(httpx.get, f"{self.url}/-/ready", timeout=5).status_code == 200
        return False

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/PATH; its `data`."""
        r = self.lab.in_lab(httpx.get, f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        """An instant vector (a scalar result comes back as one sample without labels)."""
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        data = self.api("query", **params)
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]))]
        return [Sample(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query_range(
        self, expr: str, start: float, end: float, step: float
    ) -> list[tuple[dict[str, str], list[float]]]:
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        return [(r["metric"], [float(v) for _, v in r["values"]]) for r in data["result"]]

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def scraped_since(
        self, moment: float, pool: str | None = None, hosts: Iterable[str] = ()
    ) -> bool:
        """Every active target (of scrape pool `pool`, if given) scraped after the Unix time
        `moment` (its last scrape started then or later), and among them a target on each of
        `hosts`: a pod read directly may not be discovered yet, and its series would be missing."""
        found = [t for t in self.targets() if pool is None or t["scrapePool"] == pool]
        seen = {urlsplit(t["scrapeUrl"]).hostname for t in found}
        fresh = all(_unix(t["lastScrape"]) >= moment for t in found)
        return bool(found) and fresh and set(hosts) <= seen

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]


def _unix(rfc3339: str) -> float:
    """Prometheus' timestamps (RFC 3339 with up to nanoseconds) as Unix seconds."""
    found = re.fullmatch(r"([^.]+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", rfc3339)
    assert found, rfc3339
    zone = "+00:00" if found[3] == "Z" else found[3]
    return datetime.fromisoformat(found[1] + zone).timestamp() + float(f"0.{found[2] or 0}")
