"""The kopf shell: on create/update/resume and on a periodic pass, render the desired objects,
apply only what differs (merge patches) to objects this ModelDeployment controls, run the
builtin autoscaler, and write status. No finalizer: owner references do the cleanup."""

from __future__ import annotations

import asyncio
import base64
import datetime
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from pagefleet.common.fleet_auth import generate_fleet_secret
from pagefleet.common.names import GROUP, KIND, PLURAL, VERSION
from pagefleet.operator.admission import (
    CapacityRefused,
    CapacityVerdict,
    ModelConfigs,
    check_adapters,
    check_capacity,
)
from pagefleet.operator.autoscale import (
    Observation,
    PoolReplicas,
    Recommendation,
    ScaleReason,
    decide,
    needed,
    window_from_status,
)
from pagefleet.operator.metrics import API_ERROR, UNEXPECTED, OperatorMetrics, ReadSource
from pagefleet.operator.metrics_source import (
    PodScraper,
    PoolPods,
    PrometheusSource,
    RouterPods,
    RouterQueue,
    RouterScraper,
    ready_pod_ips,
    running_pod_ips,
)
from pagefleet.operator.network_policy import PolicyPeers
from pagefleet.operator.reconcile import (
    ENGINE_API_KEY,
    EPP_METRICS_PORT,
    FLEET_SECRET_KEY,
    ROUTER_PORT,
    EngineImages,
    RenderOptions,
    desired_objects,
    epp_selector,
    retired_objects,
    router_selector,
    serving_selector,
    workload_kind,
    workload_ref,
)
from pagefleet.operator.spec import (
    DEFAULT_ROUTER_IMAGE,
    Adapter,
    Pool,
    SecretKeyRef,
    Spec,
    SpecError,
    parse_spec,
)
from pagefleet.operator.status import Observed, PoolObserved, build_status

log = logging.getLogger("pagefleet.operator")
# On each object the operator applies: what it set (kubectl's last-applied idea), so that a
# field a later spec no longer sets (an init container, hostNetwork, an affinity) is removed.
LAST_APPLIED = f"{GROUP}/last-applied"


@dataclass(frozen=True)
class OperatorConfig:
    # Engine images for ModelDeployments that name none, by device; each ModelDeployment
    # keeps (in status.images) those of the operator that created it.
    images: EngineImages = field(default_factory=EngineImages)
    router_image: str = DEFAULT_ROUTER_IMAGE
    prometheus_url: str | None = None
    metrics_port: int = 8000
    router_metrics_port: int = ROUTER_PORT  # where the router's queue is read (/metrics)
    # One periodic pass per ModelDeployment does both the drift check and the autoscaler's
    # evaluation, so the two never race on the same Deployment.
    autoscale_interval: float = 15.0
    api_url: str | None = None  # log in to this URL without credentials (tests, kubectl proxy)
    # NetworkPolicies per ModelDeployment with these outside peers; None: none emitted.
    network_policy: PolicyPeers | None = field(default_factory=PolicyPeers)
    # Folders hostPath model sources may be under (none by default: hostPath is refused).
    allowed_host_paths: tuple[str, ...] = ()


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
        path = f"{base}/namespaces/{namespace}/{plural(kind)}"
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


def plural(kind: str) -> str:
    """The resource name of a kind the operator touches (deployments, networkpolicies...)."""
    lower = kind.lower()
    return lower[:-1] + "ies" if lower.endswith("y") else lower + "s"


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


def controlled_by(obj: dict, owner_uid: str) -> bool:
    """Whether this ModelDeployment (by uid) is the object's controller."""
    owners = obj.get("metadata", {}).get("ownerReferences") or []
    return any(o.get("uid") == owner_uid and o.get("controller") for o in owners)


def retire(client: KubeClient, patch: dict, owner_uid: str) -> bool:
    """Apply a retirement patch to an existing object this ModelDeployment controls."""
    meta = patch["metadata"]
    current = client.get(patch["apiVersion"], patch["kind"], meta["namespace"], meta["name"])
    if current is None or contains(current, patch):
        return False
    if not controlled_by(current, owner_uid):
        return False  # not ours: never touch someone else's object of the same name
    client.merge_patch(current, patch)
    return True


