"""The kopf operator in-process against kmock's KubernetesEmulator: create, edit, drift,
idempotence, ownerReferences, bad specs, and builtin autoscaling from fake pods' /metrics."""

from __future__ import annotations

import base64
import datetime
import signal
import subprocess
import threading

import kubernetes_validate
from operator_harness import (
    MD_API,
    NS,
    condition,
    delete,
    emulator,
    get,
    md_status,
    metrics_server,
    model_deployment,
    next_pass,
    operator,
    sample,
    samples,
    wait_degraded,
    wait_for,
)

from pagefleet.operator import handlers
from pagefleet.operator.handlers import (
    KubeClient,
    OperatorConfig,
    OperatorState,
    _now_iso,
    reconcile,
)
from pagefleet.operator.reconcile import EngineImages
from server_utils import PAGEFLEET

MD_LABELS = {"namespace": NS, "pagefleet_io_deployment": "llama"}
ERRORS = "pagefleet_operator:reconcile_errors_total"


def test_create_edit_drift_and_idempotence():
    with emulator() as url:
        client, probe = KubeClient(url), KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            probe.create(model_deployment(pools={"colocated": {"replicas": 2}}))
            deployment = wait_for(
                lambda: get(probe, "apps/v1", "Deployment", "llama-colocated"), what="engine"
            )
            assert deployment["spec"]["replicas"] == 2
            owner = deployment["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["uid"], owner["controller"]) == (
                "ModelDeployment",
                "uid-llama",
                True,
            )
            for kind, name in [
                ("Service", "llama-colocated"),
                ("Service", "llama-router"),
                ("ConfigMap", "llama-router"),
            ]:
                obj = wait_for(lambda k=kind, n=name: get(probe, "v1", k, n), what=name)
                assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
            router = wait_for(lambda: get(probe, "apps/v1", "Deployment", "llama-router"))
            assert "--selector" in router["spec"]["template"]["spec"]["containers"][0]["command"]

            status = wait_for(lambda: md_status(probe).get("pools"), what="status")
            assert status["colocated"]["desiredReplicas"] == 2
            full = md_status(probe)
            assert condition(full, "Ready")["reason"] == "PodsNotReady"
            assert condition(full, "Progressing")["status"] == "True"
            # What the scale subresource and the printer columns read.
            assert full["replicas"] == 2 and full["ready"] == "colocated 0/2"
            assert full["selector"] == "pagefleet.io/deployment=llama,pagefleet.io/pool=colocated"
            # No finalizer: the owned objects go with the garbage collector via the
            # ownerReferences above, and deleting needs no operator.
            next_pass(state)
            md = get(probe, MD_API, "ModelDeployment", "llama")
            assert not md["metadata"].get("finalizers")

            # Converged: further periodic passes write nothing, objects nor status.
            def settled() -> bool:
                before = client.writes
                next_pass(state)
                return client.writes == before

            wait_for(settled, what="the operator to settle")
            writes = client.writes
            next_pass(state)
            next_pass(state)
            assert client.writes == writes, "an unchanged ModelDeployment caused writes"

            # Drift: someone edits the engines' image; the operator puts it back.
            drift_and_wait_for_correction(probe, "llama-colocated")

            # Scaling the Deployment by hand (kubectl scale, an HPA) is not drift for a pool
            # without autoscaling: it stays, and status reports it.
            probe.merge_patch(deployment, {"spec": {"replicas": 7}})
            wait_for(lambda: md_status(probe)["pools"]["colocated"]["desiredReplicas"] == 7)
            next_pass(state)
            assert get(probe, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"] == 7

            # Editing the spec patches the owned objects.
            md = get(probe, MD_API, "ModelDeployment", "llama")
            probe.merge_patch(
                md,
                {
                    "metadata": {"generation": 2},
                    "spec": {
                        "pools": {"colocated": {"replicas": 3}},
                        "engineArgs": {"max-model-len": 4096},
                    },
                },
            )

            def edited() -> bool:
                d = get(probe, "apps/v1", "Deployment", "llama-colocated")
                command = d["spec"]["template"]["spec"]["containers"][0]["command"]
                return d["spec"]["replicas"] == 3 and "4096" in command

            wait_for(edited, what="spec edit applied")
            wait_for(lambda: md_status(probe).get("observedGeneration") == 2, what="generation")

            # Deleting: nothing holds the resource.
            delete(probe, MD_API, "ModelDeployment", "llama")
            assert get(probe, MD_API, "ModelDeployment", "llama") is None


def test_bad_spec_is_degraded_not_a_crash():
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            bad = model_deployment(
                pools={"colocated": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}
            )
            client.create(bad)
            degraded = wait_degraded(client, "InvalidSpec")
            assert "minReplicas" in degraded["message"]
            assert get(client, "apps/v1", "Deployment", "llama-colocated") is None
            # Fixing the spec recovers without restarting anything.
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(
                md, {"spec": {"pools": {"colocated": {"autoscaling": {"minReplicas": 1}}}}}
            )
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            wait_for(
                lambda: condition(md_status(client), "Degraded").get("status") == "False",
                what="Degraded cleared",
            )


def queue_page(server) -> str:
    """A fake engine's /metrics: the queue depth the test sets."""
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="llama-3-8b"}} {server.waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="llama-3-8b"} 8\n'
    )


