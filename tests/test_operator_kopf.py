"""The kopf operator in-process against kmock's KubernetesEmulator: create, edit, drift,
idempotence, ownerReferences, bad specs, and builtin autoscaling from fake pods' /metrics."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kopf

from kube_emulator import kubernetes_emulator
from pagefleet.operator.handlers import (
    KubeClient,
    OperatorConfig,
    OperatorState,
    build_registry,
    configure,
    reconcile,
)
from server_utils import PAGEFLEET

NS = "serving"
RESOURCES = {
    "pagefleet.io/v1alpha1/modeldeployments": ("ModelDeployment", True, {"status", "scale"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, ()),
    "v1/namespaces": ("Namespace", False, ()),
    "v1/pods": ("Pod", True, ()),
    "v1/events": ("Event", True, ()),
    "v1/services": ("Service", True, ()),
    "v1/configmaps": ("ConfigMap", True, ()),
    "v1/serviceaccounts": ("ServiceAccount", True, ()),
    "apps/v1/deployments": ("Deployment", True, ()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, ()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, ()),
    "keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True, ()),
}


def emulator():
    return kubernetes_emulator(RESOURCES)


@contextmanager
def operator(url: str, client: KubeClient, **config) -> Iterator[None]:
    """`pagefleet operator`'s registry run by kopf in a thread, stopped at the end."""
    registry = build_registry(OperatorConfig(api_url=url, **config), client)
    settings = configure(kopf.OperatorSettings(), post_events=False)
    settings.watching.server_timeout = 5
    settings.watching.reconnect_backoff = 0.2
    stop, started = threading.Event(), threading.Event()

    def run() -> None:
        asyncio.run(
            kopf.operator(
                registry=registry,
                settings=settings,
                clusterwide=True,
                standalone=True,
                stop_flag=stop,
                ready_flag=started,
            )
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(15), "kopf did not start"
    try:
        yield
    finally:
        stop.set()
        thread.join(15)
        assert not thread.is_alive(), "kopf did not stop"


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def model_deployment(name: str = "llama", **spec) -> dict:
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        # The emulator does not assign these as an API server would (kopf's JSON patches
        # test resourceVersion; it never changes here).
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": {
            "model": {"name": "llama-3-8b", "pvc": {"claimName": "models", "path": "llama"}},
            **spec,
        },
    }


def get(client: KubeClient, api_version: str, kind: str, name: str) -> dict | None:
    return client.get(api_version, kind, NS, name)


def md_status(client: KubeClient, name: str = "llama") -> dict:
    return (get(client, "pagefleet.io/v1alpha1", "ModelDeployment", name) or {}).get("status") or {}


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def test_create_edit_drift_and_idempotence():
    with emulator() as url:
        client, probe = KubeClient(url), KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
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
            # Only kopf's own finalizer (it stops the timer on deletion, then lets go); the
            # owned objects are left to the garbage collector via the ownerReferences above.
            md = get(probe, "pagefleet.io/v1alpha1", "ModelDeployment", "llama")
            assert md["metadata"].get("finalizers") == ["pagefleet.io/operator"]

            # Converged: further timer passes (every 0.3 s) write nothing, objects nor status.
            def settled() -> bool:
                before = client.writes
                time.sleep(0.7)
                return client.writes == before

            wait_for(settled, what="the operator to settle")
            writes = client.writes
            time.sleep(1.5)
            assert client.writes == writes, "an unchanged ModelDeployment caused writes"

            # Drift: someone scales the Deployment by hand; the operator puts it back.
            probe.merge_patch(deployment, {"spec": {"replicas": 7}})
            wait_for(
                lambda: (
                    get(probe, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"] == 2
                ),
                what="drift corrected",
            )

            # Editing the spec patches the owned objects.
            md = get(probe, "pagefleet.io/v1alpha1", "ModelDeployment", "llama")
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

            # Deleting: the operator releases its finalizer and the resource goes away.
            probe.request(
                "DELETE", KubeClient.path("pagefleet.io/v1alpha1", "ModelDeployment", NS, "llama")
            )
            wait_for(
                lambda: get(probe, "pagefleet.io/v1alpha1", "ModelDeployment", "llama") is None,
                what="deletion completed",
            )


def test_bad_spec_is_degraded_not_a_crash():
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            bad = model_deployment(
                pools={"colocated": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}
            )
            client.create(bad)
            degraded = wait_for(
                lambda: (
                    condition(md_status(client), "Degraded").get("status") == "True"
                    and condition(md_status(client), "Degraded")
                ),
                what="Degraded",
            )
            assert degraded["reason"] == "InvalidSpec"
            assert "minReplicas" in degraded["message"]
            assert get(client, "apps/v1", "Deployment", "llama-colocated") is None
            # Fixing the spec recovers without restarting anything.
            md = get(client, "pagefleet.io/v1alpha1", "ModelDeployment", "llama")
            client.merge_patch(
                md, {"spec": {"pools": {"colocated": {"autoscaling": {"minReplicas": 1}}}}}
            )
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            wait_for(
                lambda: condition(md_status(client), "Degraded").get("status") == "False",
                what="Degraded cleared",
            )


class QueueMetrics(BaseHTTPRequestHandler):
    """A fake engine's /metrics: the queue depth the test sets."""

    def do_GET(self) -> None:
        waiting = self.server.waiting  # type: ignore[attr-defined]
        body = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="llama-3-8b"}} {waiting}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="llama-3-8b"} 8\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def fake_metrics(waiting: float) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), QueueMetrics)
    server.waiting = waiting  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()


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
        with operator(url, client, autoscale_interval=0.3, metrics_port=port):
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
            time.sleep(1.0)
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
        with operator(url, client, **config):
            client.create(model_deployment(pools={"colocated": {"autoscaling": autoscaling}}))
            scaled = wait_for(
                lambda: get(client, "keda.sh/v1alpha1", "ScaledObject", "llama-colocated")
            )
            assert scaled["spec"]["scaleTargetRef"]["name"] == "llama-colocated"
            deployment = wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            assert "replicas" not in deployment["spec"]
            # KEDA's HPA sets replicas; the operator must not undo it.
            client.merge_patch(deployment, {"spec": {"replicas": 6}})
            time.sleep(1.0)
            assert get(client, "apps/v1", "Deployment", "llama-colocated")["spec"]["replicas"] == 6
            # Back to a fixed size: the ScaledObject is paused (no delete rights needed) so
            # KEDA stops fighting, and the spec's replicas apply.
            md = get(client, "pagefleet.io/v1alpha1", "ModelDeployment", "llama")
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
            md = get(client, "pagefleet.io/v1alpha1", "ModelDeployment", "llama")
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
            time.sleep(1.5)  # three more timer ticks: the same problem is not re-announced
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
