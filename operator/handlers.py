"""The kopf shell: on create/update/resume and on a timer, render the desired objects, apply only
what differs (merge patches), run the builtin autoscaler, and write status."""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from pagefleet.operator.autoscale import Observation, PoolReplicas, decide, trim
from pagefleet.operator.metrics_source import (
    PodScraper,
    PoolPods,
    PrometheusSource,
    ready_pod_ips,
)
from pagefleet.operator.names import GROUP, PLURAL, VERSION
from pagefleet.operator.reconcile import (
    RenderOptions,
    desired_objects,
    pool_object_name,
    pool_selector,
    retired_objects,
)
from pagefleet.operator.spec import Pool, Spec, SpecError, parse_spec
from pagefleet.operator.status import Observed, PoolObserved, build_status

log = logging.getLogger("pagefleet.operator")


@dataclass(frozen=True)
class OperatorConfig:
    default_image: str | None = None
    prometheus_url: str | None = None
    metrics_port: int = 8000
    # One timer per ModelDeployment does both the drift check and the autoscaler's evaluation,
    # so the two never race on the same Deployment.
    autoscale_interval: float = 15.0
    api_url: str | None = None  # log in to this URL without credentials (tests, kubectl proxy)


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class KubeClient:
    """Generic get/create/merge-patch of namespaced objects over the official client's
    authenticated transport (in-cluster config, kubeconfig, or a plain URL)."""

    def __init__(self, api_url: str | None = None) -> None:
        from kubernetes import client, config

        if api_url:
            configuration = client.Configuration()
            configuration.host = api_url.rstrip("/")
            self.api = client.ApiClient(configuration)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self.api = client.ApiClient()
        self.writes = 0  # create/patch requests sent: lets tests check idempotence

    @staticmethod
    def path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        # Every kind the operator touches has the plain plural (deployments, rolebindings...).
        path = f"{base}/namespaces/{namespace}/{kind.lower()}s"
        return f"{path}/{name}" if name else path

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict | None:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, _ = self.api.param_serialize(
            method=method,
            resource_path=path,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=body, _request_timeout=30
        )
        data = response.read()
        if response.status == 404:
            return None
        if response.status >= 400:
            raise ApiError(response.status, data.decode(errors="replace")[:500])
        return json.loads(data) if data else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self.request("GET", self.path(api_version, kind, namespace, name))

    def list(self, api_version: str, kind: str, namespace: str, selector: dict[str, str]) -> list:
        query = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        path = self.path(api_version, kind, namespace) + f"?labelSelector={query}"
        return (self.request("GET", path) or {}).get("items", [])

    def create(self, obj: dict) -> dict | None:
        self.writes += 1
        meta = obj["metadata"]
        path = self.path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return self.request("POST", path, obj)

    def merge_patch(self, obj: dict, patch: dict, subresource: str = "") -> dict | None:
        self.writes += 1
        meta = obj["metadata"]
        path = self.path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self.request(
            "PATCH", path + subresource, patch, content_type="application/merge-patch+json"
        )


def contains(actual: Any, wanted: Any) -> bool:
    """Whether `actual` already says everything `wanted` says. Fields the API server adds
    (defaults, status, uid) do not count as drift; quantities compare as text ("1" == 1)."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(actual[k], v) for k, v in wanted.items()
        )
    if isinstance(wanted, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(wanted)
            and all(contains(a, w) for a, w in zip(actual, wanted, strict=True))
        )
    if isinstance(wanted, bool) or isinstance(actual, bool):
        return actual is wanted
    if isinstance(wanted, int | float) and isinstance(actual, str | int | float):
        return str(actual) == str(wanted) or actual == wanted
    return actual == wanted


def merge_diff(old: dict, new: dict, prune: bool = False) -> dict:
    """The JSON merge patch turning `old` into `new` (empty when equal). With `prune`, keys
    only `old` has are removed (null); the top level of status keeps other writers' keys."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_diff(before, value, prune=True)
            if sub:
                patch[key] = sub
        elif before != value:
            patch[key] = value
    if prune:
        patch.update({key: None for key in old if key not in new})
    return patch