def fake_metrics(waiting: float):
    return metrics_server(queue_page, waiting=waiting)


def ready_pod(name: str, pool: str) -> dict:
    """A pod as the kubelet would report it: labelled for its pool, Ready, at 127.0.0.1 (where
    the fake /metrics listens; the operator scrapes podIP:--metrics-port)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"pagefleet.io/deployment": "llama", "pagefleet.io/pool": pool},
        },
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_builtin_autoscaler_scales_decode_from_pod_metrics():
    autoscaling = {"mode": "builtin", "minReplicas": 1, "maxReplicas": 6, "maxScaleUpStep": 2}
    spec = {
        "mode": "disaggregated",
        "pools": {
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1, "autoscaling": {**autoscaling, "targetWaitingPerReplica": 4}},
        },
    }
    with emulator() as url, fake_metrics(waiting=20) as metrics:
        client, probe = KubeClient(url), KubeClient(url)
        port = metrics.server_address[1]
        with operator(url, client, autoscale_interval=0.3, metrics_port=port) as state:
            probe.create(model_deployment(**spec))
            decode = wait_for(lambda: get(probe, "apps/v1", "Deployment", "llama-decode"))
            probe.create(ready_pod("llama-decode-0", "decode"))
            # The kubelet's part: the Deployment reports its pods ready.
            probe.merge_patch(decode, {"status": {"readyReplicas": 1}})
            # 20 waiting on 1 pod, target 4/pod: ceil(1 x 20/4) = 5, step-limited to 1 + 2.
            wait_for(
                lambda: (
                    get(probe, "apps/v1", "Deployment", "llama-decode")["spec"]["replicas"] == 3
                ),
                what="decode scaled up",
            )
            pool = wait_for(
                lambda: (
                    md_status(probe).get("pools", {}).get("decode", {}).get("desiredReplicas") == 3
                    and md_status(probe)["pools"]["decode"]
                )
            )
            assert "20 waiting" in pool["reason"] and "step limited to +2" in pool["reason"]
            # The new pods are not ready: no further scale-up however long the queue stays.
            wait_for(
                lambda: "to be ready" in md_status(probe)["pools"]["decode"]["reason"],
                what="the pending-pods hold",
            )
            next_pass(state)
            next_pass(state)
            decode = get(probe, "apps/v1", "Deployment", "llama-decode")
            assert decode["spec"]["replicas"] == 3
            # The prefill pool (autoscaling none) is left alone.
            prefill = get(probe, "apps/v1", "Deployment", "llama-prefill")
            assert prefill["spec"]["replicas"] == 1
            # Once they are ready, the next step goes to the formula's 5 (1 pod reports 20).
            probe.merge_patch(decode, {"status": {"readyReplicas": 3}})
            wait_for(
                lambda: (
                    get(probe, "apps/v1", "Deployment", "llama-decode")["spec"]["replicas"] == 5
                ),
                what="second step",
            )


def test_keda_mode_owns_a_scaled_object_and_leaves_replicas_alone():
    autoscaling = {"mode": "keda", "minReplicas": 1, "maxReplicas": 8}
    with emulator() as url:
        client = KubeClient(url)
        config = {"autoscale_interval": 0.3, "prometheus_url": "http://prometheus:9090"}
        with operator(url, client, **config) as state:
            client.create(model_deployment(pools={"colocated": {"autoscaling": autoscaling}}))
            scaled = wait_for(
                lambda: get(client, "keda.sh/v1alpha1", "ScaledObject", "llama-colocated")
            )
            assert scaled["spec"]["scaleTargetRef"]["name"] == "llama-colocated"
            deployment = wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            assert "replicas" not in deployment["spec"]
            # KEDA's HPA sets replicas; the operator must not undo it.
            client.merge_patch(deployment, {"spec": {"replicas": 6}})
            next_pass(state)
            assert get(client, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"] == 6
            # Back to a fixed size: the ScaledObject is paused (no delete rights needed) so
            # KEDA stops fighting, and the spec's replicas apply.
            md = get(client, MD_API, "ModelDeployment", "llama")
            off = {"replicas": 2, "autoscaling": {"mode": "none"}}
            client.merge_patch(md, {"spec": {"pools": {"colocated": off}}})
            paused = "autoscaling.keda.sh/paused"
            wait_for(
                lambda: (
                    get(client, "keda.sh/v1alpha1", "ScaledObject", "llama-colocated")["metadata"][
                        "annotations"
                    ][paused]
                    == "true"
                ),
                what="ScaledObject paused",
            )
            wait_for(
                lambda: (
                    get(client, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"] == 2
                )
            )
            # Switching to disaggregated retires the colocated pool's pods.
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(
                md,
                {
                    "spec": {
                        "mode": "disaggregated",
                        "pools": {"colocated": None, "prefill": {}, "decode": {}},
                    }
                },
            )
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-decode"), what="decode")
            wait_for(
                lambda: (
                    get(client, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"] == 0
                ),
                what="colocated pool retired",
            )
            wait_for(lambda: set(md_status(client)["pools"]) == {"prefill", "decode"})


def test_pagefleet_operator_command_runs_reports_events_and_stops_on_sigterm():
    """The real entry point, as a process: reconciles, posts a Warning event for a bad spec,
    and exits cleanly on SIGTERM (what a Pod's termination sends)."""
    with emulator() as url:
        client = KubeClient(url)
        proc = subprocess.Popen(
            [PAGEFLEET, "operator", "--kubernetes-api", url, "--autoscale-interval", "0.5"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            client.create(model_deployment())
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-router"), 30, "router")
            client.create(model_deployment("broken", mode="disaggregated"))

            def warning() -> dict | None:
                events = client.list("v1", "Event", NS, {})
                return next((e for e in events if e.get("reason") == "InvalidSpec"), None)

            event = wait_for(warning, 30, "a Warning event")
            assert event["type"] == "Warning"
            assert event["involvedObject"]["name"] == "broken"
            assert "prefill and decode" in event["message"]
            assert condition(md_status(client, "broken"), "Degraded")["status"] == "True"
            # The same problem is not re-announced. Proof that passes over "broken" ran since:
            # each round of passes covers every ModelDeployment and starts after the last one
            # ended, so drift on "llama" corrected twice means a whole round came after the
            # round that posted the event.
            for _ in range(2):
                drift_and_wait_for_correction(client, "llama-colocated")
            assert (
                sum(e.get("reason") == "InvalidSpec" for e in client.list("v1", "Event", NS, {}))
                == 1
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
        assert proc.returncode == 0, output


def drift_and_wait_for_correction(client: KubeClient, deployment: str) -> None:
    """Change the image of one of the operator's Deployments by hand; return once a pass
    put it back."""

    def image() -> str:
        found = get(client, "apps/v1", "Deployment", deployment)
        return found["spec"]["template"]["spec"]["containers"][0]["image"]

    wanted = image()
    current = get(client, "apps/v1", "Deployment", deployment)
    template = {"spec": {"containers": [{"name": "engine", "image": "evil/image:1"}]}}
    client.merge_patch(current, {"spec": {"template": template}})
    wait_for(lambda: image() == wanted, 30, f"{deployment} drift corrected")


def test_a_restarted_operator_keeps_the_autoscaled_replicas():
    """A fresh operator (empty memory) applying a ModelDeployment whose status records an
    autoscaler decision keeps that decision rather than resetting the pool to spec.replicas."""
    autoscaling = {"mode": "builtin", "minReplicas": 1, "maxReplicas": 8}
    md = model_deployment(pools={"colocated": {"replicas": 1, "autoscaling": autoscaling}})
    with emulator() as url:
        client = KubeClient(url)
        client.create(md)
        client.merge_patch(md, {"status": {"pools": {"colocated": {"desiredReplicas": 5}}}})
        state = OperatorState(OperatorConfig(api_url=url), client)
        reconcile(state, NS, "llama", autoscale=False)  # what on.resume does first
        assert get(client, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"] == 5
        status = md_status(client)
        assert status["pools"]["colocated"]["desiredReplicas"] == 5


def test_a_restarted_operator_keeps_its_scale_down_window():
    """Catches the autoscaler's window living in the operator's memory only: restarted in a
    lull, the operator took 8 replicas to 1 at once. The window is in status; the new operator
    goes on from it and holds the pool for the rest of the scale-down window."""
    autoscaling = {"mode": "builtin", "minReplicas": 1, "maxReplicas": 8, "maxScaleUpStep": 8}
    with emulator() as url, fake_metrics(waiting=64) as metrics:
        client = KubeClient(url)
        config = {"autoscale_interval": 0.3, "metrics_port": metrics.server_address[1]}
        client.create(
            model_deployment(pools={"colocated": {"replicas": 1, "autoscaling": autoscaling}})
        )
        client.create(ready_pod("llama-colocated-0", "colocated"))

        def replicas() -> int:
            return get(client, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"]

        with operator(url, client, **config):
            deployment = wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            client.merge_patch(deployment, {"status": {"readyReplicas": 1}})
            # 64 waiting on 1 pod, target 4/pod: ceil(16), clamped to 8.
            wait_for(lambda: replicas() == 8, what="scaled to 8")
            wait_for(
                lambda: (
                    [
                        r["replicas"]
                        for r in md_status(client)["pools"]["colocated"].get("recommendations", [])
                    ]
                    == [8]
                ),
                what="the window in status",
            )
        metrics.waiting = 0  # the lull begins while no operator runs
        with operator(url, client, **config) as state:
            next_pass(state)
            next_pass(state)
            assert replicas() == 8
            reason = md_status(client)["pools"]["colocated"]["reason"]
            assert "scale-down held to 8 by the 300s window" in reason, reason


def test_deleting_needs_no_operator_and_an_old_finalizer_is_released():
    """Catches the finalizer kopf keeps for a timer: `helm uninstall` deletes the operator
    before the ModelDeployment (Helm deletes kinds it does not know last), the finalizer then
    never goes, and the GPU pods stay. Now no finalizer is added, one an older operator added
    is removed, and deletion completes with no operator running."""
    with emulator() as url:
        client = KubeClient(url)
        older = model_deployment("older")
        older["metadata"]["finalizers"] = ["pagefleet.io/operator"]
        client.create(older)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(model_deployment())
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-router"), what="router")
            next_pass(state)
            next_pass(state, "uid-older")
            assert not get(client, MD_API, "ModelDeployment", "llama")["metadata"].get("finalizers")
            wait_for(
                lambda: (
                    not get(client, MD_API, "ModelDeployment", "older")["metadata"].get(
                        "finalizers"
                    )
                ),
                what="the older operator's finalizer released",
            )
        # The operator is gone, as `helm uninstall` leaves it: deletion still completes.
        for name in ("llama", "older"):
            delete(client, MD_API, "ModelDeployment", name)
            assert get(client, MD_API, "ModelDeployment", name) is None


def foreign_deployment() -> dict:
    labels = {"app": "search"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llama-colocated", "namespace": NS, "labels": labels},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "search", "image": "search:1"}]},
            },
        },
    }


def foreign_config_map() -> dict:
    owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "search", "uid": "uid-search"}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "llama-router",
            "namespace": NS,
            "ownerReferences": [{**owner, "controller": True}],
        },
        "data": {"search.yaml": "shards: 4"},
    }


def test_objects_of_our_names_that_others_own_are_left_alone_and_reported():
    """Catches apply() merge-patching any object of the same name and replacing its owner
    references (the garbage collector then deleted it with the ModelDeployment). Now such an
    object is left unchanged, the ModelDeployment is Degraded (ForeignObject) and one Warning
    event is posted per new problem."""
    with emulator() as url:
        client = KubeClient(url)
        theirs = [foreign_deployment(), foreign_config_map()]
        for obj in theirs:
            client.create(obj)

        def foreign_events() -> list[dict]:
            events = client.list("v1", "Event", NS, {})
            return [e for e in events if e.get("reason") == "ForeignObject"]

        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(model_deployment())
            degraded = wait_degraded(client, "ForeignObject")
            assert "Deployment llama-colocated" in degraded["message"]
            assert "ConfigMap llama-router" in degraded["message"]
            assert condition(md_status(client), "Ready")["status"] == "False"
            # Everything else is ours and applied.
            for kind, name in [("Service", "llama-colocated"), ("Service", "llama-router")]:
                wait_for(lambda k=kind, n=name: get(client, "v1", k, n), what=name)
            next_pass(state)
            next_pass(state)
            for obj in theirs:
                now = get(client, obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
                for key in ("spec", "data"):
                    assert now.get(key) == obj.get(key)
                for key in ("labels", "ownerReferences"):
                    assert now["metadata"].get(key) == obj["metadata"].get(key)
            (event,) = foreign_events()
            assert event["type"] == "Warning" and event["involvedObject"]["uid"] == "uid-llama"
            assert event["message"] == degraded["message"]
            kubernetes_validate.validate(event, "1.30.0", strict=True)

            # Its owner deletes the Deployment: the operator creates its own. What remains is a
            # new problem (another message), announced once more.
            delete(client, "apps/v1", "Deployment", "llama-colocated")
            ours = wait_for(
                lambda: (
                    (get(client, "apps/v1", "Deployment", "llama-colocated") or {})
                    .get("metadata", {})
                    .get("ownerReferences")
                ),
                what="our Deployment",
            )
            assert ours[0]["uid"] == "uid-llama"
            message = wait_for(
                lambda: (
                    "Deployment llama-colocated"
                    not in condition(md_status(client), "Degraded")["message"]
                    and condition(md_status(client), "Degraded")["message"]
                ),
                what="the remaining problem",
            )
            assert "ConfigMap llama-router" in message
            wait_for(lambda: len(foreign_events()) == 2, what="the second problem announced")
            next_pass(state)
            next_pass(state)
            assert len(foreign_events()) == 2


def fleet_keys(client: KubeClient, name: str = "llama") -> dict[str, bytes]:
    secret = get(client, "v1", "Secret", f"{name}-fleet-secret") or {}
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def test_the_fleet_secret_is_made_once_kept_and_owned():
    """One Secret per ModelDeployment with two random keys (>= 32 bytes of randomness each),
    owned by it (the garbage collector deletes it with it), never regenerated: a spec edit, a
    drift pass and a restarted operator leave it as it was; another ModelDeployment gets its
    own. Its NetworkPolicies come with it."""
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(model_deployment())
            keys = wait_for(lambda: fleet_keys(client), what="the fleet Secret")
            assert set(keys) == {"secret", "engine-api-key"}
            for value in keys.values():
                # 32 random bytes, URL-safe base64 text (what files and headers carry).
                assert len(base64.urlsafe_b64decode(value + b"=")) == 32
            assert keys["secret"] != keys["engine-api-key"]
            secret = get(client, "v1", "Secret", "llama-fleet-secret")
            (owner,) = secret["metadata"]["ownerReferences"]
            assert (owner["uid"], owner["controller"]) == ("uid-llama", True)
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(md, {"spec": {"engineArgs": {"max-model-len": 4096}}})
            next_pass(state)
            next_pass(state)
            client.create(model_deployment("other"))
            other = wait_for(lambda: fleet_keys(client, "other"), what="the other's Secret")
            assert other["secret"] != keys["secret"]
            policies = {"llama-router", "llama-colocated"}
            for name in policies:
                policy = wait_for(
                    lambda n=name: get(client, "networking.k8s.io/v1", "NetworkPolicy", n),
                    what=name,
                )
                assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
        with operator(url, KubeClient(url), autoscale_interval=0.3) as state:
            next_pass(state)
            assert fleet_keys(client) == keys


def test_a_tampered_fleet_secret_is_reported_never_rewritten():
    """A fleet Secret that lost a key: the operator (which may not patch Secrets) says so in
    Degraded and leaves it; a Secret of that name it does not own is a foreign object."""
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            client.create(model_deployment())
            wait_for(lambda: fleet_keys(client), what="the fleet Secret")
            secret = get(client, "v1", "Secret", "llama-fleet-secret")
            client.merge_patch(secret, {"data": {"engine-api-key": None}})
            degraded = wait_degraded(client, "FleetSecretIncomplete")
            assert "llama-fleet-secret" in degraded["message"]
            assert set(fleet_keys(client)) == {"secret"}
        theirs = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "other-fleet-secret", "namespace": NS},
            "data": {"secret": base64.b64encode(b"chosen by someone else").decode()},
        }
        client.create(theirs)
        with operator(url, client, autoscale_interval=0.3):
            client.create(model_deployment("other"))
            degraded = wait_degraded(client, "ForeignObject", name="other")
            assert "Secret other-fleet-secret" in degraded["message"]
            now = get(client, "v1", "Secret", "other-fleet-secret")
            assert now["data"] == theirs["data"] and not now["metadata"].get("ownerReferences")


