"""The operator's own Prometheus metrics: what a user alerts and graphs on. Per ModelDeployment,
reconciles and their errors and failed queue reads; per pool, the workload's replicas, its ready
replicas and the desired replicas with the reason for that number, and the builtin autoscaler's
decisions; per process, whether it leads. Every label value comes from a closed set, the
ModelDeployment's and its pools' names aside, and a ModelDeployment's series go when it goes.

The series carry the label names the chart's ServiceMonitor gives the engines' series
(`namespace`, `pagefleet_io_deployment`, `pagefleet_io_pool`, `model_name`), so that one query
joins the two; the chart scrapes the operator with honorLabels, as kube-state-metrics is
scraped. The HTTP shell (`MetricsServer`) is at the end."""

from __future__ import annotations

import enum
import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagefleet.operator.autoscale import ScaleReason
from pagefleet.operator.status import PoolObserved

log = logging.getLogger("pagefleet.operator.metrics")

PREFIX = "pagefleet_operator:"
MD_LABELS = ("namespace", "pagefleet_io_deployment")
POOL_LABELS = (*MD_LABELS, "pagefleet_io_pool", "model_name")
# A reconcile's duration: mostly API round trips (and pod scrapes on autoscaling passes).
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A reconcile that raised, by what: the API refused or failed, or anything else (a bug).
API_ERROR, UNEXPECTED = "ApiError", "Unexpected"


class ReadSource(enum.StrEnum):
    """Where a queue read failed."""

    ENGINE_PODS = "engine_pods"  # an engine pod's /metrics
    ROUTER_PODS = "router_pods"  # a router (or Endpoint Picker) pod's /metrics
    PROMETHEUS = "prometheus"  # a query to --prometheus-url


@dataclass
class _Books:
    """Everything the series are read from, keyed by (namespace, ModelDeployment, ...)."""

    reconciles: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    decisions: Counter[tuple[str, str, str, str, str]] = field(default_factory=Counter)
    read_errors: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    # (namespace, name) -> (model name, its pools as last seen)
    pools: dict[tuple[str, str], tuple[str, tuple[PoolObserved, ...]]] = field(default_factory=dict)

    def keep(self, wanted: Callable[[tuple[str, str]], bool]) -> None:
        """Drop every series of the ModelDeployments (namespace, name) not `wanted`."""
        for book in (self.reconciles, self.errors, self.decisions, self.read_errors, self.pools):
            for key in [k for k in book if not wanted(k[:2])]:
                del book[key]


def direction(current: int, desired: int) -> str:
    return "up" if desired > current else "down" if desired < current else "hold"