def retire(client: KubeClient, patch: dict, owner_uid: str) -> bool:
    """Apply a retirement patch to an existing object this ModelDeployment controls."""
    meta = patch["metadata"]
    current = client.get(patch["apiVersion"], patch["kind"], meta["namespace"], meta["name"])
    if current is None or contains(current, patch):
        return False
    owners = current.get("metadata", {}).get("ownerReferences") or []
    if not any(o.get("uid") == owner_uid and o.get("controller") for o in owners):
        return False  # not ours: never touch someone else's object of the same name
    client.merge_patch(current, patch)
    return True


def apply(client: KubeClient, obj: dict) -> str:
    """Create the object, or merge-patch it when it drifted; returns what was done."""
    meta = obj["metadata"]
    current = client.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
    if current is None:
        client.create(obj)
        return "created"
    if contains(current, obj):
        return "unchanged"
    client.merge_patch(current, obj)
    return "patched"


@dataclass
class PoolMemory:
    history: tuple[Observation, ...] = ()
    replicas: int | None = None
    reason: str = ""


@dataclass
class OperatorState:
    """Per-operator (not per-module) memory: a lock and the autoscaler's history per object."""

    config: OperatorConfig
    client: KubeClient
    locks: dict[str, threading.Lock] = field(default_factory=dict)
    pools: dict[tuple[str, str], PoolMemory] = field(default_factory=dict)
    guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, uid: str) -> threading.Lock:
        with self.guard:
            return self.locks.setdefault(uid, threading.Lock())

    def memory(self, uid: str, pool: str) -> PoolMemory:
        with self.guard:
            return self.pools.setdefault((uid, pool), PoolMemory())

    def forget(self, uid: str) -> None:
        with self.guard:
            self.locks.pop(uid, None)
            for key in [k for k in self.pools if k[0] == uid]:
                del self.pools[key]


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _deployment(client: KubeClient, namespace: str, name: str) -> tuple[int, int]:
    found = client.get("apps/v1", "Deployment", namespace, name) or {}
    replicas = (found.get("spec") or {}).get("replicas")
    ready = (found.get("status") or {}).get("readyReplicas") or 0
    return (replicas if replicas is not None else 0), ready


def remembered(state: OperatorState, md: dict, pool: Pool) -> PoolMemory:
    """The pool's autoscaler memory; after an operator restart its replicas continue from the
    status' last decision (else the Deployment's), so a restart never resets a scaled pool."""
    meta = md["metadata"]
    memory = state.memory(meta["uid"], pool.name)
    if memory.replicas is None:
        recorded = ((md.get("status") or {}).get("pools") or {}).get(pool.name) or {}
        if "desiredReplicas" in recorded:
            memory.replicas = recorded["desiredReplicas"]
        else:
            name = pool_object_name(meta["name"], pool.name)
            current, _ = _deployment(state.client, meta["namespace"], name)
            memory.replicas = current or pool.replicas
    return memory