def test_host_paths_outside_the_allowlist_are_refused_with_a_condition():
    """Catches hostPath model sources reading any node folder: outside --allowed-host-paths the
    operator creates nothing for the ModelDeployment and says why."""
    host_path = {"name": "tiny", "source": "hostPath", "path": "/etc/kubernetes"}
    with emulator() as url:
        client = KubeClient(url)
        hosts = ("/srv/models",)
        with operator(url, client, autoscale_interval=0.3, allowed_host_paths=hosts) as state:
            md = model_deployment()
            md["spec"]["model"] = host_path
            client.create(md)
            degraded = wait_degraded(client, "HostPathNotAllowed")
            assert "/etc/kubernetes" in degraded["message"]
            assert "/srv/models" in degraded["message"]
            # Each pass that ends Degraded is a reconcile error, by the condition's reason.
            errors = wait_for(lambda: samples(state.metrics.page(), ERRORS), what="errors")
            assert set(errors) == {frozenset({**MD_LABELS, "reason": "HostPathNotAllowed"}.items())}
            assert samples(state.metrics.page(), "pagefleet_operator:pool_replicas") == {}
            assert get(client, "apps/v1", "Deployment", "llama-colocated") is None
            assert get(client, "v1", "Secret", "llama-fleet-secret") is None
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(md, {"spec": {"model": {"path": "/srv/models/tiny"}}})
            deployment = wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            volumes = deployment["spec"]["template"]["spec"]["volumes"]
            assert {
                "name": "model",
                "hostPath": {"path": "/srv/models/tiny", "type": "Directory"},
            } in (volumes)
            wait_for(
                lambda: condition(md_status(client), "Degraded").get("status") == "False",
                what="Degraded cleared",
            )
            # Fixed: reconciles go through (no more errors) and the pool is graphed.
            errors = sample(state.metrics.page(), ERRORS)
            next_pass(state)
            page = state.metrics.page()
            assert sample(page, ERRORS) == errors
            pool = {**MD_LABELS, "pagefleet_io_pool": "colocated", "reason": "spec"}
            assert sample(page, "pagefleet_operator:pool_desired_replicas", **pool) == 1


