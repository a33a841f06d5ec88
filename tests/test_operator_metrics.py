"""Where the autoscaler reads queues (pods' /metrics, Prometheus), how status is summarised,
and when an owned object counts as drifted."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from pagefleet.operator.handlers import (
    LAST_APPLIED,
    contains,
    last_applied,
    merge_diff,
    removals,
    with_last_applied,
)
from pagefleet.operator.metrics_source import (
    PodScraper,
    PoolPods,
    PrometheusSource,
    QueueReading,
    ready_pod_ips,
)
from pagefleet.operator.status import Observed, PoolObserved, build_status
from server_utils import free_port


@contextmanager
def http_server(respond) -> Iterator[tuple[int, list[str]]]:
    """127.0.0.1 server answering GETs with respond(path, query) -> (status, body)."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            seen.append(self.path)
            status, body = respond(url.path, parse_qs(url.query))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()


def pod(ip: str | None, ready: bool, deleting: bool = False) -> dict:
    meta = {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {}
    status = {"conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_only_ready_running_pods_are_read():
    pods = [
        pod("10.0.0.2", True),
        pod("10.0.0.1", True),
        pod("10.0.0.3", False),
        pod(None, True),
        pod("10.0.0.4", True, deleting=True),
    ]
    assert ready_pod_ips(pods) == ("10.0.0.1", "10.0.0.2")


def test_pod_scraper_sums_answering_pods_and_skips_dead_ones():
    metrics = (
        'vllm:num_requests_waiting{model_name="m"} 6\nvllm:num_requests_running{model_name="m"} 3\n'
    )
    with http_server(lambda path, q: (200, metrics) if path == "/metrics" else (404, "")) as (
        port,
        seen,
    ):
        # 127.0.0.1 answers; 127.0.0.2 (same port, nothing listening there) does not.
        pods = PoolPods("ns", "llama", "decode", "m", ("127.0.0.1", "127.0.0.2"))
        reading = PodScraper(port=port, timeout=1.0).read(pods)
    assert reading == QueueReading(6.0, 3.0, pods=1, errors=1)
    assert seen == ["/metrics"]


def test_prometheus_source_queries_the_pool_and_counts_ready_pods():
    def respond(path, query):
        assert path == "/api/v1/query"
        q = query["query"][0]
        value = "12" if "num_requests_waiting" in q else "5"
        result = [{"metric": {}, "value": [1700000000.0, value]}]
        return 200, json.dumps({"status": "success", "data": {"result": result}})

    with http_server(respond) as (port, seen):
        pods = PoolPods("serving", "llama", "decode", "llama-3-8b", ("10.0.0.1", "10.0.0.2"))
        reading = PrometheusSource(f"http://127.0.0.1:{port}").read(pods)
    assert reading == QueueReading(12.0, 5.0, pods=2, errors=0)
    query = parse_qs(urlparse(seen[0]).query)["query"][0]
    assert query == (
        'sum(vllm:num_requests_waiting{namespace="serving",pod=~"llama-decode-.*",'
        'model_name="llama-3-8b"})'
    )


def test_prometheus_down_means_no_data_not_zero_load():
    pods = PoolPods("serving", "llama", "decode", "m", ("10.0.0.1",))
    reading = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout=1.0).read(pods)
    assert reading.pods == 0  # the autoscaler holds on "no pod metrics"
    assert reading.errors == 1


def test_status_conditions_keep_their_transition_time():
    pools = (PoolObserved("colocated", 2, 2, 2, "spec"),)
    first = build_status("m", 3, Observed(pools, 1, 1), {}, "T1")
    ready = next(c for c in first["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], ready["lastTransitionTime"]) == (
        "True",
        "Serving",
        "T1",
    )
    again = build_status("m", 3, Observed(pools, 1, 1), first, "T2")
    assert again == first  # nothing changed: identical status, so no write
    broken = build_status("m", 4, Observed((), 0, 0, ("InvalidSpec", "bad")), first, "T3")
    degraded = next(c for c in broken["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["message"], degraded["lastTransitionTime"]) == (
        "True",
        "bad",
        "T3",
    )
    assert broken["pools"] == first["pools"] and broken["observedGeneration"] == 4


def test_drift_ignores_server_defaults_but_not_changed_values():
    wanted = {
        "spec": {"replicas": 2, "template": {"containers": [{"name": "e", "image": "i"}]}},
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    served = {
        "spec": {
            "replicas": 2,
            "revisionHistoryLimit": 10,
            "template": {
                "containers": [{"name": "e", "image": "i", "imagePullPolicy": "IfNotPresent"}]
            },
        },
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
        "status": {"readyReplicas": 1},
    }
    assert contains(served, wanted)
    served["spec"]["replicas"] = 3
    assert not contains(served, wanted)
    served["spec"]["replicas"] = 2
    served["spec"]["template"]["containers"].append({"name": "sidecar"})
    assert not contains(served, wanted)
    assert not contains({"a": True}, {"a": 1}) and not contains({"a": "x"}, {"a": None})


def test_status_patch_removes_pools_that_are_gone_and_nothing_else():
    old = {"pools": {"colocated": {"replicas": 1}}, "ready": "colocated 1/1", "kopf": {"x": 1}}
    new = {"pools": {"decode": {"replicas": 2}}, "ready": "decode 0/2"}
    assert merge_diff(old, new) == {
        "pools": {"decode": {"replicas": 2}, "colocated": None},
        "ready": "decode 0/2",
    }
    assert merge_diff(new, new) == {}


def test_the_last_applied_record_prunes_what_the_operator_stopped_setting():
    """The record leaves out spec.replicas (an HPA or kubectl scale may own it: never pruned)
    and itself; removals null the keys the operator set and sets no more, never a list item
    (a merge patch replaces lists whole) nor a key someone else added."""
    before = {
        "metadata": {"name": "d", "annotations": {"team": "a"}},
        "spec": {
            "replicas": 3,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0}},
            "template": {"spec": {"hostNetwork": True, "containers": [{"name": "e"}]}},
        },
    }
    stored = with_last_applied(before)
    record = last_applied(stored)
    assert "replicas" not in record["spec"]
    assert LAST_APPLIED not in record["metadata"]["annotations"]
    assert stored["spec"]["replicas"] == 3  # the object itself keeps it
    after = {
        "metadata": {"name": "d"},
        "spec": {
            "strategy": {"type": "Recreate"},
            "template": {"spec": {"containers": [{"name": "e", "env": []}]}},
        },
    }
    assert removals(record, after) == {
        "metadata": {"annotations": None},
        "spec": {"strategy": {"rollingUpdate": None}, "template": {"spec": {"hostNetwork": None}}},
    }
    assert last_applied({"metadata": {"annotations": {LAST_APPLIED: "not json"}}}) == {}
