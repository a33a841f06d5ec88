"""How the operator reads the router's queue (operator/metrics_source.py): which router pods,
summed over replicas, for its own model only, and "unknown" (never "empty") when no router
answers, from pods or from Prometheus."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlparse

from test_operator_metrics import http_server, pod

from pagefleet.operator.metrics_source import (
    PrometheusSource,
    RouterPods,
    RouterQueue,
    RouterScraper,
    queued_requests,
    running_pod_ips,
)
from server_utils import free_port

PAGE = (
    "# TYPE pagefleet_router:queued_requests gauge\n"
    'pagefleet_router:queued_requests{model="m"} 3\n'
    'pagefleet_router:queued_requests{model="other"} 40\n'
    "# TYPE pagefleet_router:oldest_queued_seconds gauge\n"
    'pagefleet_router:oldest_queued_seconds{model="m"} 12.5\n'
)


def test_router_pods_are_read_ready_or_not_but_running():
    """The router is unready while no engine is healthy: exactly when its queue matters."""
    pods = [pod("10.0.0.2", True), pod("10.0.0.1", False), pod(None, False)]
    pods += [pod("10.0.0.4", True, deleting=True)]
    pending = pod("10.0.0.5", False)
    pending["status"]["phase"] = "Pending"
    assert running_pod_ips([*pods, pending]) == ("10.0.0.1", "10.0.0.2")


def test_the_models_own_gauge_is_read():
    """Fails for: another model's queue (or another gauge) counted, or a page without the
    gauge (a router that never queued) read as anything but 0."""
    assert queued_requests(PAGE, "m") == 3.0
    assert queued_requests("# nothing queued yet\n", "m") == 0.0


def test_router_replicas_sum_and_none_answering_is_unknown():
    """Each router replica holds its own queue: summed. None answering: unknown, which keeps
    a pool from scaling to 0. No router pod at all: nothing can be queued."""
    with http_server(lambda path, q: (200, PAGE) if path == "/metrics" else (404, "")) as (
        port,
        seen,
    ):
        scraper = RouterScraper(port=port, timeout=1.0)
        two = RouterPods("serving", "llama", "m", ("127.0.0.1", "127.0.0.1"))
        assert scraper.read_queue(two) == RouterQueue(6.0, True)
        # 127.0.0.2 on the same port: nothing listens there.
        one_dead = RouterPods("serving", "llama", "m", ("127.0.0.1", "127.0.0.2"))
        assert scraper.read_queue(one_dead) == RouterQueue(3.0, True, errors=1)
    assert seen == ["/metrics"] * 3
    dead = RouterScraper(port=free_port(), timeout=1.0)
    assert dead.read_queue(RouterPods("serving", "llama", "m", ("127.0.0.1",))) == RouterQueue(
        0.0, False, errors=1
    )
    assert dead.read_queue(RouterPods("serving", "llama", "m", ())) == RouterQueue(0.0, True)


def test_prometheus_reads_the_routers_queue_for_the_model():
    def respond(path, query):
        result = [{"metric": {}, "value": [1700000000.0, "2"]}]
        return 200, json.dumps({"status": "success", "data": {"result": result}})

    with http_server(respond) as (port, seen):
        source = PrometheusSource(f"http://127.0.0.1:{port}")
        queue = source.read_queue(RouterPods("serving", "llama", "llama-3-8b", ()))
    assert queue == RouterQueue(2.0, True)
    assert parse_qs(urlparse(seen[0]).query)["query"][0] == (
        'sum(pagefleet_router:queued_requests{namespace="serving",pod=~"llama-router-.*",'
        'model="llama-3-8b"})'
    )
    down = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    assert down.read_queue(RouterPods("serving", "llama", "m", ())) == RouterQueue(0.0, False, 1)