def test_a_missing_api_key_secret_is_reported_until_it_exists():
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            client.create(
                model_deployment(apiKeySecret={"name": "llama-api-key", "key": "api-key"})
            )
            degraded = wait_degraded(client, "SecretMissing")
            assert "Secret llama-api-key not found" in degraded["message"]
            router = wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-router"))
            env = router["spec"]["template"]["spec"]["containers"][0]["env"]
            assert {
                "name": "PAGEFLEET_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "llama-api-key", "key": "api-key"}},
            } in env
            key = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "llama-api-key"}}
            key["metadata"]["namespace"] = NS
            client.create({**key, "data": {"other": base64.b64encode(b"x").decode()}})
            wait_for(
                lambda: "has no key api-key" in condition(md_status(client), "Degraded")["message"],
                what="the missing key reported",
            )
            client.merge_patch(key, {"data": {"api-key": base64.b64encode(b"k" * 32).decode()}})
            wait_for(
                lambda: condition(md_status(client), "Degraded").get("status") == "False",
                what="Degraded cleared",
            )


class _ReadsTogether(KubeClient):
    """A client whose first two ModelDeployment reads return only once both are made: two
    reconciles (kopf's handler and the periodic pass) that start at the same moment."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.together = threading.Barrier(2, timeout=15)
        self.reads = 0
        self.count = threading.Lock()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        found = super().get(api_version, kind, namespace, name)
        if kind == "ModelDeployment":
            with self.count:
                self.reads += 1
                first_two = self.reads <= 2
            if first_two:
                self.together.wait()
        return found


def test_concurrent_reconciles_announce_a_problem_once():
    """Catches reconcile() reading the ModelDeployment before taking its lock: a second,
    concurrent reconcile then judged the problem new by a status read before the first wrote
    it, and posted a second ForeignObject event (seen as a flaky
    test_objects_of_our_names_that_others_own_are_left_alone_and_reported on a busy box)."""
    with emulator() as url:
        client = _ReadsTogether(url)
        client.create(foreign_config_map())
        client.create(model_deployment())
        state = OperatorState(OperatorConfig(api_url=url), client)
        passes = [
            threading.Thread(target=reconcile, args=(state, NS, "llama", autoscale))
            for autoscale in (False, True)
        ]
        for thread in passes:
            thread.start()
        for thread in passes:
            thread.join(30)
        assert condition(md_status(client), "Degraded")["reason"] == "ForeignObject"
        events = client.list("v1", "Event", NS, {})
        assert [e["reason"] for e in events] == ["ForeignObject"]


def engine_image(client: KubeClient, deployment: str = "llama-colocated") -> str | None:
    found = get(client, "apps/v1", "Deployment", deployment)
    return found["spec"]["template"]["spec"]["containers"][0]["image"] if found else None


def test_engine_images_are_pinned_at_creation_until_status_images_is_cleared():
    """Catches an operator upgrade (new --image/--gpu-image) re-imaging every engine whose
    ModelDeployment names no image: the images of the operator that created it stay until a
    user clears status.images."""
    images_a = EngineImages("registry.test/engine:a", "registry.test/engine:a-cuda")
    images_b = EngineImages("registry.test/engine:b", "registry.test/engine:b-cuda")
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3, images=images_a):
            client.create(model_deployment())
            wait_for(lambda: engine_image(client) == images_a.cpu, what="image A")
            pinned = {"cpu": images_a.cpu, "cuda": images_a.cuda}
            wait_for(lambda: md_status(client).get("images") == pinned, what="images in status")
        with operator(url, client, autoscale_interval=0.3, images=images_b) as state:
            next_pass(state)
            next_pass(state)
            assert engine_image(client) == images_a.cpu
            assert md_status(client)["images"] == pinned
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(md, {"status": {"images": None}}, "/status")
            wait_for(lambda: engine_image(client) == images_b.cpu, what="image B")
            wanted = {"cpu": images_b.cpu, "cuda": images_b.cuda}
            wait_for(lambda: md_status(client).get("images") == wanted, what="B in status")


def test_a_builtin_pool_scaled_by_hand_is_put_back_with_one_event_naming_it():
    """Catches a manual `kubectl scale deployment` on an autoscaled pool silently fought
    (or silently kept): it goes back, and one Warning event says why and names the pool."""
    autoscaling = {"mode": "builtin", "minReplicas": 2, "maxReplicas": 4}
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(
                model_deployment(pools={"colocated": {"replicas": 2, "autoscaling": autoscaling}})
            )
            deployment = wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            assert deployment["spec"]["replicas"] == 2
            next_pass(state)
            client.merge_patch(deployment, {"spec": {"replicas": 4}})
            wait_for(
                lambda: (
                    get(client, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"] == 2
                ),
                what="manual scale reverted",
            )
            next_pass(state)
            next_pass(state)
            # The event is posted after the Deployment is put back: wait for it (CI saw the
            # list read in between), then require exactly one.
            wait_for(lambda: _reverted_events(client), what="the ManualScaleReverted event")
            reverted = _reverted_events(client)
            assert len(reverted) == 1, [e["message"] for e in reverted]
            (event,) = reverted
            assert event["type"] == "Warning"
            assert event["involvedObject"]["name"] == "llama"
            assert "llama-colocated was scaled to 4" in event["message"]
            assert "pool colocated" in event["message"] and "back to 2" in event["message"]


def test_a_hand_scale_landing_mid_pass_is_announced_once(monkeypatch):
    """Catches the CI flake's cause: a `kubectl scale` landing while a pass read the router's
    queue was put back by that pass's write with no event (the check had read the Deployment
    before it). The value the write replaces is what tells a hand scale."""
    autoscaling = {"mode": "builtin", "minReplicas": 2, "maxReplicas": 4}
    md = model_deployment(pools={"colocated": {"replicas": 2, "autoscaling": autoscaling}})
    with emulator() as url:
        client = KubeClient(url)
        client.create(md)
        state = OperatorState(OperatorConfig(api_url=url), client)
        reconcile(state, NS, "llama", autoscale=False)
        assert pool_replicas(client) == 2
        read_queue = handlers.router_queue

        def scaled_by_hand_meanwhile(*args):
            deployment = get(client, "apps/v1", "Deployment", "llama-colocated")
            client.merge_patch(deployment, {"spec": {"replicas": 4}})
            return read_queue(*args)

        monkeypatch.setattr(handlers, "router_queue", scaled_by_hand_meanwhile)
        reconcile(state, NS, "llama", autoscale=True)
        assert pool_replicas(client) == 2
        monkeypatch.setattr(handlers, "router_queue", read_queue)
        reconcile(state, NS, "llama", autoscale=True)
        reverted = _reverted_events(client)
        assert [e["message"].split(";")[0] for e in reverted] == [
            "llama-colocated was scaled to 4 by hand"
        ]


def pool_replicas(client: KubeClient, pool: str = "colocated") -> int:
    return get(client, "apps/v1", "Deployment", f"llama-{pool}")["spec"]["replicas"]


def test_a_spec_replicas_edit_applies_after_a_manual_scale():
    """Catches a pool without autoscaling keeping a hand-scaled Deployment's replicas when
    the user then edits spec.pools.<pool>.replicas (the edit must win, once)."""
    spec = {
        "mode": "disaggregated",
        "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
    }
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(model_deployment(**spec))
            deployment = wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-decode"))
            wait_for(
                lambda: (
                    md_status(client).get("pools", {}).get("decode", {}).get("specReplicas") == 2
                ),
                what="specReplicas recorded",
            )
            client.merge_patch(deployment, {"spec": {"replicas": 5}})
            wait_for(lambda: md_status(client)["pools"]["decode"]["desiredReplicas"] == 5)
            next_pass(state)
            assert pool_replicas(client, "decode") == 5
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(md, {"spec": {"pools": {"decode": {"replicas": 3}}}})
            wait_for(lambda: pool_replicas(client, "decode") == 3, what="the spec edit applied")
            wait_for(lambda: md_status(client)["pools"]["decode"]["specReplicas"] == 3)
            assert md_status(client)["pools"]["decode"]["desiredReplicas"] == 3
            # The edit applied once: a later manual scale is kept again.
            client.merge_patch(
                get(client, "apps/v1", "Deployment", "llama-decode"), {"spec": {"replicas": 6}}
            )
            wait_for(lambda: md_status(client)["pools"]["decode"]["desiredReplicas"] == 6)
            next_pass(state)
            assert pool_replicas(client, "decode") == 6
            assert pool_replicas(client, "prefill") == 1


def test_conditions_carry_the_generation_and_last_scale_time_moves_with_desired_replicas():
    """Catches conditions without observedGeneration (clients cannot tell a stale Ready from
    a current one) and a lastScaleTime never written, or rewritten on every pass."""
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(model_deployment(pools={"colocated": {"replicas": 2}}))

            def generations() -> set:
                return {
                    c.get("observedGeneration") for c in md_status(client).get("conditions", [])
                }

            wait_for(lambda: generations() == {1}, what="conditions at generation 1")
            assert {c["type"] for c in md_status(client)["conditions"]} == {
                "Ready",
                "Progressing",
                "Degraded",
            }
            first = md_status(client)["pools"]["colocated"]["lastScaleTime"]
            datetime.datetime.strptime(first, "%Y-%m-%dT%H:%M:%SZ")
            # A spec edit that changes no replicas moves the generation, not lastScaleTime.
            wait_for(lambda: _now_iso() != first, what="the clock to pass a second")
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(
                md, {"metadata": {"generation": 2}, "spec": {"engineArgs": {"max-num-seqs": 8}}}
            )
            wait_for(lambda: generations() == {2}, what="conditions at generation 2")
            assert md_status(client)["observedGeneration"] == 2
            next_pass(state)
            next_pass(state)
            assert md_status(client)["pools"]["colocated"]["lastScaleTime"] == first
            # desiredReplicas moves (a manual scale): lastScaleTime follows.
            deployment = get(client, "apps/v1", "Deployment", "llama-colocated")
            client.merge_patch(deployment, {"spec": {"replicas": 3}})
            wait_for(lambda: md_status(client)["pools"]["colocated"]["desiredReplicas"] == 3)
            moved = md_status(client)["pools"]["colocated"]["lastScaleTime"]
            assert moved > first
            next_pass(state)
            next_pass(state)
            assert md_status(client)["pools"]["colocated"]["lastScaleTime"] == moved


def test_what_a_later_spec_no_longer_sets_is_removed_from_the_deployments():
    """A merge patch of the desired object alone never removes a field: switching a model from
    hf:// to a claim would keep the download init container (against a read-only claim, so
    the pods never start), turning RDMA's host network off would keep hostNetwork, and
    Recreate would keep RollingUpdate's rollingUpdate (which the API server refuses)."""
    pd_pools = {
        "prefill": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
        "decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
    }
    hf = {"name": "llama-3-8b", "uri": "hf://org/llama@main"}
    rdma = {"rdma": {"enabled": True, "hostNetwork": True}, "connector": "nixl"}
    with emulator() as url:
        client, probe = KubeClient(url), KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            probe.create(
                model_deployment(
                    model=hf,
                    mode="disaggregated",
                    pools=pd_pools,
                    kvTransfer=rdma,
                    engineArgs={"max-model-len": 4096},  # GPU pools state it (admission)
                )
            )

            def pod(name: str = "llama-decode") -> dict:
                found = get(probe, "apps/v1", "Deployment", name) or {}
                return (found.get("spec") or {}).get("template", {}).get("spec") or {}

            def deployment_spec() -> dict:
                return get(probe, "apps/v1", "Deployment", "llama-decode")["spec"]

            wait_for(lambda: pod().get("initContainers"), 30, "the download init container")
            assert pod()["hostNetwork"] is True
            assert deployment_spec()["strategy"]["rollingUpdate"] == {
                "maxSurge": 0,
                "maxUnavailable": 1,
            }
            md = get(probe, MD_API, "ModelDeployment", "llama")
            pools = {
                name: {**pool, "strategy": {"type": "Recreate"}} for name, pool in pd_pools.items()
            }
            probe.merge_patch(
                md,
                {
                    "metadata": {"generation": 2},
                    "spec": {
                        "model": {
                            "uri": None,
                            "pvc": {"claimName": "models", "path": "llama"},
                        },
                        "pools": pools,
                        "kvTransfer": {"rdma": {"hostNetwork": False}},
                    },
                },
            )

            def pruned() -> bool:
                spec, template = deployment_spec(), pod()
                return (
                    "initContainers" not in template
                    and "hostNetwork" not in template
                    and "dnsPolicy" not in template
                    and spec["strategy"] == {"type": "Recreate"}
                )

            wait_for(pruned, 30, "fields the new spec no longer sets removed")
            volumes = {v["name"]: v for v in pod()["volumes"]}
            assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "models"
            # Removed once: the next passes find nothing to patch.
            for name in ("llama-decode", "llama-prefill"):
                assert "initContainers" not in pod(name)


