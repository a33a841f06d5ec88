"""Scenario: a pool that sits at zero pods and wakes for its first requests. The router holds
them (its queued gauge says so), the builtin autoscaler reads that gauge and sets the pool's
Deployment to one replica, the lab starts the pod, the router releases the held requests to
it and every one is answered in full; after the idle window (scaleToZeroIdleSeconds) the
pool goes back to zero and the pod leaves with a SIGTERM drain. Then it wakes again: the
trip is not one-way.

What it catches: an autoscaler that reads only the engines' queues (none exist at zero pods,
so the pool never wakes and the wait for replicas 1 times out: seen failing with the wake on
the router's queue removed from autoscale.recommend), a router that answers 503 at zero
engines instead of holding, a router Service without endpoints at zero engines (readiness on
/health), a request lost or cut short across the wake, and a pool that never returns to 0."""

from __future__ import annotations

import time

import httpx

from .conftest import open_lab
from .fleet import (
    elapsed,
    md_pods,
    prepare_namespace,
    ready,
    router_metric,
    router_url,
    simulated_deployment,
    start_operator,
)

NS, NAME = "serving", "sleepy"
DEPLOYMENT = f"{NAME}-colocated"
IDLE_S = 2  # scaleToZeroIdleSeconds: short, so the scenario does not wait long for it
AUTOSCALING = {
    "mode": "builtin",
    "minReplicas": 0,
    "maxReplicas": 1,
    "scaleToZeroIdleSeconds": IDLE_S,
    "scaleDownStabilizationSeconds": 0,
}
HELD = 3  # requests sent while the pool is at zero
MAX_TOKENS = 12
QUEUED = "pagefleet_router:queued_requests"


def sleepy_deployment() -> dict:
    return simulated_deployment(NAME, NS, {"replicas": 0, "autoscaling": AUTOSCALING})


def replicas(lab) -> int:
    found = lab.kube.get("apps/v1", "Deployment", NS, DEPLOYMENT)
    return found["spec"]["replicas"] if found else -1


def engine_pods(lab) -> list[dict]:
    return md_pods(lab, NS, NAME)


def at_zero(lab) -> bool:
    return replicas(lab) == 0 and not engine_pods(lab)


def completion(url: str, prompt: str) -> tuple[int, dict | str]:
    """One completion through the router (from inside the lab): (status, body)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as e:
        return 0, repr(e)
    return r.status_code, (r.json() if r.status_code == 200 else r.text[:300])


def answered_in_full(result: tuple[int, dict | str]) -> bool:
    status, body = result
    return (
        status == 200
        and isinstance(body, dict)
        and body["usage"]["completion_tokens"] == MAX_TOKENS
        and body["choices"][0]["finish_reason"] == "length"
    )


def wake_and_serve(lab, url: str, count: int, round_name: str) -> list[str]:
    """Send `count` requests at zero pods; they are held until the pool wakes, then all are
    answered in full. Returns the names of the engine pods that served them."""
    sent = [lab.submit(completion, url, f"{round_name} request {i}") for i in range(count)]
    # Held at the router: no engine pod exists to take them, and none is lost meanwhile.
    lab.wait_for(
        lambda: router_metric(lab, url, QUEUED) == count,
        60,
        f"{count} requests queued at the router",
    )
    lab.wait_for(lambda: replicas(lab) == 1, 60, "the autoscaler to wake the pool")
    results = [f.result(timeout=180) for f in sent]
    assert all(answered_in_full(r) for r in results), results
    assert router_metric(lab, url, QUEUED) == 0
    # Listed, not filtered on Ready: the idle window may already be taking the pod away.
    return [p["metadata"]["name"] for p in engine_pods(lab)]


def back_to_zero(lab, pods: list[str]) -> None:
    """After the idle window the pool goes to 0 and its pods drain on SIGTERM."""
    lab.wait_for(lambda: replicas(lab) == 0, 60, "the autoscaler to return the pool to 0")
    lab.wait_for(lambda: not engine_pods(lab), 60, "the engine pods gone")
    for name in pods:
        last = [v for v in lab.kube.history("v1", "Pod", NS, name) if v][-1]
        state = last["status"]["containerStatuses"][0]["state"]
        assert state["terminated"]["exitCode"] == 0, f"{name} did not drain: {state}"
        assert "SIGTERM: draining" in lab.log(f"{NS}_{name}_engine")


def test_a_pool_at_zero_wakes_for_held_requests_and_returns_to_zero(tmp_path, model_store):
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NS)
        start_operator(lab, "--autoscale-interval", "0.5")
        lab.kube.create(sleepy_deployment())
        # The router is Ready with no engine at all (it holds requests), so its Service sends
        # them; the pool sits at zero.
        url = router_url(lab, NS, NAME)
        lab.wait_for(lambda: at_zero(lab), 30, "the pool at 0 pods")
        assert ready(md_pods(lab, NS, NAME, "router"))

        started = time.monotonic()
        served = wake_and_serve(lab, url, HELD, "first")
        assert len(served) == 1
        woken_s = elapsed(started)
        back_to_zero(lab, served)
        asleep_s = elapsed(started) - woken_s

        # Asleep again, it wakes again: the trip is not one-way.
        served_again = wake_and_serve(lab, url, 1, "second")
        assert len(served_again) == 1 and served_again != served
        again_s = elapsed(started) - woken_s - asleep_s
        print(
            f"scale to zero: {HELD} held requests answered {woken_s} s after they were sent,"
            f" 0 pods {asleep_s:.1f} s later, one more answered {again_s:.1f} s after that"
        )

        # Every request went through the queue and out of it to an engine: none refused.
        assert router_metric(lab, url, "pagefleet_router:queue_rejections_total") == 0
        assert router_metric(lab, url, "pagefleet_router:queue_wait_seconds_count") == HELD + 1