def apply(client: KubeClient, obj: dict, owner_uid: str) -> tuple[str, int | None]:
    """Create the object, or merge-patch it when it drifted; returns what was done, and the
    live spec.replicas that the patch replaced (None when it left replicas alone). An object
    of the same name that this ModelDeployment does not control is left as it is ("foreign"):
    patching it would also hand it to the garbage collector with our owner reference. What
    the operator set last time (its annotation) and sets no more is removed by the patch."""
    desired = with_last_applied(obj)
    meta = obj["metadata"]
    current = client.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
    if current is None:
        client.create(desired)
        return "created", None
    if not controlled_by(current, owner_uid):
        return "foreign", None
    if contains(current, desired):
        return "unchanged", None
    client.merge_patch(current, merged(desired, removals(last_applied(current), desired)))
    wanted = (desired.get("spec") or {}).get("replicas")
    live = (current.get("spec") or {}).get("replicas")
    return "patched", live if wanted is not None and live != wanted else None


def applied_record(obj: dict) -> dict:
    """What the operator sets on an object, as its annotation records it: spec.replicas aside
    (the operator sets it, or leaves it to an HPA, KEDA or kubectl scale, never removes it)."""
    record = json.loads(json.dumps(obj))
    annotations = record["metadata"].get("annotations") or {}
    annotations.pop(LAST_APPLIED, None)
    if not annotations:
        record["metadata"].pop("annotations", None)
    if isinstance(record.get("spec"), dict):
        record["spec"].pop("replicas", None)
    return record


def with_last_applied(obj: dict) -> dict:
    text = json.dumps(applied_record(obj), sort_keys=True, separators=(",", ":"))
    meta = obj["metadata"]
    annotations = {**(meta.get("annotations") or {}), LAST_APPLIED: text}
    return {**obj, "metadata": {**meta, "annotations": annotations}}