LWS_API = "leaderworkerset.x-k8s.io/v1"


def test_a_pool_switching_to_several_nodes_and_back_moves_its_replicas_between_kinds():
    """A pool that becomes multi-node gets a LeaderWorkerSet with the pool's replicas, its
    Deployment goes to 0 (the operator deletes nothing) and its Service selects the group
    leaders; back on one node, the LeaderWorkerSet goes to 0 and the Deployment takes
    spec.replicas again. Catches the pool keeping the retired Deployment's 0 replicas as "its
    own" (mode none keeps a workload's replicas while spec.replicas is unchanged). A
    `kubectl scale` of the LeaderWorkerSet (its scale subresource) is kept, as for a
    Deployment."""
    one_node = {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 2}}}
    two_nodes = {**one_node, "tensorParallelSize": 4, "nodes": 2}  # still 2 GPUs per pod
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(
                model_deployment(
                    pools={"colocated": {**one_node, "tensorParallelSize": 2}},
                    engineArgs={"max-model-len": 4096},  # GPU pools state it (admission)
                )
            )
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            wait_for(
                lambda: md_status(client).get("pools", {}).get("colocated", {}).get("workload")
            )
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(md, {"spec": {"pools": {"colocated": two_nodes}}})

            def lws() -> dict | None:
                return get(client, LWS_API, "LeaderWorkerSet", "llama-colocated")

            wait_for(lambda: lws() and lws()["spec"].get("replicas") == 2, what="the LWS at 2")
            wait_for(lambda: pool_replicas(client) == 0, what="the Deployment retired")
            service = get(client, "v1", "Service", "llama-colocated")
            assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
            assert service["spec"]["publishNotReadyAddresses"] is True
            wait_for(
                lambda: md_status(client)["pools"]["colocated"]["workload"] == "LeaderWorkerSet"
            )
            assert md_status(client)["selector"].endswith(
                ",leaderworkerset.sigs.k8s.io/worker-index=0"
            )
            # kubectl scale lws llama-colocated --replicas 3: kept (spec.replicas unchanged).
            client.merge_patch(lws(), {"spec": {"replicas": 3}})
            wait_for(lambda: md_status(client)["pools"]["colocated"]["desiredReplicas"] == 3)
            next_pass(state)
            assert lws()["spec"]["replicas"] == 3
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(
                md, {"spec": {"pools": {"colocated": {"nodes": 1, "tensorParallelSize": 2}}}}
            )
            wait_for(lambda: lws()["spec"]["replicas"] == 0, what="the LWS retired")
            wait_for(lambda: pool_replicas(client) == 2, what="the Deployment back at 2")
            wait_for(
                lambda: (
                    "publishNotReadyAddresses"
                    not in get(client, "v1", "Service", "llama-colocated")["spec"]
                ),
                what="the Service back to every pod of the pool",
            )
            next_pass(state)
            assert pool_replicas(client) == 2


def _reverted_events(client) -> list[dict]:
    events = client.list("v1", "Event", NS, {})
    return [e for e in events if e["reason"] == "ManualScaleReverted"]
