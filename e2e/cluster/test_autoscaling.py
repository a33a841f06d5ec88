"""Scenario: the builtin autoscaler's loop on pods. A bounded load queues requests on the engine,
the operator raises replicas, the lab starts pods, the router discovers and uses them and the
queue drains; when the load stops and the window passes, replicas go down and the pods leave
with a SIGTERM drain. Every request sent is answered. A hand scale of the pool is then put
back with one Warning event."""

from __future__ import annotations

import time

from .conftest import open_lab
from .fleet import (
    Load,
    md_pods,
    metrics,
    prepare_namespace,
    ready,
    router_url,
    simulated_deployment,
    start_operator,
    wait_serving,
)

NS, NAME = "serving", "scaled"
AUTOSCALING = {
    "mode": "builtin",
    "minReplicas": 1,
    "maxReplicas": 3,
    "targetWaitingPerReplica": 2,
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 8,
    "maxScaleUpStep": 2,
}


def scaled_deployment() -> dict:
    return simulated_deployment(NAME, NS, {"replicas": 1, "autoscaling": AUTOSCALING})


def replicas(lab) -> int:
    return lab.kube.get("apps/v1", "Deployment", NS, f"{NAME}-colocated")["spec"]["replicas"]


def served(lab, pod: dict) -> float:
    return metrics(lab, pod).get("vllm:request_success_total", 0.0)


def test_builtin_autoscaler_scales_pods_up_and_down_without_losing_a_request(tmp_path, model_store):
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NS)
        start_operator(lab, "--autoscale-interval", "1")
        lab.kube.create(scaled_deployment())
        first = wait_serving(lab, NS, NAME, engines=1)[0]
        load = Load(router_url(lab, NS, NAME))

        heavy, workers = load.run(lab, clients=10)
        started = time.monotonic()
        lab.wait_for(lambda: replicas(lab) > 1, 60, "the autoscaler to add replicas")
        grown = lab.wait_for(
            lambda: (
                len(pods := ready(md_pods(lab, NS, NAME))) >= 2
                and [
                    p
                    for p in pods
                    if p["metadata"]["name"] != first["metadata"]["name"] and served(lab, p) > 0
                ]
            ),
            120,
            "new pods Ready and used by the router",
        )
        scale_up_s = time.monotonic() - started
        added = [p["metadata"]["name"] for p in grown]

        heavy.set()  # the load drops to one client: the queue drains, the window runs
        for w in workers:
            w.result(timeout=120)
        light, workers = load.run(lab, clients=1)
        lab.wait_for(
            lambda: all(
                metrics(lab, p)["vllm:num_requests_waiting"] == 0
                for p in ready(md_pods(lab, NS, NAME))
            ),
            60,
            "the queue to drain",
        )
        dropped = time.monotonic()
        lab.wait_for(lambda: replicas(lab) == 1, 90, "the autoscaler to scale down")
        lab.wait_for(lambda: len(md_pods(lab, NS, NAME)) == 1, 90, "scaled-away pods gone")
        scale_down_s = time.monotonic() - dropped
        light.set()
        for w in workers:
            w.result(timeout=120)

        gone = [
            n
            for n in [first["metadata"]["name"], *added]
            if lab.kube.get("v1", "Pod", NS, n) is None
        ]
        assert gone, "no pod was scaled away"
        for name in gone:
            last = [v for v in lab.kube.history("v1", "Pod", NS, name) if v][-1]
            state = last["status"]["containerStatuses"][0]["state"]
            assert state["terminated"]["exitCode"] == 0, f"{name} did not drain: {state}"
            assert "SIGTERM: draining" in lab.log(f"{NS}_{name}_engine")
        print(
            f"autoscaling: {load.sent} requests sent, {load.ok} answered,"
            f" {len(load.failures)} failed;"
            f" scale up (load -> new pod serving) {scale_up_s:.1f} s, scale down (queue drained ->"
            f" one pod left) {scale_down_s:.1f} s"
        )
        assert load.failures == [] and load.ok == load.sent

        # A `kubectl scale` of the autoscaled pool, on pods: put back, with one event naming it.
        deployment = lab.kube.get("apps/v1", "Deployment", NS, f"{NAME}-colocated")
        lab.kube.patch(deployment, {"spec": {"replicas": 3}})
        lab.wait_for(lambda: reverted_events(lab), 60, "the ManualScaleReverted event")
        lab.wait_for(lambda: replicas(lab) == 1, 60, "the hand scale put back")
        (event,) = reverted_events(lab)
        assert event["type"] == "Warning" and event["involvedObject"]["name"] == NAME
        assert event["message"].startswith(f"{NAME}-colocated was scaled to 3 by hand")


def reverted_events(lab) -> list[dict]:
    return [e for e in lab.kube.list("v1", "Event", NS) if e["reason"] == "ManualScaleReverted"]
