"""The builtin autoscaler's round trip through zero, in the kopf operator against kmock's
emulator: a pool at 0 is woken by the requests its router holds (read from a stand-in router
/metrics page on 127.0.0.1, the router pod unready as it is while no engine serves), keeps its
pod while a request runs, and returns to 0 after scaleToZeroIdleSeconds of idleness; the
operator's own metrics count each decision and show what the status shows."""

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
    samples,
    wait_for,
)

from pagefleet.operator.handlers import KubeClient
from pagefleet.operator.reconcile import router_selector

IDLE_S = 1
MODEL = "llama-3-8b"
POOL = {"namespace": NS, "pagefleet_io_deployment": "llama", "pagefleet_io_pool": "colocated"}
# Passes slow down on a busy machine: conditions are waited on this long.
WAIT_S = 60


def engine_page(server) -> str | None:
    """The engine's queue gauges (vLLM's names); nothing once its pool is at zero replicas,
    as a pod stops serving when its Deployment scales it away (were it left serving, the
    autoscaler would rightly wake the pool again for it)."""
    if replicas(server.client) == 0:
        return None
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="{MODEL}"}} {server.load["running"]}\n'
    )


def router_page(server) -> str:
    """The router's queued-requests gauge."""
    return (
        "# TYPE pagefleet_router:queued_requests gauge\n"
        f'pagefleet_router:queued_requests{{model="{MODEL}"}} {server.load["queued"]}\n'
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


def decisions(state) -> dict[tuple[str, str], float]:
    """The operator's autoscaler decisions for the pool, by (direction, reason)."""
    found = samples(state.metrics.page(), "pagefleet_operator:autoscaler_decisions_total")
    return {
        (labels["direction"], labels["reason"]): value
        for labels, value in ((dict(k), v) for k, v in found.items())
        if POOL.items() <= labels.items()
    }


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
    load = {"queued": 0, "running": 0}
    with (
        emulator() as url,
        metrics_server(engine_page, load=load, client=KubeClient(url)) as engine,
        metrics_server(router_page, load=load) as router,
    ):
        client, probe = KubeClient(url), KubeClient(url)
        config = {
            "autoscale_interval": 0.2,
            "metrics_port": engine.server_address[1],
            "router_metrics_port": router.server_address[1],
        }

        with operator(url, client, **config) as state:
            probe.create(pod("llama-router-0", router_selector("llama"), ready=False))
            probe.create(model_deployment(**spec))
            wait_for(lambda: "with no pods" in reason(probe), WAIT_S, "a pass at zero")
            passes_for(state, 2 * IDLE_S)
            assert replicas(probe) == 0
            assert reason(probe) == "nothing waiting or queued with no pods -> 0"

            load["queued"] = 1  # a client's request, held by the router
            # The operator's metrics count the scale-up and why: a count stays, where the
            # status' reason moves on at the next pass (no pod metrics yet).
            woken = lambda: decisions(state).get(("up", "wake")) and replicas(probe) == 1  # noqa: E731
            wait_for(woken, WAIT_S, "the pool woken")
            assert decisions(state)[("up", "wake")] == 1

            # The engine loads and the router hands it the request, which runs.
            engine_labels = {"pagefleet.io/deployment": "llama", "pagefleet.io/pool": "colocated"}
            probe.create(pod("llama-colocated-0", engine_labels, ready=True))
            deployment = get(probe, "apps/v1", "Deployment", "llama-colocated")
            probe.merge_patch(deployment, {"status": {"readyReplicas": 1}})
            load.update(queued=0, running=1)
            wait_for(lambda: "1 running" in reason(probe), WAIT_S, "the running request read")
            passes_for(state, 2 * IDLE_S)
            assert replicas(probe) == 1, reason(probe)
            assert ("down", "scale_to_zero") not in decisions(state)

            load["running"] = 0
            back = lambda: decisions(state).get(("down", "scale_to_zero"))  # noqa: E731
            wait_for(back, WAIT_S, "the pool back at zero")
            # Then it stays there, the engine pod no longer serving. Once the status shows a
            # number, so do the metrics: desired 0, as the status says, and why.
            at_zero = "nothing waiting or queued with no pods -> 0"
            wait_for(lambda: reason(probe) == at_zero, WAIT_S, "the pool at rest at zero")
            desired = samples(state.metrics.page(), "pagefleet_operator:pool_desired_replicas")
            labels = {**POOL, "model_name": MODEL, "reason": "idle_at_zero"}
            assert desired == {frozenset(labels.items()): 0}
            assert md_status(probe)["pools"]["colocated"]["desiredReplicas"] == 0
            assert replicas(probe) == 0
            counted = decisions(state)
            assert counted[("up", "wake")] == 1 and counted[("down", "scale_to_zero")] == 1
            assert {d for d, _ in counted} == {"up", "down", "hold"}, counted
