"""Kubernetes discovery: watch engine Pods by label selector, ready ones only.

The official client lists the namespace's Pods, then watches from that resource version,
re-listing after any error or expiry. Each change hands the full set of ready pods to a
callback (the router moves it onto its event loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pagefleet.operator.names import LABEL_ROLE
from pagefleet.router.scoring import Pod

logger = logging.getLogger("pagefleet.router")


def parse_selector(selector: str) -> dict[str, str | None]:
    """`key=value` must match, a bare `key` must exist (Kubernetes' equality selectors)."""
    labels: dict[str, str | None] = {}
    for part in filter(None, (p.strip() for p in selector.split(","))):
        key, sep, value = part.partition("=")
        if not key.strip():
            raise ValueError(f"--selector: {part!r} has no label key")
        labels[key.strip()] = value.strip() if sep else None
    return labels


def pod_from_k8s(obj, port: int, labels: dict[str, str | None]) -> Pod | None:
    """A ready, matching pod with an IP as the router sees it; None otherwise."""
    meta, status = obj.metadata, obj.status
    pod_labels = meta.labels or {}
    if any(
        (k not in pod_labels) if v is None else (pod_labels.get(k) != v) for k, v in labels.items()
    ):
        return None  # also filtered here: not every API server honours labelSelector
    if meta.deletion_timestamp or status is None or not status.pod_ip:
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    if not ready:
        return None
    return Pod(
        name=meta.name,
        url=f"http://{status.pod_ip}:{port}",
        role=pod_labels.get(LABEL_ROLE, "both"),
    )


class KubernetesDiscovery:
    def __init__(
        self,
        api,
        namespace: str,
        selector: str,
        port: int,
        on_change: Callable[[list[Pod]], None],
        retry_s: float = 1.0,
    ) -> None:
        self.api, self.namespace, self.port = api, namespace, port
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
        pod = None if kind == "DELETED" else pod_from_k8s(obj, self.port, self.labels)
        if pod is None:
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod

    def _emit(self) -> None:
        self.on_change(sorted(self.pods.values(), key=lambda p: p.name))
