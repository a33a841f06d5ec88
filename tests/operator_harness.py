"""The operator as tests run it: kopf in a thread against kmock's emulator, with the state its
periodic passes count, so a test can wait for the operator's next pass instead of sleeping."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kopf
from prometheus_client.parser import text_string_to_metric_families

from kube_emulator import kubernetes_emulator
from pagefleet.operator.handlers import (
    KubeClient,
    OperatorConfig,
    OperatorState,
    build_registry,
    configure,
)

NS = "serving"
MD_API = "pagefleet.io/v1alpha1"
RESOURCES = {
    "pagefleet.io/v1alpha1/modeldeployments": ("ModelDeployment", True, {"status", "scale"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, ()),
    "v1/namespaces": ("Namespace", False, ()),
    "v1/pods": ("Pod", True, ()),
    "v1/events": ("Event", True, ()),
    "v1/services": ("Service", True, ()),
    "v1/configmaps": ("ConfigMap", True, ()),
    "v1/secrets": ("Secret", True, ()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, ()),
    "v1/serviceaccounts": ("ServiceAccount", True, ()),
    "apps/v1/deployments": ("Deployment", True, ()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, ()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, ()),
    "keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True, ()),
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": ("LeaderWorkerSet", True, {"scale"}),
    "coordination.k8s.io/v1/leases": ("Lease", True, ()),  # `pagefleet operator`'s election
}


def emulator():
    return kubernetes_emulator(RESOURCES)


@contextmanager
def operator(url: str, client: KubeClient, **config) -> Iterator[OperatorState]:
    """`pagefleet operator`'s registry run by kopf in a thread, stopped at the end; yields the
    operator's state (its pass counts)."""
    state = OperatorState(OperatorConfig(api_url=url, **config), client)
    registry = build_registry(state)
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
        yield state
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
        time.sleep(0.05)


def next_pass(state: OperatorState, uid: str = "uid-llama", timeout: float = 15.0) -> None:
    """Return once a whole periodic pass over the ModelDeployment began after this call: the
    operator has then had its chance to act on everything true before it (the pass under way
    at the call may have read the world earlier, hence two)."""
    start = state.passes.get(uid, 0)
    wait_for(lambda: state.passes.get(uid, 0) >= start + 2, timeout, "the operator's next pass")


def model_deployment(name: str = "llama", **spec) -> dict:
    return {
        "apiVersion": MD_API,
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
    return (get(client, MD_API, "ModelDeployment", name) or {}).get("status") or {}


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def wait_degraded(client: KubeClient, reason: str, name: str = "llama") -> dict:
    """The ModelDeployment's Degraded condition, once it is True for this reason."""

    def degraded() -> dict | None:
        found = condition(md_status(client, name), "Degraded")
        return found if (found.get("status"), found.get("reason")) == ("True", reason) else None

    return wait_for(degraded, what=f"Degraded: {reason}")


def delete(client: KubeClient, api_version: str, kind: str, name: str) -> None:
    client.request("DELETE", KubeClient.path(api_version, kind, NS, name))


class _MetricsPage(BaseHTTPRequestHandler):
    """Any GET: the server's `page(server)` now, as a Prometheus text page (None: 503, a pod
    that no longer serves)."""

    def do_GET(self) -> None:
        page = self.server.page(self.server)  # type: ignore[attr-defined]
        if page is None:
            self.send_error(503)
            return
        body = page.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def metrics_server(
    page: Callable[[Any], str | None], **state: Any
) -> Iterator[ThreadingHTTPServer]:
    """A stand-in pod's /metrics on 127.0.0.1 (where the test's pods have their podIP): the
    text `page(server)` returns, `state` set on the server before it starts (a test changes
    it to change what the operator reads)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _MetricsPage)
    server.page = page  # type: ignore[attr-defined]
    for key, value in state.items():
        setattr(server, key, value)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()


def samples(page: str | bytes, name: str) -> dict[frozenset, float]:
    """The samples called `name` on a Prometheus text page, by their label sets."""
    text = page.decode() if isinstance(page, bytes) else page
    return {
        frozenset(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def sample(page: str | bytes, name: str, **labels: str) -> float | None:
    """The value of the one sample called `name` whose labels include `labels` (None if
    there is none; an error if there are several)."""
    found = [v for k, v in samples(page, name).items() if set(labels.items()) <= k]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None
