"""Scenarios of day two: the operator restarted mid-run, engine and router pods killed, an object
of our name that belongs to someone else, and deletion."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from .conftest import TIME_FACTOR, open_lab
from .fleet import (
    MD,
    Load,
    complete,
    helm_template,
    helm_uninstall,
    md_pods,
    metrics,
    operator_ready,
    prepare_namespace,
    ready,
    router_metric,
    router_pods,
    router_url,
    simulated_deployment,
    start_operator,
    wait_serving,
)

NS = "serving"
CHART_VALUES = Path(__file__).with_name("chart-cpu-values.yaml")
LONG = " ".join(f"turn{i % 23} of a long shared context" for i in range(30))  # ~300 tokens
# What the operator owns besides its pods: (apiVersion, kind, name suffix).
OWNED = [
    ("apps/v1", "Deployment", "colocated"),
    ("v1", "Service", "colocated"),
    ("apps/v1", "Deployment", "router"),
    ("v1", "Service", "router"),
    ("v1", "ConfigMap", "router"),
    ("v1", "ServiceAccount", "router"),
    ("rbac.authorization.k8s.io/v1", "Role", "router"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "router"),
]


def model_deployment(name: str, replicas: int = 1, autoscaling: dict | None = None) -> dict:
    pool: dict = {"replicas": replicas}
    if autoscaling:
        pool["autoscaling"] = autoscaling
    return simulated_deployment(name, NS, pool)


def prepare(lab) -> None:
    prepare_namespace(lab, NS)


def owned(lab, name: str) -> dict[tuple[str, str], dict]:
    return {
        (kind, suffix): lab.kube.get(api_version, kind, NS, f"{name}-{suffix}")
        for api_version, kind, suffix in OWNED
    }


def replicas(lab, name: str) -> int:
    return lab.kube.get("apps/v1", "Deployment", NS, f"{name}-colocated")["spec"]["replicas"]


def pod(lab, name: str) -> dict:
    return lab.kube.get("v1", "Pod", NS, name)


def restarts(lab, name: str) -> int:
    return pod(lab, name)["status"]["containerStatuses"][0]["restartCount"]


def test_operator_restart_changes_nothing_and_keeps_the_scale_down_window(tmp_path, model_store):
    """Scaled up by load, then the load stops and the operator restarts: nothing is re-created
    or rewritten, and replicas hold until the scale-down window has passed (the window is kept
    in status, not in the old process' memory)."""
    window = 20
    autoscaling = {
        "mode": "builtin",
        "minReplicas": 1,
        "maxReplicas": 2,
        "targetWaitingPerReplica": 2,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": window,
        "maxScaleUpStep": 1,
    }
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare(lab)
        operator = start_operator(lab, "--autoscale-interval", "1")
        lab.kube.create(model_deployment("steady", autoscaling=autoscaling))
        wait_serving(lab, NS, "steady", engines=1)
        load = Load(router_url(lab, NS, "steady"))
        # Enough clients that both pods queue more than the target however the router splits
        # them: with 10, engines on the faster CPU attention kernel kept one pod at <= 2.
        stop, workers = load.run(lab, clients=16)
        lab.wait_for(lambda: replicas(lab, "steady") == 2, 60, "scale up")
        wait_serving(lab, NS, "steady", engines=2)
        # Still above target on both pods, so the window's last high point is the lull itself.
        lab.wait_for(
            lambda: all(
                metrics(lab, p)["vllm:num_requests_waiting"] > 2
                for p in ready(md_pods(lab, NS, "steady"))
            ),
            30,
            "both pods queueing",
        )
        stop.set()
        lull = time.monotonic()
        for w in workers:
            w.result(timeout=120)
        before = owned(lab, "steady")
        pods_before = {p["metadata"]["name"] for p in lab.kube.pods(NS)}

        lab.stop_process(operator)
        start_operator(lab, "--autoscale-interval", "1", name="operator-2")
        # The new operator takes over (its first passes) while the window still runs.
        # (4 s of slack: the last high reading may precede the lull by an interval or two.)
        while time.monotonic() - lull < window - 4:
            held = time.monotonic() - lull
            assert replicas(lab, "steady") == 2, (
                f"scaled down {held:.1f} s into a {window} s window"
            )
            time.sleep(0.5)
        after = owned(lab, "steady")
        for key, obj in before.items():
            now = after[key]
            assert now["metadata"]["uid"] == obj["metadata"]["uid"], f"{key} was re-created"
            assert now["metadata"].get("generation") == obj["metadata"].get("generation"), (
                f"{key} was rewritten"
            )
            if key[0] not in {"Deployment", "Service"}:  # no status churn: any write shows
                assert now["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"], key
        assert pods_before <= {p["metadata"]["name"] for p in lab.kube.pods(NS)}, "pods replaced"
        lab.wait_for(lambda: replicas(lab, "steady") == 1, 60, "scale down after the window")
        print(
            f"operator restart: scaled down {time.monotonic() - lull:.1f} s after the lull"
            f" ({window} s window)"
        )
        assert load.failures == [] and load.ok == load.sent


def test_killed_engine_and_router_pods_come_back_and_the_router_catches_up(tmp_path, model_store):
    """A router pod deleted comes back and rebuilds its precise prefix index through the
    engines' replay endpoint (it predicts cached blocks it never saw stored); an engine
    container killed is restarted, dropped by the router meanwhile, and used again."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare(lab)
        start_operator(lab, "--autoscale-interval", "1")
        lab.kube.create(model_deployment("llama", replicas=2))
        engines = wait_serving(lab, NS, "llama", engines=2)
        url = router_url(lab, NS, "llama")
        lab.wait_for(lambda: len(router_pods(lab, url)) == 2, 30, "the router to know both engines")
        hits_before = {
            p["metadata"]["name"]: metrics(lab, p)["vllm:prefix_cache_hits_total"] for p in engines
        }
        complete(lab, url, "tiny", LONG, max_tokens=4)

        # The router pod goes; its replacement learns the cache from the replay endpoint.
        old_router = md_pods(lab, NS, "llama", "router")[0]
        lab.kube.delete("v1", "Pod", NS, old_router["metadata"]["name"], grace_s=0)
        lab.wait_for(
            lambda: [
                p
                for p in ready(md_pods(lab, NS, "llama", "router"))
                if p["metadata"]["name"] != old_router["metadata"]["name"]
            ],
            60,
            "a new router pod",
        )
        url = router_url(lab, NS, "llama")
        lab.wait_for(
            lambda: (
                url != f"http://{old_router['status']['podIP']}:8080"
                and len(router_pods(lab, url)) == 2
            ),
            60,
            "the new router to know both engines",
        )
        lab.wait_for(
            lambda: (
                complete(lab, url, "tiny", LONG, max_tokens=4) is not None
                and router_metric(lab, url, "pagefleet_router:predicted_hit_blocks_total") > 0
            ),
            30,
            "the new router to predict the cached prefix",
        )
        hits = {
            p["metadata"]["name"]: metrics(lab, p)["vllm:prefix_cache_hits_total"] for p in engines
        }
        assert any(hits[n] > hits_before[n] for n in hits), "the repeat did not hit the cache"

        # An engine's process dies: the kubelet restarts it, the router drops it, then uses it.
        victim = engines[0]
        pid = int(victim["status"]["containerStatuses"][0]["containerID"].split("//")[1])
        ejections = router_metric(lab, url, "pagefleet_router:ejections_total")
        os.kill(pid, signal.SIGKILL)
        name = victim["metadata"]["name"]
        lab.wait_for(
            lambda: (
                name not in router_pods(lab, url)
                or router_metric(lab, url, "pagefleet_router:ejections_total") > ejections
            ),
            30,
            "the router to drop the dead engine",
        )
        lab.wait_for(
            lambda: restarts(lab, name) == 1 and ready([pod(lab, name)]), 90, "the restart"
        )
        lab.wait_for(lambda: name in router_pods(lab, url), 30, "the router to re-add the engine")
        load = Load(url)

        def victim_serves() -> bool:
            stop, workers = load.run(lab, clients=4)
            time.sleep(1)  # a burst, then look
            stop.set()
            for w in workers:
                w.result(timeout=60)
            return (
                metrics(lab, lab.kube.get("v1", "Pod", NS, name)).get(
                    "vllm:request_success_total", 0
                )
                > 0
            )

        lab.wait_for(victim_serves, 60, "the router to use the restarted engine again")
        assert load.failures == [], load.failures[:3]


def test_an_object_of_our_name_owned_by_someone_else_is_left_alone(tmp_path, model_store):
    """A Service named like the router's, made by someone else: the operator does not touch it,
    says so in a condition and a Warning event, and runs the rest."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare(lab)
        theirs = lab.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "llama-router", "namespace": NS, "labels": {"team": "other"}},
                "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]},
            }
        )
        start_operator(lab, "--autoscale-interval", "1")
        lab.kube.create(model_deployment("llama"))

        def degraded():
            status = (lab.kube.get(*MD, NS, "llama") or {}).get("status") or {}
            return next(
                (
                    c
                    for c in status.get("conditions", [])
                    if c["type"] == "Degraded" and c["status"] == "True"
                ),
                None,
            )

        condition = lab.wait_for(degraded, 60, "a Degraded condition")
        assert "llama-router" in condition["message"], condition
        events = lab.wait_for(
            lambda: [
                e
                for e in lab.kube.list("v1", "Event", NS)
                if e["involvedObject"]["name"] == "llama"
                and e["type"] == "Warning"
                and "llama-router" in e["message"]
            ],
            30,
            "a Warning event",
        )
        assert events[0]["reason"] == condition["reason"]
        wait_serving(lab, NS, "llama", engines=1)  # the rest runs
        now = lab.kube.get("v1", "Service", NS, "llama-router")
        assert now["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"]
        assert now["metadata"]["uid"] == theirs["metadata"]["uid"]
        assert not now["metadata"].get("ownerReferences")


