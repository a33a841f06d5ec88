"""Where the builtin autoscaler reads queue depth: each ready pod's /metrics (default), or a
Prometheus server's query API when the operator is given --prometheus-url; and the requests
the ModelDeployment's router holds for its model (the only demand visible at zero pods), from
the router pods' /metrics or the same Prometheus."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.common.metrics_text import parse_metrics
from pagefleet.operator.reconcile import ROUTER_PORT, queued_query, waiting_query

# The router's gauge of requests it holds per model (no engine ready, or all saturated).
QUEUED_REQUESTS = "pagefleet_router:queued_requests"


@dataclass(frozen=True)
class QueueReading:
    waiting: float
    running: float
    pods: int  # pods that answered (pod scraping) or ready pods (Prometheus)
    errors: int = 0  # reads that failed: pods that did not answer, or Prometheus' queries


@dataclass(frozen=True)
class PoolPods:
    """A pool's ready pods, as the API reports them."""

    namespace: str
    deployment: str  # the ModelDeployment's name
    pool: str
    model: str
    ips: tuple[str, ...]


def ready_pod_ips(pods: list[dict]) -> tuple[str, ...]:
    """IPs of pods whose Ready condition is True (others are starting or failing)."""
    ips = []
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not pod.get("metadata", {}).get("deletionTimestamp"):
            ips.append(status["podIP"])
    return tuple(sorted(ips))


def running_pod_ips(pods: list[dict]) -> tuple[str, ...]:
    """IPs of pods that run, ready or not: the router is unready while no engine is healthy
    (its /health), which is exactly when its queue must be read."""
    ips = []
    for pod in pods:
        status = pod.get("status") or {}
        gone = pod.get("metadata", {}).get("deletionTimestamp")
        if status.get("podIP") and status.get("phase", "Running") == "Running" and not gone:
            ips.append(status["podIP"])
    return tuple(sorted(ips))


@dataclass(frozen=True)
class RouterQueue:
    queued: float  # requests held for the model, summed over router replicas
    read: bool  # False: router pods run but none answered (the queue is unknown)
    errors: int = 0  # reads that failed: router pods that did not answer, or the query


@dataclass(frozen=True)
class RouterPods:
    """The ModelDeployment's router pods, as the API reports them."""

    namespace: str
    deployment: str  # the ModelDeployment's name
    model: str
    ips: tuple[str, ...]


def queued_requests(text: str, model: str) -> float:
    """The router's queued requests for `model` on one /metrics page (0 when absent: a
    router that never queued for it). Raises ValueError on a page that does not parse."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == QUEUED_REQUESTS and sample.labels.get("model") == model:
                total += sample.value
    return total


def _url(ip: str, port: int, path: str) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{path}"


@dataclass(frozen=True)
class PodScraper:
    """GET http://<podIP>:<port>/metrics of every ready pod; pods that fail are left out
    (the autoscaler averages over the pods that answered, as the HPA does)."""

    port: int = 8000
    timeout: float = 2.0

    def read(self, pods: PoolPods) -> QueueReading:
        waiting = running = 0.0
        answered = 0
        with httpx.Client(timeout=self.timeout) as client:
            for ip in pods.ips:
                try:
                    response = client.get(_url(ip, self.port, "/metrics"))
                    response.raise_for_status()
                    gauges = parse_metrics(response.text)
                except (httpx.HTTPError, ValueError):
                    continue
                waiting += float(gauges["waiting"])
                running += float(gauges["running"])
                answered += 1
        return QueueReading(waiting, running, answered, len(pods.ips) - answered)


@dataclass(frozen=True)
class PrometheusSource:
    """Instant queries against Prometheus' HTTP API for the pool's summed gauges."""

    url: str
    timeout: float = 5.0

    def _query(self, client: httpx.Client, query: str) -> float:
        response = client.get(f"{self.url.rstrip('/')}/api/v1/query", params={"query": query})
        response.raise_for_status()
        result = response.json()["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    def read(self, pods: PoolPods) -> QueueReading:
        waiting_q = waiting_query(pods.namespace, pods.deployment, pods.pool, pods.model)
        running_q = waiting_q.replace("num_requests_waiting", "num_requests_running")
        try:
            with httpx.Client(timeout=self.timeout) as client:
                waiting = self._query(client, waiting_q)
                running = self._query(client, running_q)
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            return QueueReading(0.0, 0.0, 0, 1)  # no data: the autoscaler holds
        return QueueReading(waiting, running, len(pods.ips))

    def read_queue(self, router: RouterPods) -> RouterQueue:
        query = queued_query(router.namespace, router.deployment, router.model)
        try:
            with httpx.Client(timeout=self.timeout) as client:
                return RouterQueue(self._query(client, query), True)
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            return RouterQueue(0.0, False, 1)


@dataclass(frozen=True)
class RouterScraper:
    """GET http://<podIP>:<port>/metrics of every running router pod, summing their queues
    (each replica holds its own). No router pod: nothing can be queued. Pods that fail are
    left out; none answering leaves the queue unknown."""

    port: int = ROUTER_PORT
    timeout: float = 2.0

    def read_queue(self, router: RouterPods) -> RouterQueue:
        if not router.ips:
            return RouterQueue(0.0, True)
        queued, answered = 0.0, 0
        with httpx.Client(timeout=self.timeout) as client:
            for ip in router.ips:
                try:
                    response = client.get(_url(ip, self.port, "/metrics"))
                    response.raise_for_status()
                    queued += queued_requests(response.text, router.model)
                except (httpx.HTTPError, ValueError):
                    continue
                answered += 1
        return RouterQueue(queued, answered > 0, len(router.ips) - answered)
