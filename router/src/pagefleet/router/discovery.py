"""Kubernetes discovery: watch engine Pods by label selector, ready ones only.

The official client lists the namespace's Pods, then watches from that resource version,
re-listing after any error or expiry. Each change hands the full set of ready pods to a
callback (the router moves it onto its event loop).

Only pods the operator's engine Deployments made are routed to: controlled by a ReplicaSet
named `<deployment>-<pool>-<pod-template-hash>` as the Deployment controller names it, or, in
a multi-node pool, group leaders (worker index 0) of the LeaderWorkerSet `<deployment>-<pool>`,
whose leader StatefulSet has its name (its workers run Ray only and are never routed to); and
of the pool their labels name; the role comes from that pool, and a role label that disagrees
disqualifies the pod. A hand-made pod with copied labels, or one of another workload, is
ignored (the Kubernetes garbage collector also deletes pods whose owner does not exist).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pagefleet.common.names import LABEL_INSTANCE, LABEL_POOL, LABEL_ROLE, LABEL_WORKER_INDEX
from pagefleet.router.scoring import Pod

logger = logging.getLogger("pagefleet.router")
LABEL_TEMPLATE_HASH = "pod-template-hash"  # set by the Deployment controller
ROLE_OF_POOL = {"colocated": "both", "prefill": "prefill", "decode": "decode"}


def parse_selector(selector: str) -> dict[str, str | None]:
    """`key=value` must match, a bare `key` must exist (Kubernetes' equality selectors)."""
    labels: dict[str, str | None] = {}
    for part in filter(None, (p.strip() for p in selector.split(","))):
        key, sep, value = part.partition("=")
        if not key.strip():
            raise ValueError(f"--selector: {part!r} has no label key")
        labels[key.strip()] = value.strip() if sep else None
    return labels


def role_of_engine_pod(meta, deployment: str | None = None) -> str | None:
    """The role of a pod made by one of the operator's engine Deployments (of `deployment`,
    if given); None for any other pod."""
    labels = meta.labels or {}
    instance, pool = labels.get(LABEL_INSTANCE), labels.get(LABEL_POOL)
    if instance is None or pool not in ROLE_OF_POOL or deployment not in (None, instance):
        return None
    owners = [o for o in meta.owner_references or [] if o.controller]
    made_by = {
        ("apps/v1", "ReplicaSet", f"{instance}-{pool}-{labels.get(LABEL_TEMPLATE_HASH)}"),
    }
    if labels.get(LABEL_WORKER_INDEX) == "0":
        made_by.add(("apps/v1", "StatefulSet", f"{instance}-{pool}"))
    if len(owners) != 1 or (owners[0].api_version, owners[0].kind, owners[0].name) not in made_by:
        return None
    role = ROLE_OF_POOL[pool]
    return role if labels.get(LABEL_ROLE, role) == role else None


def pod_from_k8s(
    obj, port: int, labels: dict[str, str | None], deployment: str | None = None
) -> Pod | None:
    """A ready, matching engine pod with an IP as the router sees it; None otherwise."""
    meta, status = obj.metadata, obj.status
    pod_labels = meta.labels or {}
    if any(
        (k not in pod_labels) if v is None else (pod_labels.get(k) != v) for k, v in labels.items()
    ):
        return None  # also filtered here: not every API server honours labelSelector
    if meta.deletion_timestamp or status is None or not status.pod_ip:
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    role = role_of_engine_pod(meta, deployment)
    if not ready or role is None:
        return None
    return Pod(name=meta.name, url=f"http://{status.pod_ip}:{port}", role=role)


class KubernetesDiscovery:
    def __init__(
        self,
        api,
        namespace: str,
        selector: str,
        port: int,
        on_change: Callable[[list[Pod]], None],
        retry_s: float = 1.0,
        deployment: str | None = None,
    ) -> None:
        self.api, self.namespace, self.port = api, namespace, port
        self.deployment = deployment
        self.selector, self.labels = selector, parse_selector(selector)
        self.on_change, self.retry_s = on_change, retry_s
        self.pods: dict[str, Pod] = {}
        self._stop = threading.Event()
        self._watch = None
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)

    def start(self) -> KubernetesDiscovery:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout)

    def _run(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                listed = self.api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                self.pods = {}
                for obj in listed.items:
                    self._apply("ADDED", obj)
                self._emit()
                self._watch = watch.Watch()
                for event in self._watch.stream(
                    self.api.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=30,
                ):
                    if self._stop.is_set():
                        return
                    self._apply(event["type"], event["object"])
                    self._emit()
            except Exception as e:  # API server away or watch expired: list again
                if self._stop.is_set():
                    return
                logger.warning("kubernetes discovery: %r; retrying", e)
                time.sleep(self.retry_s)

    def _apply(self, kind: str, obj) -> None:
        name = obj.metadata.name
        pod = (
            None
            if kind == "DELETED"
            else pod_from_k8s(obj, self.port, self.labels, self.deployment)
        )
        if pod is None:
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod

    def _emit(self) -> None:
        self.on_change(sorted(self.pods.values(), key=lambda p: p.name))