def test_deleting_a_model_deployment_removes_everything_it_owns(tmp_path, model_store):
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare(lab)
        start_operator(lab, "--autoscale-interval", "1")
        lab.kube.create(model_deployment("llama", replicas=2))
        wait_serving(lab, NS, "llama", engines=2)
        lab.kube.delete(*MD, NS, "llama")
        lab.wait_for(lambda: lab.kube.get(*MD, NS, "llama") is None, 30, "the ModelDeployment gone")

        def leftovers():
            objects = [o for (kind, _), o in owned(lab, "llama").items() if o is not None]
            for api_version, kind in [
                ("apps/v1", "ReplicaSet"),
                ("v1", "Pod"),
                ("v1", "Endpoints"),
            ]:
                objects += lab.kube.list(api_version, kind, NS)
            return [f"{o['kind']}/{o['metadata']['name']}" for o in objects]

        lab.wait_for(lambda: not leftovers(), 60, "every owned object gone")


def test_uninstalling_the_chart_leaves_no_model_deployment_pod_or_finalizer(tmp_path, model_store):
    """The chart installed (its operator as a pod), then uninstalled in helm's order: the
    operator goes before the ModelDeployment, and still nothing is left behind. (The real helm
    stores releases as protobuf Secrets, which the lab's JSON-only API cannot read; the
    uninstall follows helm's documented order instead.)"""
    objects = helm_template("pf", NS, CHART_VALUES)
    claim = next(o for o in objects if o["kind"] == "PersistentVolumeClaim")["metadata"]["name"]
    with open_lab(tmp_path / "lab", claims={claim: str(model_store)}) as lab:
        lab.kube.create_namespace(NS)
        for obj in sorted(objects, key=lambda o: o["kind"] != "CustomResourceDefinition"):
            lab.kube.create(obj)
        operator_ready(lab, NS)
        wait_serving(lab, NS, "llama-3-8b", engines=1)
        deleted = helm_uninstall(lab, objects)
        assert deleted.index("Deployment/pf-pagefleet-operator") < deleted.index(
            "ModelDeployment/llama-3-8b"
        )

        def left():
            mds = lab.kube.list(*MD, NS)
            pods = lab.kube.pods(NS)
            return [
                f"ModelDeployment/{m['metadata']['name']} {m['metadata'].get('finalizers')}"
                for m in mds
            ] + [f"Pod/{p['metadata']['name']}" for p in pods]

        lab.wait_for(lambda: not left(), 90, "no ModelDeployment or pod left")