def last_applied(current: dict) -> dict:
    text = ((current.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        record = json.loads(text) if text else {}
    except ValueError:
        return {}  # someone edited it: nothing is known to prune
    return record if isinstance(record, dict) else {}


def removals(last: dict, desired: dict) -> dict:
    """Merge-patch nulls for the keys `last` set and `desired` sets no more (objects compared
    key by key; a list is replaced whole by a merge patch, so it needs none)."""
    patch: dict[str, Any] = {}
    for key, before in last.items():
        if key not in desired:
            patch[key] = None
        elif isinstance(before, dict) and isinstance(desired[key], dict):
            sub = removals(before, desired[key])
            if sub:
                patch[key] = sub
    return patch


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra`'s keys laid over it, objects merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def new_fleet_keys() -> dict[str, str]:
    """The fleet Secret's `data`: 256 random bits per key, as URL-safe text (headers and files
    take it as it is), base64-encoded as the API stores Secret data."""
    return {
        key: base64.b64encode(generate_fleet_secret().encode()).decode()
        for key in (FLEET_SECRET_KEY, ENGINE_API_KEY)
    }


def secret_keys(secret: dict) -> set[str]:
    return {*(secret.get("data") or {}), *(secret.get("stringData") or {})}


def apply_fleet_secret(client: KubeClient, obj: dict, owner_uid: str) -> str:
    """Create the fleet Secret with fresh keys when it does not exist; otherwise leave it as
    it is (never a new secret: running pods hold the old one; the operator has no patch right
    on Secrets). "incomplete" when one of ours lacks a key, "foreign" when not ours."""
    meta = obj["metadata"]
    current = client.get("v1", "Secret", meta["namespace"], meta["name"])
    if current is None:
        client.create({**obj, "data": new_fleet_keys()})
        return "created"
    if not controlled_by(current, owner_uid):
        return "foreign"
    return (
        "unchanged" if {FLEET_SECRET_KEY, ENGINE_API_KEY} <= secret_keys(current) else "incomplete"
    )


def missing_secret_key(client: KubeClient, namespace: str, ref: SecretKeyRef) -> str | None:
    """Why pods cannot read this Secret key yet (they wait for it), or None."""
    found = client.get("v1", "Secret", namespace, ref.name)
    if found is None:
        return f"Secret {ref.name} not found"
    if ref.key not in secret_keys(found):
        return f"Secret {ref.name} has no key {ref.key}"
    return None


def foreign_message(objects: list[str]) -> str:
    return (
        f"not controlled by this ModelDeployment, left unchanged: {', '.join(objects)} "
        "(delete or rename them, or rename the ModelDeployment)"
    )


def warning_event(md: dict, reason: str, message: str, now: datetime.datetime) -> dict:
    """A core/v1 Warning Event about the ModelDeployment (named as client-go names them)."""
    meta = md["metadata"]
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    nanos = int(now.timestamp() * 1e9)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{nanos:x}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "type": "Warning",
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "pagefleet-operator"},
        "reportingComponent": "pagefleet-operator",
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


@dataclass
class PoolMemory:
    window: tuple[Recommendation, ...] = ()
    replicas: int | None = None
    reason: str = ""
    cause: ScaleReason = ScaleReason.PENDING  # the reason in a word (the metrics' label)
    # Start of the pool's unbroken idle stretch (in memory: a restarted operator starts the
    # idle window over, which only ever delays a scale to zero).
    idle_since: float | None = None


@dataclass
class OperatorState:
    """Per-operator (not per-module) memory: a lock and the autoscaler's window per object,
    and how many periodic passes each completed (what tests wait on to know one happened)."""

    config: OperatorConfig
    client: KubeClient
    locks: dict[str, threading.Lock] = field(default_factory=dict)
    pools: dict[tuple[str, str], PoolMemory] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)
    guard: threading.Lock = field(default_factory=threading.Lock)
    loop: asyncio.Task | None = None
    model_configs: ModelConfigs = field(default_factory=ModelConfigs)  # capacity admission
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)  # its /metrics

    def lock(self, uid: str) -> threading.Lock:
        with self.guard:
            return self.locks.setdefault(uid, threading.Lock())

    def memory(self, uid: str, pool: str) -> PoolMemory:
        with self.guard:
            return self.pools.setdefault((uid, pool), PoolMemory())

    def passed(self, uid: str) -> None:
        with self.guard:
            self.passes[uid] = self.passes.get(uid, 0) + 1

    def keep_only(self, uids: set[str], keys: set[tuple[str, str]]) -> None:
        """Drop the memory (by uid) and the series (by namespace and name) of ModelDeployments
        that are gone."""
        self.metrics.keep_only(keys)
        with self.guard:
            for uid in [u for u in self.locks if u not in uids]:
                del self.locks[uid]
            for key in [k for k in self.pools if k[0] not in uids]:
                del self.pools[key]
            for uid in [u for u in self.passes if u not in uids]:
                del self.passes[uid]


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _deployment(
    client: KubeClient,
    namespace: str,
    name: str,
    owner_uid: str,
    kind: tuple[str, str] = ("apps/v1", "Deployment"),
) -> tuple[int, int]:
    """(spec.replicas, readyReplicas) of a Deployment (or another kind with both, such as a
    LeaderWorkerSet, whose readyReplicas counts ready groups) this ModelDeployment controls,
    else 0s."""
    found = client.get(*kind, namespace, name) or {}
    if not controlled_by(found, owner_uid):
        return 0, 0
    replicas = (found.get("spec") or {}).get("replicas")
    ready = (found.get("status") or {}).get("readyReplicas") or 0
    return (replicas if replicas is not None else 0), ready


def _pool_workload(client: KubeClient, md: dict, pool: Pool) -> tuple[int, int]:
    """(replicas, ready) of the object that runs the pool: its Deployment or LeaderWorkerSet."""
    meta = md["metadata"]
    api_version, kind, name = workload_ref(meta["name"], pool)
    return _deployment(client, meta["namespace"], name, meta["uid"], (api_version, kind))


def _found_workload(client: KubeClient, md: dict, pool: Pool) -> dict | None:
    """The pool's Deployment or LeaderWorkerSet when this ModelDeployment controls it."""
    meta = md["metadata"]
    api_version, kind, name = workload_ref(meta["name"], pool)
    found = client.get(api_version, kind, meta["namespace"], name)
    return found if found and controlled_by(found, meta["uid"]) else None


def remembered(state: OperatorState, md: dict, pool: Pool, now: float) -> PoolMemory:
    """The pool's autoscaler memory. After an operator restart its replicas continue from the
    status' last decision (else the Deployment's) and its window from the status' record, so
    a restart neither resets a scaled pool nor cuts its scale-down window short."""
    meta = md["metadata"]
    memory = state.memory(meta["uid"], pool.name)
    if memory.replicas is None:
        recorded = ((md.get("status") or {}).get("pools") or {}).get(pool.name) or {}
        if "desiredReplicas" in recorded:
            memory.replicas = recorded["desiredReplicas"]
        else:
            current, _ = _pool_workload(state.client, md, pool)
            memory.replicas = current or pool.replicas
        restored = window_from_status(recorded.get("recommendations"), now, memory.replicas)
        memory.window = needed(restored, pool.autoscaling, now)
    return memory


def router_queue(state: OperatorState, md: dict, spec: Spec) -> RouterQueue:
    """What the ModelDeployment's router (and Endpoint Picker) holds for its model: from
    Prometheus when the operator has one, else from the router and picker pods' /metrics."""
    meta = md["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if state.config.prometheus_url:
        source = PrometheusSource(state.config.prometheus_url)
        queue = source.read_queue(RouterPods(namespace, name, spec.model.name, ()))
        state.metrics.read_failed(namespace, name, ReadSource.PROMETHEUS, queue.errors)
        return queue
    pods = state.client.list("v1", "Pod", namespace, router_selector(name))
    ips = running_pod_ips(pods)
    queue = RouterScraper(state.config.router_metrics_port).read_queue(
        RouterPods(namespace, name, spec.model.name, ips)
    )
    if spec.inference_pool is not None:
        # The Endpoint Picker holds requests as the router does (one core, the same gauge).
        pods = state.client.list("v1", "Pod", namespace, epp_selector(name))
        held = RouterScraper(EPP_METRICS_PORT).read_queue(
            RouterPods(namespace, name, spec.model.name, running_pod_ips(pods))
        )
        queue = RouterQueue(
            queue.queued + held.queued, queue.read and held.read, queue.errors + held.errors
        )
    state.metrics.read_failed(namespace, name, ReadSource.ROUTER_PODS, queue.errors)
    return queue


def autoscale_pool(
    state: OperatorState, md: dict, spec: Spec, pool: Pool, now: float, queue: RouterQueue
) -> PoolMemory:
    """One builtin evaluation: read the pool's queue, decide with the router's, remember
    the decision."""
    meta = md["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    memory = remembered(state, md, pool, now)
    found, ready = _pool_workload(state.client, md, pool)
    # Decide from the operator's own last decision, not the Deployment's replicas: a manual
    # scale is reverted (and announced), never adopted as the autoscaler's starting point.
    current = memory.replicas if memory.replicas is not None else found
    # The pods that serve: a multi-node pool's leaders (its workers run no server).
    pods = state.client.list("v1", "Pod", namespace, serving_selector(name, pool))
    pool_pods = PoolPods(namespace, name, pool.name, spec.model.name, ready_pod_ips(pods))
    source = (
        PrometheusSource(state.config.prometheus_url)
        if state.config.prometheus_url
        else PodScraper(state.config.metrics_port)
    )
    reading = source.read(pool_pods)
    where = ReadSource.PROMETHEUS if state.config.prometheus_url else ReadSource.ENGINE_PODS
    state.metrics.read_failed(namespace, name, where, reading.errors)
    observation = Observation(
        reading.waiting, reading.running, reading.pods, current, queue.queued, queue.read
    )
    decision = decide(
        observation,
        memory.window,
        PoolReplicas(current, ready),
        pool.autoscaling,
        now,
        memory.idle_since,
    )
    if decision.replicas != memory.replicas:
        log.info("%s/%s pool %s: %s", namespace, name, pool.name, decision.reason)
    state.metrics.decided(namespace, name, pool.name, current, decision.replicas, decision.cause)
    memory.replicas, memory.reason = decision.replicas, decision.reason
    memory.window, memory.idle_since = decision.window, decision.idle_since
    memory.cause = decision.cause
    return memory


def _pool_reason(pool: Pool, memory: PoolMemory | None) -> tuple[str, ScaleReason]:
    """Why the pool has its desired replicas: in words (status) and in a word (metrics)."""
    if pool.autoscaling.mode == "builtin" and memory is not None and memory.reason:
        return memory.reason, memory.cause
    if pool.autoscaling.mode == "keda":
        return "scaled by KEDA ScaledObject on vllm:num_requests_waiting", ScaleReason.KEDA
    why = f"spec.pools.{pool.name}.replicas when it changes, else the Deployment's own"
    return why, ScaleReason.PENDING if pool.autoscaling.mode == "builtin" else ScaleReason.SPEC


def reconcile(state: OperatorState, namespace: str, name: str, autoscale: bool) -> None:
    """Read the ModelDeployment afresh, (optionally) autoscale, apply, write status; count it
    in the operator's metrics (a ModelDeployment that is gone leaves them)."""
    started = time.monotonic()
    try:
        found, error = _reconcile(state, namespace, name, autoscale)
    except Exception as e:
        failure = API_ERROR if isinstance(e, ApiError) else UNEXPECTED
        state.metrics.reconciled(namespace, name, failure, time.monotonic() - started)
        raise
    if found:
        state.metrics.reconciled(namespace, name, error, time.monotonic() - started)
    else:
        state.metrics.forget(namespace, name)


def _reconcile(
    state: OperatorState, namespace: str, name: str, autoscale: bool
) -> tuple[bool, str | None]:
    """Whether the ModelDeployment was there to reconcile, and its Degraded reason if any."""
    md = _live_model_deployment(state.client, namespace, name)
    if md is None:
        return False, None
    uid = md["metadata"]["uid"]
    with state.lock(uid):
        # Read again under the lock: a reconcile that held it may have just written the status
        # this one judges news by (and announces problems from).
        md = _live_model_deployment(state.client, namespace, name)
        found = md is not None and md["metadata"]["uid"] == uid
        error = _reconcile_locked(state, md, autoscale) if found else None
        if autoscale:
            state.passed(uid)
    return found, error


def _live_model_deployment(client: KubeClient, namespace: str, name: str) -> dict | None:
    """The ModelDeployment, or None when it is gone or going (what it owns is then the
    garbage collector's)."""
    md = client.get(f"{GROUP}/{VERSION}", "ModelDeployment", namespace, name)
    if md is None or md["metadata"].get("deletionTimestamp"):
        return None
    return md


def _reconcile_locked(state: OperatorState, md: dict, autoscale: bool) -> str | None:
    """One reconcile under the ModelDeployment's lock; its Degraded reason, if any."""
    client, config = state.client, state.config
    meta = md["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    previous = md.get("status") or {}
    images = pinned_images(previous, config.images)
    error: tuple[str, str] | None = None
    pools: list[PoolObserved] = []
    router = picker = (0, 0)
    capacity: CapacityVerdict | None = None
    try:
        spec = parse_spec(md.get("spec"))
        capacity = admit_capacity(state, namespace, spec)
        admit_adapters(state, namespace, spec)
        decision = _decide_replicas(state, md, spec, autoscale)
        options = RenderOptions(
            images,
            config.prometheus_url,
            decision.replicas,
            config.network_policy,
            config.allowed_host_paths,
            config.router_image,
            own_replicas=decision.own,
        )
        applied = apply_all(client, md, options)
        _announce_manual_scales(client, md, spec, decision, applied.replaced)
        for pool in spec.pools:
            current, ready = _pool_workload(client, md, pool)
            desired = decision.replicas.get(pool.name, current)
            memory = decision.memories.get(pool.name)
            reason, cause = _pool_reason(pool, memory)
            window = memory.window if memory is not None else None
            pools.append(
                PoolObserved(
                    pool.name,
                    current,
                    ready,
                    desired,
                    reason,
                    window,
                    pool.replicas,
                    workload_kind(pool),
                    pool.multi_node,
                    cause,
                )
            )
        # Before status: once the status shows a number, the metrics show it too.
        state.metrics.observed(namespace, name, spec.model.name, tuple(pools))
        router = _deployment(client, namespace, f"{name}-router", uid)
        if spec.inference_pool is not None:
            picker = _deployment(client, namespace, f"{name}-epp", uid)
        missing = None
        if spec.api_key_secret is not None:
            missing = missing_secret_key(client, namespace, spec.api_key_secret)
        hf_tokens = (spec.model.token_secret, *(a.source.token_secret for a in spec.adapters))
        for ref in hf_tokens:
            if ref is not None:
                missing = missing or missing_secret_key(client, namespace, ref)
        if applied.foreign:
            error = ("ForeignObject", foreign_message(applied.foreign))
        elif applied.incomplete:
            error = ("FleetSecretIncomplete", incomplete_message(applied.incomplete))
        elif missing:
            error = ("SecretMissing", f"{missing}: the pods that read it wait for it")
    except CapacityRefused as e:
        error, capacity = (e.reason, str(e)), e.verdict
    except SpecError as e:
        error = (e.reason, str(e))
    except ApiError as e:
        error = ("ApplyFailed", str(e))
    if error and _degraded_message(previous) != error[1]:
        announce(client, md, *error)  # one event per new problem, not one per pass
    if (
        capacity is not None
        and capacity.status == "False"
        and not capacity.refused  # a refusal is Degraded's event
        and _capacity_message(previous) != capacity.message
    ):
        # Deployed anyway (admitAnyway): say so once. A check that could not run is only a
        # condition (every pool on an unlabelled GPU node would warn otherwise).
        announce(client, md, capacity.reason, capacity.message)
    verdict = (capacity.status, capacity.reason, capacity.message) if capacity else None
    observed = Observed(
        tuple(pools),
        router[0],
        router[1],
        error,
        images_status(images),
        verdict,
        *picker,
    )
    status = build_status(name, meta.get("generation"), observed, previous, _now_iso())
    patch = merge_diff(previous, status)
    if patch:
        client.merge_patch(md, {"status": patch}, "/status")
    return error[0] if error else None


def admit_capacity(state: OperatorState, namespace: str, spec: Spec) -> CapacityVerdict | None:
    """The capacity admission's verdict; raises CapacityRefused (nothing gets applied) for a
    GPU pool that cannot hold one request of its max-model-len, unless admitAnyway."""
    ref = spec.model.token_secret
    # Read only when a fetch needs it (the Secret is not touched for a cached config).
    token = functools.partial(secret_value, state.client, namespace, ref) if ref else _no_token
    verdict = check_capacity(spec, state.model_configs, token)
    if verdict is not None and verdict.refused:
        raise CapacityRefused(verdict)
    return verdict


def admit_adapters(state: OperatorState, namespace: str, spec: Spec) -> None:
    """Raises AdapterRefused (nothing gets applied) for an adapter whose rank is above a
    pool's max-lora-rank."""

    def token_of(adapter: Adapter) -> Callable[[], str | None]:
        ref = adapter.source.token_secret
        return functools.partial(secret_value, state.client, namespace, ref) if ref else _no_token

    check_adapters(spec, state.model_configs, token_of)


def _no_token() -> None:
    return None


def secret_value(client: KubeClient, namespace: str, ref: SecretKeyRef) -> str | None:
    """One key of a Secret, decoded (None when the Secret or the key is missing)."""
    found = client.get("v1", "Secret", namespace, ref.name) or {}
    value = (found.get("data") or {}).get(ref.key)
    if value is None:
        return (found.get("stringData") or {}).get(ref.key)
    return base64.b64decode(value).decode(errors="replace").strip()


def _capacity_message(status: dict) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "CapacityAdmitted":
            return c.get("message")
    return None


def pinned_images(status: dict, current: EngineImages) -> EngineImages:
    """The engine images recorded when the ModelDeployment was first reconciled, so that an
    operator upgrade re-images no engine; a status without them takes the current ones."""
    recorded = status.get("images") or {}
    return EngineImages(recorded.get("cpu") or current.cpu, recorded.get("cuda") or current.cuda)


def images_status(images: EngineImages) -> dict[str, str]:
    return {"cpu": images.cpu, "cuda": images.cuda}


@dataclass(frozen=True)
class ReplicaDecision:
    replicas: dict[str, int]  # per pool (KEDA pools: none, their HPA decides)
    memories: dict[str, PoolMemory]  # the builtin autoscaler's, per builtin pool
    own: frozenset[str]  # pools whose Deployment keeps its own replicas
    # What the operator had set on each builtin pool before this pass: a live value other
    # than it, replaced by this pass's write, was set by hand.
    set_before: dict[str, int]


def _decide_replicas(
    state: OperatorState, md: dict, spec: Spec, autoscale: bool
) -> ReplicaDecision:
    """Replicas per pool and the builtin autoscaler's memory. A pool without autoscaling
    takes spec.replicas when that changed since it was last applied, and otherwise is applied
    without replicas (so a `kubectl scale` or an HPA landing mid-pass is never undone)."""
    now = time.time()  # wall clock: the autoscaler's window is kept in status
    recorded = (md.get("status") or {}).get("pools") or {}
    replicas: dict[str, int] = {}
    memories: dict[str, PoolMemory] = {}
    set_before: dict[str, int] = {}
    keep: set[str] = set()
    queue: RouterQueue | None = None  # read once per pass, for every builtin pool
    for pool in spec.pools:
        mode = pool.autoscaling.mode
        if mode == "builtin":
            memory = remembered(state, md, pool, now)
            if memory.replicas is not None:
                set_before[pool.name] = memory.replicas
            if autoscale:
                queue = queue or router_queue(state, md, spec)
                memory = autoscale_pool(state, md, spec, pool, now, queue)
            memories[pool.name] = memory
            if memories[pool.name].replicas is not None:
                replicas[pool.name] = memories[pool.name].replicas
        elif mode == "none":
            before = recorded.get(pool.name) or {}
            # A pool that switched between a Deployment and a LeaderWorkerSet takes
            # spec.replicas: the other kind's replicas (the retired one's 0) are not its own.
            same_kind = before.get("workload", "Deployment") == workload_kind(pool)
            found = _found_workload(state.client, md, pool)
            if before.get("specReplicas") == pool.replicas and same_kind and found:
                keep.add(pool.name)
            else:
                replicas[pool.name] = pool.replicas
    return ReplicaDecision(replicas, memories, frozenset(keep), set_before)


def _announce_manual_scales(
    client: KubeClient, md: dict, spec: Spec, decision: ReplicaDecision, replaced: dict[str, int]
) -> None:
    """A builtin-autoscaled pool scaled by hand is scaled back: say so, once per change. Told
    by the value this pass's own write replaced (read just before it), so a `kubectl scale`
    landing mid-pass is announced too, and a value the autoscaler then keeps is not."""
    for pool in spec.pools:
        name = workload_ref(md["metadata"]["name"], pool)[2]
        last, live = decision.set_before.get(pool.name), replaced.get(name)
        if pool.autoscaling.mode != "builtin" or last is None or live in (None, last):
            continue
        announce(
            client,
            md,
            "ManualScaleReverted",
            f"{name} was scaled to {live} by hand; pool {pool.name} is scaled by the "
            f"builtin autoscaler, back to {decision.replicas.get(pool.name, last)}: change "
            f"spec.pools.{pool.name}.autoscaling minReplicas/maxReplicas, or set its mode to "
            "none to scale it yourself",
        )


def incomplete_message(secret: str) -> str:
    return (
        f"Secret {secret} lacks the key {FLEET_SECRET_KEY} or {ENGINE_API_KEY}: the operator "
        "never rewrites it; delete it and the operator makes a new one (then restart the pods)"
    )


@dataclass
class Applied:
    foreign: list[str]  # objects of its names that it does not control (left alone)
    incomplete: str  # the name of its fleet Secret if that lacks a key (else "")
    replaced: dict[str, int]  # workload name -> the live replicas its patch replaced


def apply_all(client: KubeClient, md: dict, options: RenderOptions) -> Applied:
    """Apply what the ModelDeployment owns and retire what it no longer wants."""
    meta = md["metadata"]
    namespace, uid = meta["namespace"], meta["uid"]
    applied = Applied([], "", {})
    for obj in desired_objects(md, options):
        name = obj["metadata"]["name"]
        if obj["kind"] == "Secret":
            done = apply_fleet_secret(client, obj, uid)
        else:
            done, replaced = apply(client, obj, uid)
            if replaced is not None:
                applied.replaced[name] = replaced
        if done == "foreign":
            applied.foreign.append(f"{obj['kind']} {name}")
        elif done == "incomplete":
            applied.incomplete = name
        elif done != "unchanged":
            log.info("%s %s/%s %s", done, obj["kind"], namespace, name)
    for patch in retired_objects(md):
        if retire(client, patch, uid):
            log.info("retired %s/%s %s", patch["kind"], namespace, patch["metadata"]["name"])
    return applied


def announce(client: KubeClient, md: dict, reason: str, message: str) -> None:
    event = warning_event(md, reason, message, datetime.datetime.now(datetime.UTC))
    try:
        client.create(event)
    except ApiError as e:  # the condition still says it; an event is a courtesy
        log.warning("could not post event %s: %s", reason, e)


def _degraded_message(status: dict) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "Degraded" and c.get("status") == "True":
            return c.get("message")
    return None


async def reconcile_forever(state: OperatorState, model_deployments: kopf.Index) -> None:
    """Every interval, one pass over each ModelDeployment kopf has indexed (autoscale and
    correct drift), all of a round together, one round at a time. Unlike a kopf timer this
    needs no finalizer, so deleting a ModelDeployment never waits for the operator."""
    while True:
        targets = sorted(model_deployments)  # (namespace, name) keys
        results = await asyncio.gather(
            *(asyncio.to_thread(reconcile, state, ns, name, True) for ns, name in targets),
            return_exceptions=True,
        )
        for (namespace, name), result in zip(targets, results, strict=True):
            if isinstance(result, Exception):
                log.warning("%s/%s: reconcile failed: %r", namespace, name, result)
        state.keep_only(
            {uid for uids in model_deployments.values() for uid in uids}, set(model_deployments)
        )
        await asyncio.sleep(state.config.autoscale_interval)


def configure(settings: kopf.OperatorSettings, post_events: bool = True) -> kopf.OperatorSettings:
    settings.posting.enabled = post_events
    # Only a finalizer an older operator added is ever seen here: kopf removes it, since no
    # handler needs one (no timers, daemons or mandatory deletion handlers).
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-applied-spec"
    )
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    return settings


def build_registry(state: OperatorState) -> kopf.OperatorRegistry:
    """Handlers bound to one operator's state (no module-level registry or memory)."""
    config = state.config
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)

    if config.api_url:

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=config.api_url, insecure=True)

    else:
        # The official client's lookup: in-cluster service account, else ~/.kube/config.
        kopf.on.login(registry=registry)(kopf.login_via_client)

    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, registry=registry)
    def on_change(name: str, namespace: str, **_: Any) -> None:
        reconcile(state, namespace, name, autoscale=False)

    # What the periodic pass iterates over, kept current by kopf's watch (an index, unlike a
    # timer, makes kopf add no finalizer). Owned objects go with the garbage collector.
    @kopf.index(*resource, id="model_deployments", registry=registry)
    def model_deployments(namespace: str, name: str, uid: str, **_: Any) -> dict:
        return {(namespace, name): uid}

    @kopf.on.startup(registry=registry)
    async def start_passes(model_deployments: kopf.Index, **_: Any) -> None:
        state.loop = asyncio.create_task(reconcile_forever(state, model_deployments))

    @kopf.on.cleanup(registry=registry)
    async def stop_passes(**_: Any) -> None:
        if state.loop is not None:
            state.loop.cancel()

    return registry
