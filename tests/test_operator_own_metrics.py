"""The operator's own /metrics (operator/metrics.py): the series, their names and labels; the
HTTP endpoint and what it refuses; and, through the kopf operator against kmock's emulator,
failed queue reads counted by source and a ModelDeployment's series gone when it goes.
Reconcile errors, the pool gauges and the autoscaler's decisions are asserted where kopf tests
drive them (test_operator_kopf.py, test_operator_scale_to_zero.py), leadership with two real
processes (test_operator_leader.py), all of it scraped by a real Prometheus in the cluster
lab (e2e/cluster/test_metrics.py)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
import pytest
from operator_harness import (
    NS,
    delete,
    emulator,
    model_deployment,
    operator,
    sample,
    samples,
    wait_for,
)

from pagefleet.common.cli import build_parser
from pagefleet.operator.autoscale import ScaleReason
from pagefleet.operator.handlers import KubeClient
from pagefleet.operator.metrics import (
    MetricsServer,
    OperatorMetrics,
    ReadSource,
    parse_bind_address,
)
from pagefleet.operator.reconcile import router_selector
from pagefleet.operator.status import PoolObserved
from server_utils import free_port

P = "pagefleet_operator:"
CHART_README = Path(__file__).resolve().parent.parent / "deploy/helm/pagefleet/README.md"
MD = {"namespace": NS, "pagefleet_io_deployment": "llama"}


def labels(**extra: str) -> frozenset:
    return frozenset({**MD, **extra}.items())


def pool(name: str, replicas: int, ready: int, desired: int, cause: ScaleReason) -> PoolObserved:
    return PoolObserved(name, replicas, ready, desired, "in words", cause=cause)


def test_the_series_their_labels_and_values():
    """Fails for: a renamed series or label (the chart's dashboard, alert and the lab query
    these names), a count lost, a reason label outside the closed set, a pool that left the
    spec still graphed, or a failed read of nothing counted."""
    metrics = OperatorMetrics()
    metrics.reconciled(NS, "llama", None, 0.02)
    metrics.reconciled(NS, "llama", "HostPathNotAllowed", 0.01)
    metrics.reconciled(NS, "llama", "HostPathNotAllowed", 0.01)
    decode = pool("decode", 3, 1, 3, ScaleReason.PODS_NOT_READY)
    prefill = pool("prefill", 1, 1, 1, ScaleReason.SPEC)
    metrics.observed(NS, "llama", "llama-3-8b", (decode, prefill))
    metrics.decided(NS, "llama", "decode", 1, 3, ScaleReason.STEP_LIMIT)
    metrics.decided(NS, "llama", "decode", 3, 3, ScaleReason.PODS_NOT_READY)
    metrics.decided(NS, "llama", "decode", 3, 3, ScaleReason.PODS_NOT_READY)
    metrics.read_failed(NS, "llama", ReadSource.ENGINE_PODS, 2)
    metrics.read_failed(NS, "llama", ReadSource.ROUTER_PODS, 0)
    page = metrics.page()

    assert sample(page, P + "leader") == 0
    metrics.leader = True
    assert sample(metrics.page(), P + "leader") == 1
    assert samples(page, P + "reconciles_total") == {labels(): 2 + 1}
    assert samples(page, P + "reconcile_errors_total") == {labels(reason="HostPathNotAllowed"): 2}
    assert sample(page, P + "reconcile_duration_seconds_count") == 3
    assert samples(page, P + "autoscaler_decisions_total") == {
        labels(pagefleet_io_pool="decode", direction="up", reason="step_limit"): 1,
        labels(pagefleet_io_pool="decode", direction="hold", reason="pods_not_ready"): 2,
    }
    assert samples(page, P + "queue_read_errors_total") == {labels(source="engine_pods"): 2}
    model = {"model_name": "llama-3-8b"}
    assert samples(page, P + "pool_desired_replicas") == {
        labels(pagefleet_io_pool="decode", reason="pods_not_ready", **model): 3,
        labels(pagefleet_io_pool="prefill", reason="spec", **model): 1,
    }
    assert samples(page, P + "pool_replicas") == {
        labels(pagefleet_io_pool="decode", **model): 3,
        labels(pagefleet_io_pool="prefill", **model): 1,
    }
    ready = samples(page, P + "pool_ready_replicas")
    assert ready[labels(pagefleet_io_pool="decode", **model)] == 1
    # The process' own (CPU, memory) for graphs of the operator itself.
    assert sample(page, "process_resident_memory_bytes") > 0

    # A later reconcile's pools replace the earlier ones.
    metrics.observed(NS, "llama", "llama-3-8b", (pool("colocated", 0, 0, 0, ScaleReason.WAKE),))
    desired = samples(metrics.page(), P + "pool_desired_replicas")
    assert desired == {labels(pagefleet_io_pool="colocated", reason="wake", **model): 0}


def test_a_model_deployments_series_go_with_it():
    """Fails for: series of deleted ModelDeployments kept forever (cardinality that only
    grows), or those of another ModelDeployment dropped with them."""
    metrics = OperatorMetrics()
    for name in ("llama", "qwen"):
        metrics.reconciled(NS, name, "InvalidSpec", 0.01)
        metrics.observed(NS, name, "m", (pool("colocated", 1, 1, 1, ScaleReason.SPEC),))
        metrics.decided(NS, name, "colocated", 1, 1, ScaleReason.DEMAND)
        metrics.read_failed(NS, name, ReadSource.PROMETHEUS, 1)
    metrics.forget(NS, "llama")
    page = metrics.page().decode()
    assert 'pagefleet_io_deployment="llama"' not in page
    assert page.count('pagefleet_io_deployment="qwen"') == 7
    metrics.keep_only({("other", "qwen")})  # same name, another namespace: not this one
    assert "pagefleet_io_deployment" not in metrics.page().decode()


def test_the_endpoint_serves_get_metrics_and_refuses_the_rest():
    """A hostile client on the metrics port gets the page or an error, nothing else: no
    other path, no method with a body, no header past the limit."""
    metrics = OperatorMetrics()
    server = MetricsServer(metrics, ("127.0.0.1", 0)).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        page = httpx.get(f"{base}/metrics", timeout=10)
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/plain; version=")
        assert sample(page.text, P + "leader") == 0
        assert httpx.get(f"{base}/", timeout=10).status_code == 404
        assert httpx.get(f"{base}/metrics/../healthz", timeout=10).status_code == 404
        assert httpx.post(f"{base}/metrics", content=b"x" * 1000, timeout=10).status_code == 501
        huge = httpx.get(f"{base}/metrics", headers={"x-big": "a" * 70000}, timeout=10)
        assert huge.status_code == 431
        # A client that never finishes its request holds one thread until the timeout, and
        # does not hold up the others.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as stalled:
            stalled.sendall(b"GET /metrics HTTP/1.0\r\n")
            assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
    finally:
        server.close()


@pytest.mark.parametrize(
    ("text", "address"),
    [(":8080", ("0.0.0.0", 8080)), ("127.0.0.1:9", ("127.0.0.1", 9)), ("[::]:80", ("::", 80))],
)
def test_bind_addresses_as_controller_runtime_writes_them(text, address):
    assert parse_bind_address(text) == address


@pytest.mark.parametrize("text", ["8080", ":0", ":65536", "host:", "host:http", ""])
def test_a_bad_bind_address_is_refused_by_the_command_line(text, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", f"--metrics-bind-address={text}"])
    assert "--metrics-bind-address" in capsys.readouterr().err


def unreachable_pod(name: str, labels: dict[str, str]) -> dict:
    """A Ready pod at 127.0.0.2, where nothing listens on the operator's ports."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.2",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_failed_queue_reads_are_counted_and_the_series_go_with_the_model_deployment():
    """An engine pod and a router pod that do not answer: each pass counts a failed read of
    each source, and the pool holds on no metrics. Deleted, the ModelDeployment's series go.
    Fails for: a failed read that only logs (the autoscaler blind, and nobody told), or the
    series of a deleted ModelDeployment kept."""
    autoscaling = {"mode": "builtin", "minReplicas": 1, "maxReplicas": 2}
    spec = {"pools": {"colocated": {"replicas": 1, "autoscaling": autoscaling}}}
    port = free_port()  # nothing listens on it
    with emulator() as url:
        client = KubeClient(url)
        config = {"autoscale_interval": 0.2, "metrics_port": port, "router_metrics_port": port}
        with operator(url, client, **config) as state:
            engine = {"pagefleet.io/deployment": "llama", "pagefleet.io/pool": "colocated"}
            client.create(unreachable_pod("llama-colocated-0", engine))
            client.create(unreachable_pod("llama-router-0", router_selector("llama")))
            client.create(model_deployment(**spec))

            def evaluated() -> bytes | None:
                """The page once a pass read both sources and decided."""
                page = state.metrics.page()
                reads = [
                    sample(page, P + "queue_read_errors_total", source=source)
                    for source in ("engine_pods", "router_pods")
                ]
                decided = sample(page, P + "pool_desired_replicas", reason="no_metrics")
                return page if all(reads) and decided is not None else None

            page = wait_for(evaluated, 60, "a pass with both sources' failed reads counted")
            desired = samples(page, P + "pool_desired_replicas")
            model = {"model_name": "llama-3-8b", "pagefleet_io_pool": "colocated"}
            assert desired == {labels(reason="no_metrics", **model): 1}
            assert sample(page, P + "reconciles_total", **MD) >= 1
            assert sample(page, P + "reconcile_errors_total") is None

            delete(client, "pagefleet.io/v1alpha1", "ModelDeployment", "llama")
            wait_for(
                lambda: b'pagefleet_io_deployment="llama"' not in state.metrics.page(),
                60,
                "the series gone",
            )


def test_the_charts_readme_lists_every_series_and_reason():
    """What users read to write their queries: fails when a series or a reason value is added,
    renamed or dropped without the chart's README saying so."""
    metrics = OperatorMetrics()
    metrics.reconciled(NS, "llama", "InvalidSpec", 0.01)
    metrics.observed(NS, "llama", "m", (pool("colocated", 1, 1, 1, ScaleReason.SPEC),))
    metrics.decided(NS, "llama", "colocated", 1, 1, ScaleReason.DEMAND)
    metrics.read_failed(NS, "llama", ReadSource.PROMETHEUS, 1)
    page = metrics.page().decode()
    exported = set(
        re.findall(r"^(pagefleet_operator:\w+?)(?:_bucket|_count|_sum|_created)?[{ ]", page, re.M)
    )
    readme = CHART_README.read_text()
    documented = set(re.findall(r"pagefleet_operator:\w+", readme))
    documented |= {P + name for name in re.findall(r", (pool_\w+) \|", readme)}
    assert exported == documented, exported ^ documented
    row = next(line for line in readme.splitlines() if line.startswith(f"| {P}pool_desired"))
    assert set(re.findall(r"`(\w+)`", row)) >= {str(r) for r in ScaleReason}