def test_the_router_outlives_an_empty_pool(tmp_path, model_store):
    """No engine at all (a pool at zero replicas) for longer than the router's liveness
    budget: the router is not ready but never restarted, and serves once an engine comes."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare(lab)
        start_operator(lab, "--autoscale-interval", "1")
        md = lab.kube.create(model_deployment("idle", replicas=0))
        router = lab.wait_for(lambda: md_pods(lab, NS, "idle", "router"), 60, "the router pod")[0]
        probe = router["spec"]["containers"][0]["livenessProbe"]
        budget = probe["periodSeconds"] * probe["failureThreshold"] * TIME_FACTOR
        started = time.monotonic()
        while time.monotonic() - started < budget + 10:
            now = lab.kube.get("v1", "Pod", NS, router["metadata"]["name"])
            statuses = (now.get("status") or {}).get("containerStatuses") or [{}]
            assert statuses[0].get("restartCount", 0) == 0, (
                "the router was restarted without engines"
            )
            time.sleep(1)
        lab.kube.patch(md, {"spec": {"pools": {"colocated": {"replicas": 1}}}})
        wait_serving(lab, NS, "idle", engines=1)
        assert complete(lab, router_url(lab, NS, "idle"), "tiny", "hello")


def test_each_router_uses_only_its_own_deployments_engines(tmp_path, model_store):
    """Two ModelDeployments serving the same model name in one namespace (as the colocated
    and disaggregated examples do): each router discovers only its own engine pods."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare(lab)
        start_operator(lab, "--autoscale-interval", "1")
        for name in ("alpha", "beta"):
            lab.kube.create(model_deployment(name))
        engines = {
            name: {p["metadata"]["name"] for p in wait_serving(lab, NS, name, engines=1)}
            for name in ("alpha", "beta")
        }
        for name, own in engines.items():
            url = router_url(lab, NS, name)
            lab.wait_for(lambda u=url, o=own: o <= router_pods(lab, u), 30, f"{name}'s router")
            known = router_pods(lab, url)
            assert known == own, f"{name}'s router routes to {sorted(known - own)} as well"
