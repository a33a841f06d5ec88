"""Where the builtin autoscaler reads queue depth: each ready pod's /metrics (default), or a
Prometheus server's query API when the operator is given --prometheus-url."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from pagefleet.common.metrics_text import parse_metrics
from pagefleet.operator.reconcile import waiting_query


@dataclass(frozen=True)
class QueueReading:
    waiting: float
    running: float
    pods: int  # pods that answered (pod scraping) or ready pods (Prometheus)


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
                host = f"[{ip}]" if ":" in ip else ip
                try:
                    response = client.get(f"http://{host}:{self.port}/metrics")
                    response.raise_for_status()
                    gauges = parse_metrics(response.text)
                except (httpx.HTTPError, ValueError):
                    continue
                waiting += float(gauges["waiting"])
                running += float(gauges["running"])
                answered += 1
        return QueueReading(waiting, running, answered)


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
            return QueueReading(0.0, 0.0, 0)  # no data: the autoscaler holds
        return QueueReading(waiting, running, len(pods.ips))