class OperatorMetrics:
    """One operator's metrics registry. Reconciles run in threads: every update takes the
    lock, and a scrape reads a consistent copy."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.leader = False  # set while this process holds the Lease and acts
        self._lock = threading.Lock()
        self._books = _Books()
        self.duration = Histogram(
            PREFIX + "reconcile_duration_seconds",
            "Seconds one reconcile of a ModelDeployment took (periodic passes include the "
            "autoscaler's queue reads).",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)
        self.registry.register(_Collector(self))

    def reconciled(self, namespace: str, name: str, error: str | None, seconds: float) -> None:
        """A reconcile of the ModelDeployment ended; `error` is its Degraded reason, or what it
        raised (API_ERROR, UNEXPECTED), None when it went through."""
        self.duration.observe(seconds)
        with self._lock:
            self._books.reconciles[namespace, name] += 1
            if error is not None:
                self._books.errors[namespace, name, error] += 1

    def observed(
        self, namespace: str, name: str, model: str, pools: tuple[PoolObserved, ...]
    ) -> None:
        """The pools as a reconcile saw them; they replace what an earlier one saw (a pool
        gone from the spec goes from the series)."""
        with self._lock:
            self._books.pools[namespace, name] = (model, pools)

    def decided(
        self, namespace: str, name: str, pool: str, current: int, desired: int, why: ScaleReason
    ) -> None:
        """One builtin autoscaler evaluation of a pool."""
        with self._lock:
            self._books.decisions[namespace, name, pool, direction(current, desired), why] += 1

    def read_failed(self, namespace: str, name: str, source: ReadSource, count: int) -> None:
        if count:
            with self._lock:
                self._books.read_errors[namespace, name, source] += count

    def keep_only(self, keys: Iterable[tuple[str, str]]) -> None:
        """Drop the series of ModelDeployments other than these (namespace, name)."""
        kept = set(keys)
        with self._lock:
            self._books.keep(kept.__contains__)

    def forget(self, namespace: str, name: str) -> None:
        """Drop the series of a ModelDeployment that is gone."""
        with self._lock:
            self._books.keep(lambda key: key != (namespace, name))

    def books(self) -> _Books:
        """A copy of the books, to read without the lock."""
        with self._lock:
            b = self._books
            return _Books(
                Counter(b.reconciles),
                Counter(b.errors),
                Counter(b.decisions),
                Counter(b.read_errors),
                dict(b.pools),
            )

    def page(self) -> bytes:
        """The Prometheus text page."""
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: OperatorMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        books = self.metrics.books()
        leader = GaugeMetricFamily(
            PREFIX + "leader",
            "1 while this operator process holds the leader Lease and acts (or runs without "
            "leader election), else 0.",
        )
        leader.add_metric([], 1.0 if self.metrics.leader else 0.0)
        yield leader
        yield _counter(
            "reconciles",
            "Reconciles of each ModelDeployment (on changes and on each periodic pass).",
            MD_LABELS,
            books.reconciles,
        )
        yield _counter(
            "reconcile_errors",
            "Reconciles that ended with the ModelDeployment Degraded (reason: the condition's) "
            "or raised (ApiError, Unexpected).",
            (*MD_LABELS, "reason"),
            books.errors,
        )
        yield _counter(
            "autoscaler_decisions",
            "Builtin autoscaler evaluations of a pool: direction up, down or hold, and the "
            "reason for the number (as pool_desired_replicas' reason).",
            (*MD_LABELS, "pagefleet_io_pool", "direction", "reason"),
            books.decisions,
        )
        yield _counter(
            "queue_read_errors",
            "Failed reads of the queues the builtin autoscaler scales on: engine pods or router "
            "pods that did not answer, or Prometheus queries that failed.",
            (*MD_LABELS, "source"),
            books.read_errors,
        )
        yield from _pool_gauges(books.pools)


def _counter(
    name: str, documentation: str, labels: tuple[str, ...], counts: Counter
) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, documentation, labels=list(labels))
    for key, count in sorted(counts.items()):
        family.add_metric(list(key), count)
    return family


def _pool_gauges(pools: dict[tuple[str, str], tuple[str, tuple[PoolObserved, ...]]]):
    replicas = GaugeMetricFamily(
        PREFIX + "pool_replicas",
        "spec.replicas of each pool's Deployment (or LeaderWorkerSet).",
        labels=list(POOL_LABELS),
    )
    ready = GaugeMetricFamily(
        PREFIX + "pool_ready_replicas",
        "Ready replicas of each pool's Deployment (ready groups of a LeaderWorkerSet).",
        labels=list(POOL_LABELS),
    )
    desired = GaugeMetricFamily(
        PREFIX + "pool_desired_replicas",
        "The replicas the operator wants for each pool (as status.pools.<pool>."
        "desiredReplicas), with the reason for that number: " + ", ".join(ScaleReason) + ".",
        labels=[*POOL_LABELS, "reason"],
    )
    for (namespace, name), (model, figures) in sorted(pools.items()):
        for pool in figures:
            labels = [namespace, name, pool.name, model]
            replicas.add_metric(labels, pool.replicas)
            ready.add_metric(labels, pool.ready)
            desired.add_metric([*labels, pool.cause], pool.desired)
    return replicas, ready, desired


# --- the HTTP shell ----------------------------------------------------------------------------


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics and nothing else; one request per connection (HTTP/1.0), and a client
    that stalls is dropped after `timeout` seconds."""

    timeout = 10
    metrics: OperatorMetrics

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404)
            return
        body = self.metrics.page()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # a line per scrape otherwise
        pass


def parse_bind_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (controller-runtime's --metrics-bind-address): `:8080` is every IPv4
    interface, `[::]:8080` every IPv6 one."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    host = host.removeprefix("[").removesuffix("]") if host.startswith("[") else host
    return host or "0.0.0.0", int(port)


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """/metrics on its own threads: it answers while the process waits for the Lease, and
    kopf's shutdown (which stops every task it did not start) never waits on it."""

    def __init__(self, metrics: OperatorMetrics, address: tuple[str, int]) -> None:
        handler = type("Handler", (_MetricsHandler,), {"metrics": metrics})
        server_class = _IPv6Server if ":" in address[0] else ThreadingHTTPServer
        self.server = server_class(address, handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> MetricsServer:
        self.thread.start()
        log.info("metrics on %s:%d/metrics", *self.server.server_address[:2])
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
