"""The builtin autoscaler's round trip through zero, in the kopf operator against kmock's
emulator: a pool at 0 is woken by the requests its router holds (read from a stand-in router
/metrics page on 127.0.0.1, the router pod unready as it is while no engine serves), keeps its
pod while a request runs, and returns to 0 after scaleToZeroIdleSeconds of idleness."""

from __future__ import annotations

import time

from operator_harness import (
    NS,
    emulator,
    get,
    md_status,
    metrics_server,
    model_deployment,
    next_pass,
    operator,
    wait_for,
)

from pagefleet.operator.handlers import KubeClient
from pagefleet.operator.reconcile import router_selector

IDLE_S = 1
MODEL = "llama-3-8b"


def fleet_page(server) -> str:
    """One page for both roles: the engine's queue gauges (vLLM's names) and the router's
    queued-requests gauge; each reader picks its own names out of it."""
    load = server.load
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="{MODEL}"}} {load["running"]}\n'
        "# TYPE pagefleet_router:queued_requests gauge\n"
        f'pagefleet_router:queued_requests{{model="{MODEL}"}} {load["queued"]}\n'
        # Another model's queue on the same router never wakes this pool.
        'pagefleet_router:queued_requests{model="other"} 7\n'
    )


def pod(name: str, labels: dict[str, str], ready: bool) -> dict:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [condition]},
    }


def replicas(client: KubeClient) -> int:
    return get(client, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"]


def reason(client: KubeClient) -> str:
    return md_status(client).get("pools", {}).get("colocated", {}).get("reason", "")


def passes_for(state, seconds: float) -> None:
    """Let whole operator passes run until `seconds` of wall time have gone by."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        next_pass(state)


def test_a_pool_at_zero_wakes_on_the_routers_queue_and_returns_after_the_idle_window():
    """Catches the one-way trip (a builtin pool at 0 read "no pod metrics: holding" forever),
    a router read only when Ready (it is not, without engines), another model's queue waking
    the pool, and a scale to 0 under a running request or before the idle window."""
    autoscaling = {
        "mode": "builtin",
        "minReplicas": 0,
        "maxReplicas": 2,
        "scaleToZeroIdleSeconds": IDLE_S,
    }
    spec = {"pools": {"colocated": {"replicas": 0, "autoscaling": autoscaling}}}
    with emulator() as url, metrics_server(fleet_page, load={"queued": 0, "running": 0}) as metrics:
        client, probe = KubeClient(url), KubeClient(url)
        port = metrics.server_address[1]
        config = {"autoscale_interval": 0.2, "metrics_port": port, "router_metrics_port": port}
        load = metrics.load  # type: ignore[attr-defined]

        with operator(url, client, **config) as state:
            probe.create(pod("llama-router-0", router_selector("llama"), ready=False))
            probe.create(model_deployment(**spec))
            wait_for(lambda: "with no pods" in reason(probe), what="a pass at zero")
            passes_for(state, 2 * IDLE_S)
            assert replicas(probe) == 0
            assert reason(probe) == "nothing waiting or queued with no pods -> 0"

            load["queued"] = 1  # a client's request, held by the router
            woken = "0 waiting + 1 queued with no pods -> 1"
            wait_for(lambda: reason(probe) == woken, what="the pool woken")
            assert replicas(probe) == 1

            # The engine loads and the router hands it the request, which runs.
            engine_labels = {"pagefleet.io/deployment": "llama", "pagefleet.io/pool": "colocated"}
            probe.create(pod("llama-colocated-0", engine_labels, ready=True))
            deployment = get(probe, "apps/v1", "Deployment", "llama-colocated")
            probe.merge_patch(deployment, {"status": {"readyReplicas": 1}})
            load.update(queued=0, running=1)
            wait_for(lambda: "1 running" in reason(probe), what="the running request read")
            passes_for(state, 2 * IDLE_S)
            assert replicas(probe) == 1, reason(probe)

            load["running"] = 0
            back = f"(scaleToZeroIdleSeconds {IDLE_S}) -> 0"
            wait_for(lambda: reason(probe).endswith(back), what="the pool back at zero")
            assert replicas(probe) == 0