def autoscale_pool(
    state: OperatorState, md: dict, spec: Spec, pool: Pool, now: float
) -> PoolMemory:
    """One builtin evaluation: read the pool's queue, decide, remember the decision."""
    meta = md["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    memory = remembered(state, md, pool)
    current, ready = _deployment(state.client, namespace, pool_object_name(name, pool.name))
    pods = state.client.list("v1", "Pod", namespace, pool_selector(name, pool.name))
    pool_pods = PoolPods(namespace, name, pool.name, spec.model.name, ready_pod_ips(pods))
    source = (
        PrometheusSource(state.config.prometheus_url)
        if state.config.prometheus_url
        else PodScraper(state.config.metrics_port)
    )
    reading = source.read(pool_pods)
    observation = Observation(now, reading.waiting, reading.running, reading.pods, current)
    memory.history = trim((*memory.history, observation), pool.autoscaling, now)
    decision = decide(memory.history, PoolReplicas(current, ready), pool.autoscaling, now)
    if decision.replicas != memory.replicas:
        log.info("%s/%s pool %s: %s", namespace, name, pool.name, decision.reason)
    memory.replicas, memory.reason = decision.replicas, decision.reason
    return memory


def _pool_reason(pool: Pool, memory: PoolMemory | None) -> str:
    if pool.autoscaling.mode == "builtin" and memory is not None and memory.reason:
        return memory.reason
    if pool.autoscaling.mode == "keda":
        return "scaled by KEDA ScaledObject on vllm:num_requests_waiting"
    return f"spec.pools.{pool.name}.replicas"


def reconcile(state: OperatorState, namespace: str, name: str, autoscale: bool) -> None:
    """Read the ModelDeployment afresh, (optionally) autoscale, apply, write status."""
    client = state.client
    md = client.get(f"{GROUP}/{VERSION}", "ModelDeployment", namespace, name)
    if md is None:
        return
    with state.lock(md["metadata"]["uid"]):
        _reconcile_locked(state, md, autoscale)


def _reconcile_locked(state: OperatorState, md: dict, autoscale: bool) -> None:
    client, config = state.client, state.config
    meta = md["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    error: tuple[str, str] | None = None
    pools: list[PoolObserved] = []
    router = (0, 0)
    try:
        spec = parse_spec(md.get("spec"), config.default_image)
        memories: dict[str, PoolMemory] = {}
        for pool in spec.pools:
            if pool.autoscaling.mode != "builtin":
                continue
            if autoscale:
                memories[pool.name] = autoscale_pool(state, md, spec, pool, time.monotonic())
            else:
                memories[pool.name] = remembered(state, md, pool)
        replicas = {p: m.replicas for p, m in memories.items() if m.replicas is not None}
        options = RenderOptions(config.default_image, config.prometheus_url, replicas)
        for obj in desired_objects(md, options):
            done = apply(client, obj)
            if done != "unchanged":
                log.info("%s %s/%s %s", done, obj["kind"], namespace, obj["metadata"]["name"])
        for patch in retired_objects(md):
            if retire(client, patch, meta["uid"]):
                log.info("retired %s/%s %s", patch["kind"], namespace, patch["metadata"]["name"])
        for pool in spec.pools:
            current, ready = _deployment(client, namespace, pool_object_name(name, pool.name))
            desired = replicas.get(
                pool.name, current if pool.autoscaling.mode == "keda" else pool.replicas
            )
            reason = _pool_reason(pool, memories.get(pool.name))
            pools.append(PoolObserved(pool.name, current, ready, desired, reason))
        router = _deployment(client, namespace, f"{name}-router")
    except SpecError as e:
        error = ("InvalidSpec", str(e))
    except ApiError as e:
        error = ("ApplyFailed", str(e))
    previous = md.get("status") or {}
    if error and _degraded_message(previous) != error[1]:
        # One event per new problem, not one per timer tick.
        kopf.warn(md, reason=error[0], message=error[1])
    observed = Observed(tuple(pools), router[0], router[1], error)
    status = build_status(name, meta.get("generation"), observed, previous, _now_iso())
    patch = merge_diff(previous, status)
    if patch:
        client.merge_patch(md, {"status": patch}, "/status")


def _degraded_message(status: dict) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "Degraded" and c.get("status") == "True":
            return c.get("message")
    return None


def configure(settings: kopf.OperatorSettings, post_events: bool = True) -> kopf.OperatorSettings:
    settings.posting.enabled = post_events
    # A deleted ModelDeployment waits for its timer to stop; kopf checks every 60 s by default.
    settings.background.cancellation_polling = 1.0
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-applied-spec"
    )
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    return settings


def build_registry(
    config: OperatorConfig, client: KubeClient | None = None
) -> kopf.OperatorRegistry:
    """Handlers bound to one operator's state (no module-level registry or memory)."""
    registry = kopf.OperatorRegistry() if config.api_url else kopf.SmartOperatorRegistry()
    state = OperatorState(config, client or KubeClient(config.api_url))
    resource = (GROUP, VERSION, PLURAL)

    if config.api_url:

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=config.api_url, insecure=True)

    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, registry=registry)
    def on_change(name: str, namespace: str, **_: Any) -> None:
        reconcile(state, namespace, name, autoscale=False)

    # Owned objects go with the garbage collector (ownerReferences); this only drops memory.
    # (The timer makes kopf keep a finalizer anyway, to stop the timer before deletion.)
    @kopf.on.delete(*resource, optional=True, registry=registry)
    def on_delete(uid: str, **_: Any) -> None:
        state.forget(uid)

    # Every tick: autoscale the builtin pools and correct drift. Reading a handful of objects
    # per ModelDeployment is cheap; writes only happen when something differs.
    @kopf.timer(*resource, interval=config.autoscale_interval, registry=registry)
    def on_timer(name: str, namespace: str, **_: Any) -> None:
        reconcile(state, namespace, name, autoscale=True)

    return registry
