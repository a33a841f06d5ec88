"""Pure reconcile: a ModelDeployment (as stored) -> the Kubernetes objects it should own.
No I/O; the kopf handlers apply the result and golden tests pin it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import yaml

from pagefleet.common.names import (
    GROUP,
    KIND,
    LABEL_INSTANCE,
    LABEL_MODEL,
    LABEL_POOL,
    LABEL_ROLE,
    LABEL_WORKER_INDEX,
    VERSION,
)
from pagefleet.common.serve_command import (
    JSON_ENGINE_ARGS,
    KV_ROLES,
    ServeCommand,
    engine_flags,
    kv_events_config,
    kv_transfer_config,
    merge_json_configs,
    serve_argv,
)
from pagefleet.operator.crd import POOL_NAMES
from pagefleet.operator.model_source import (
    MODEL_MOUNT,
    adapter_path,
    adapter_volumes,
    engine_model_volume,
    model_path,
    router_model_volume,
)
from pagefleet.operator.network_policy import (
    PolicyInputs,
    PolicyPeers,
    epp_policy,
    pool_policy,
    router_policy,
    tcp,
    tcp_range,
)
from pagefleet.operator.pod_overrides import PodOverrides, overlay
from pagefleet.operator.spec import (
    DEFAULT_GPU_IMAGE,
    DEFAULT_IMAGE,
    DEFAULT_ROUTER_IMAGE,
    RAY_OBJECT_STORE_GI,
    Autoscaling,
    Pool,
    QueueBounds,
    SecretKeyRef,
    Spec,
    SpecError,
    check_group_name,
    check_host_path,
    check_name,
    json_object,
    parse_spec,
)

HTTP_PORT = 8000
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = KV_EVENTS_PORT + 1  # the engine replays missed events here
KV_TRANSFER_PORT = 14579
ROUTER_PORT = 8080
EPP_GRPC_PORT = 9002  # the Inference Extension's Endpoint Picker port (its charts use it)
EPP_METRICS_PORT = 9090
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
ROUTER_CONFIG_FILE = "/etc/pagefleet/router.yaml"
# The engine container's own pod IP (downward API); the kubelet expands $(POD_IP) in commands.
POD_IP_ENV = "POD_IP"
# The group leader's address, which the LeaderWorkerSet controller gives every pod of a group.
LWS_LEADER_ENV = "LWS_LEADER_ADDRESS"
# The fleet secret (pagefleet/fleet_auth.py): one Secret per ModelDeployment, made once by the
# operator, mounted into the router and every engine. Its second key is the API key engines
# require and the router sends them (so a client's key never opens an engine).
FLEET_SECRET_KEY = "secret"
ENGINE_API_KEY = "engine-api-key"
FLEET_SECRET_DIR = "/var/run/secrets/pagefleet.io/fleet"
FLEET_SECRET_FILE = f"{FLEET_SECRET_DIR}/{FLEET_SECRET_KEY}"
API_KEY_ENV = "PAGEFLEET_API_KEY"
UPSTREAM_API_KEY_ENV = "PAGEFLEET_UPSTREAM_API_KEY"
# NIXL's UCX TCP transport listens on a random port; pinned to this range on prefill and decode
# pods (UCX_TCP_PORT_RANGE) so that NetworkPolicies can open exactly it between them.
UCX_PORTS = (14580, 14609)
# Multi-node pools: one LeaderWorkerSet (sigs.k8s.io/lws) per pool, a group of `nodes` pods per
# engine. Ray's ports in those pods are pinned (ray start flags) so NetworkPolicies open exactly
# them between the pods of the pool: the head's GCS, each node's raylet and object manager, and
# the range Ray's worker processes (the engine's rank actors) listen on. The agents Ray starts
# beside them (runtime env, dashboard agent, metrics) are pinned too but only used in the pod.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
RAY_GCS_PORT = 6379
RAY_NODE_MANAGER_PORT = 6380
RAY_OBJECT_MANAGER_PORT = 6381
RAY_LOCAL_PORTS = {
    "runtime-env-agent-port": 6382,
    "dashboard-agent-grpc-port": 6383,
    "dashboard-agent-listen-port": 6384,
    "metrics-export-port": 6385,
}
RAY_WORKER_PORTS = (10002, 19999)  # Ray's own default range, made explicit
# torch.distributed's TCP store (rank 0 binds port 0), gloo's pairs and NCCL's sockets listen on
# ephemeral ports: the kernel's local port range, set on these pods (a safe sysctl) so that the
# range the NetworkPolicies open is the range the kernel uses.
EPHEMERAL_PORTS = (32768, 60999)
LOCAL_PORT_RANGE_SYSCTL = "net.ipv4.ip_local_port_range"
RAY_OBJECT_STORE_BYTES = RAY_OBJECT_STORE_GI * 2**30  # in /dev/shm (spec.default_shm_size)
# KEDA (2.13+) stops scaling a ScaledObject with this annotation set to "true".
KEDA_PAUSED = "autoscaling.keda.sh/paused"
# The engines-running trigger's target per replica: beyond any pool's running requests, so
# that trigger keeps a pool from 0 but never sizes it (ceil(running / this) <= 1).
IN_FLIGHT_THRESHOLD = 1_000_000
MULTUS_NETWORKS = "k8s.v1.cni.cncf.io/networks"


@dataclass(frozen=True)
class EngineImages:
    """The operator's engine images by device (Dockerfile.cpu, Dockerfile.cuda)."""

    cpu: str = DEFAULT_IMAGE
    cuda: str = DEFAULT_GPU_IMAGE


@dataclass(frozen=True)
class RenderOptions:
    # For pools whose spec names no image: the operator's (or those pinned in status).
    images: EngineImages = field(default_factory=EngineImages)
    prometheus_url: str | None = None  # needed by KEDA triggers
    # Replicas the builtin autoscaler chose, per pool name; absent pools start at spec.replicas.
    replicas: dict[str, int] = field(default_factory=dict)
    # NetworkPolicies for each ModelDeployment with these outside peers; None: none emitted.
    network_policy: PolicyPeers | None = field(default_factory=PolicyPeers)
    # Folders hostPath model sources may be under; None: not checked (rendering only).
    allowed_host_paths: tuple[str, ...] | None = None
    router_image: str = DEFAULT_ROUTER_IMAGE
    # Pools without autoscaling whose Deployment keeps its own replicas (rendered without).
    own_replicas: frozenset[str] = frozenset()


def desired_objects(md: dict[str, Any], options: RenderOptions | None = None) -> list[dict]:
    """Every object the ModelDeployment owns, in apply order. Raises SpecError on a bad spec.
    The fleet Secret comes without data: the operator fills it once, when it creates it."""
    options = options or RenderOptions()
    meta = md["metadata"]
    check_name(meta["name"])
    spec = parse_spec(md.get("spec"))
    for pool in spec.pools:
        check_group_name(meta["name"], pool)
    if options.allowed_host_paths is not None:
        check_host_path(spec.model, options.allowed_host_paths)
    ctx = _Context(
        meta["name"], meta["namespace"], _owner(md), spec, options.router_image, options.images
    )
    objects: list[dict] = [fleet_secret(ctx)]
    for pool in spec.pools:
        objects.append(engine_workload(ctx, pool, _pool_replicas(pool, options)))
        objects.append(engine_service(ctx, pool))
        objects.append(disruption_budget(ctx, pool))
        if pool.autoscaling.mode == "keda":
            objects.append(scaled_object(ctx, pool, options.prometheus_url))
    objects.extend(router_objects(ctx))
    if spec.inference_pool is not None:
        objects.extend(epp_objects(ctx))
    if options.network_policy is not None:
        objects.extend(network_policies(ctx, options.network_policy))
    # A JSON round trip: no object shares a dict with another (callers may mutate them).
    return json.loads(json.dumps(objects))


def retired_objects(md: dict[str, Any]) -> list[dict]:
    """Patches that retire what an earlier spec made and this one no longer wants, with no
    delete rights needed: the engine workloads of removed pools go to 0 replicas, and so does a
    pool's Deployment when it became multi-node (a LeaderWorkerSet) and its LeaderWorkerSet when
    it went back to one node; ScaledObjects of pools no longer on KEDA are paused (so KEDA stops
    fighting the operator's replicas); an Endpoint Picker no longer wanted goes to 0 replicas.
    Callers apply each only to an existing object this ModelDeployment controls."""
    spec = parse_spec(md.get("spec"))
    meta = md["metadata"]
    current = {p.name: p for p in spec.pools}
    patches = []
    for pool in POOL_NAMES:
        name = pool_object_name(meta["name"], pool)
        where = {"name": name, "namespace": meta["namespace"]}
        kept = workload_kind(current[pool]) if pool in current else None
        for api_version, kind in (("apps/v1", "Deployment"), (LWS_API_VERSION, LWS_KIND)):
            if kind != kept:
                patches.append(
                    {
                        "apiVersion": api_version,
                        "kind": kind,
                        "metadata": where,
                        "spec": {"replicas": 0},
                    }
                )
        if pool not in current or current[pool].autoscaling.mode != "keda":
            patches.append(
                {
                    "apiVersion": "keda.sh/v1alpha1",
                    "kind": "ScaledObject",
                    "metadata": {**where, "annotations": {KEDA_PAUSED: "true"}},
                }
            )
    if spec.inference_pool is None:
        # The Endpoint Picker of an InferencePool since dropped: no pods (the InferencePool
        # itself stays, as everything the operator made: it deletes nothing).
        patches.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": f"{meta['name']}-epp", "namespace": meta["namespace"]},
                "spec": {"replicas": 0},
            }
        )
    return patches


@dataclass(frozen=True)
class _Context:
    name: str
    namespace: str
    owner: dict[str, Any]
    spec: Spec
    router_image: str = DEFAULT_ROUTER_IMAGE
    images: EngineImages = field(default_factory=EngineImages)

    def engine_image(self, pool: Pool) -> str:
        """The pool's image, else the spec's, else the operator's for the pool's device."""
        default = self.images.cuda if pool.gpus else self.images.cpu
        return pool.image or self.spec.image or default


def _owner(md: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": md["metadata"]["name"],
        "uid": md["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _pool_replicas(pool: Pool, options: RenderOptions) -> int | None:
    """None for KEDA pools (their HPA owns spec.replicas and the operator must not fight it)
    and for pools that keep their Deployment's own."""
    mode = pool.autoscaling.mode
    if mode == "keda" or (mode == "none" and pool.name in options.own_replicas):
        return None
    chosen = options.replicas.get(pool.name, pool.replicas)
    if mode == "builtin":
        return max(pool.autoscaling.min_replicas, min(pool.autoscaling.max_replicas, chosen))
    return chosen  # mode none: spec.replicas (the handler's choice)


def pool_object_name(md_name: str, pool: str) -> str:
    return f"{md_name}-{pool}"


def pool_selector(md_name: str, pool: str) -> dict[str, str]:
    """Every pod of the pool (a multi-node pool's Ray workers included)."""
    return {LABEL_INSTANCE: md_name, LABEL_POOL: pool}


def serving_selector(md_name: str, pool: Pool) -> dict[str, str]:
    """The pool's pods that serve: in a multi-node pool, each group's leader only."""
    selector = pool_selector(md_name, pool.name)
    if pool.multi_node:
        selector[LABEL_WORKER_INDEX] = "0"
    return selector


def workload_kind(pool: Pool) -> str:
    return LWS_KIND if pool.multi_node else "Deployment"


def workload_ref(md_name: str, pool: Pool) -> tuple[str, str, str]:
    """(apiVersion, kind, name) of the object that runs and scales the pool's engines."""
    api_version = LWS_API_VERSION if pool.multi_node else "apps/v1"
    return api_version, workload_kind(pool), pool_object_name(md_name, pool.name)


def _metadata(ctx: _Context, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ctx.namespace,
        "labels": labels,
        "ownerReferences": [ctx.owner],
    }


def _common_labels(ctx: _Context, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagefleet",
        "app.kubernetes.io/instance": ctx.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "pagefleet-operator",
        LABEL_INSTANCE: ctx.name,
    }


def fleet_secret_name(md_name: str) -> str:
    return f"{md_name}-fleet-secret"


def fleet_secret(ctx: _Context) -> dict:
    """The fleet Secret as the ModelDeployment owns it (the garbage collector deletes it with
    the ModelDeployment); its keys are random values the operator writes once, at creation."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(ctx, fleet_secret_name(ctx.name), _common_labels(ctx, "fleet")),
        "type": "Opaque",
    }


def _fleet_secret_volume(ctx: _Context) -> dict:
    items = [{"key": FLEET_SECRET_KEY, "path": FLEET_SECRET_KEY}]
    return {
        "name": "fleet-secret",
        # Group-readable: the kubelet gives the file to the pod's fsGroup.
        "secret": {"secretName": fleet_secret_name(ctx.name), "items": items, "defaultMode": 0o440},
    }


_FLEET_SECRET_MOUNT = {"name": "fleet-secret", "mountPath": FLEET_SECRET_DIR, "readOnly": True}


def _secret_env(name: str, ref: SecretKeyRef) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def engine_api_key(ctx: _Context) -> SecretKeyRef:
    return SecretKeyRef(fleet_secret_name(ctx.name), ENGINE_API_KEY)


def json_engine_args(spec: Spec, pool: Pool) -> dict[str, dict[str, Any]]:
    """The JSON-valued flags: the operator's keys, then the deployment-wide engineArgs' keys,
    then the pool's, each merged over the last (a user's kv_connector keeps the pod's kv_ip).
    KV events only where the router follows them (precise index), bound to the pod's own
    address, never every interface. Each pod advertises its own IP for KV transfer, and binds
    there too: the one address its peers dial, which also works on IPv6-only clusters, where
    0.0.0.0 would not listen on the pod's address."""
    pod_ip = f"$({POD_IP_ENV})"
    ours: dict[str, dict[str, Any]] = {}
    if spec.router.precise:
        ours["kv-events-config"] = kv_events_config(pod_ip, KV_EVENTS_PORT)
    if pool.role in KV_ROLES:
        # The container's kv-transfer port, never the engine default.
        config = kv_transfer_config(spec.kv_connector, pool.role, pod_ip, KV_TRANSFER_PORT)
        ours["kv-transfer-config"] = config
    return merge_json_configs(
        ours,
        _json_user_args(spec.engine_args, "spec.engineArgs"),
        _json_user_args(pool.engine_args, f"spec.pools.{pool.name}.engineArgs"),
    )


def _json_user_args(args: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    return {k: json_object(args[k], f"{where}.{k}") for k in JSON_ENGINE_ARGS if k in args}


def engine_command(spec: Spec, pool: Pool) -> list[str]:
    """The operator's flags first, the user's engineArgs after: argparse keeps the last value,
    so any operator default can be overridden (the JSON-valued ones are merged instead)."""
    # The pool's engineArgs override the deployment-wide ones, key by key.
    user = {**spec.engine_args, **pool.engine_args}
    command = ServeCommand(
        program="pagefleet",
        model=model_path(spec.model),
        device="cuda" if pool.gpus else "cpu",
        host="0.0.0.0",
        port=HTTP_PORT,
        served_model_name=spec.model.name,
        fleet_secret_file=FLEET_SECRET_FILE,
        json_args=json_engine_args(spec, pool),
        user_flags=[
            *(["--runner", spec.runner] if spec.runner != "auto" else []),
            *parallel_flags(pool),
            *lora_flags(spec),
            *engine_flags({k: v for k, v in user.items() if k not in JSON_ENGINE_ARGS}),
        ],
    )
    return serve_argv(command)


def lora_flags(spec: Spec) -> list[str]:
    """spec.adapters as the engine's --enable-lora --lora-modules name=path ..."""
    if not spec.adapters:
        return []
    modules = [f"{a.name}={adapter_path(a, i)}" for i, a in enumerate(spec.adapters)]
    return ["--enable-lora", "--lora-modules", *modules]


def parallel_flags(pool: Pool) -> list[str]:
    """The engine flags the pool's parallelism decides (refused in engineArgs)."""
    if pool.tensor_parallel_size == 1:
        return []
    return [
        "--tensor-parallel-size",
        str(pool.tensor_parallel_size),
        "--distributed-executor-backend",
        pool.executor_backend,
    ]


def ray_start_argv(pool: Pool, head: bool) -> list[str]:
    """`ray start` for a multi-node pool's pod: the leader's head (returns once it runs) or a
    worker that joins the leader's head and blocks while its node runs. Every port pinned."""
    argv = ["ray", "start"]
    if head:
        argv += ["--head", f"--port={RAY_GCS_PORT}", "--include-dashboard=false"]
    else:
        argv += [f"--address=$({LWS_LEADER_ENV}):{RAY_GCS_PORT}", "--block"]
    argv += [
        f"--node-ip-address=$({POD_IP_ENV})",
        f"--node-manager-port={RAY_NODE_MANAGER_PORT}",
        f"--object-manager-port={RAY_OBJECT_MANAGER_PORT}",
        *(f"--{flag}={port}" for flag, port in RAY_LOCAL_PORTS.items()),
        f"--min-worker-port={RAY_WORKER_PORTS[0]}",
        f"--max-worker-port={RAY_WORKER_PORTS[1]}",
        # One rank per GPU; a CPU pool's ranks take no GPU.
        f"--num-gpus={pool.gpus}",
        # A CPU pool's ranks take one logical CPU each: each pod holds exactly its share of
        # them (counting the pod's cores, Ray would pack every rank into the leader).
        *([] if pool.gpus else [f"--num-cpus={pool.tensor_parallel_size // pool.nodes}"]),
        f"--object-store-memory={RAY_OBJECT_STORE_BYTES}",
        "--disable-usage-stats",
    ]
    return argv


def leader_command(spec: Spec, pool: Pool) -> list[str]:
    """The leader starts the group's Ray head, then becomes the engine, whose Ray executor
    places its ranks on the group's nodes (RAY_ADDRESS: this head)."""
    head = shlex.join(ray_start_argv(pool, head=True))
    return ["sh", "-c", f"{head} && exec {shlex.join(engine_command(spec, pool))}"]


def worker_command(pool: Pool) -> list[str]:
    """A worker waits for the leader's head to answer (the LeaderWorkerSet starts the group's
    pods together), then joins it until its node stops; a worker that exits restarts the
    group (restartPolicy RecreateGroupOnPodRestart)."""
    address = f"$({LWS_LEADER_ENV}):{RAY_GCS_PORT}"
    check = shlex.join(["ray", "health-check", f"--address={address}"])
    wait = f"until {check} >/dev/null 2>&1; do sleep 2; done"
    return ["sh", "-c", f"{wait}; exec {shlex.join(ray_start_argv(pool, head=False))}"]


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _http_probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


# The pods of a pool: a single-node pool's engines, a multi-node pool's group leaders (Ray head
# and engine) and group workers (Ray workers holding ranks).
ENGINE, LEADER, WORKER = "engine", "leader", "worker"


def engine_labels(ctx: _Context, pool: Pool) -> dict[str, str]:
    return {
        **_common_labels(ctx, "engine"),
        **pool_selector(ctx.name, pool.name),
        LABEL_MODEL: ctx.spec.model.name,
        LABEL_ROLE: pool.role,
    }


def engine_pod_template(ctx: _Context, pool: Pool, part: str = ENGINE) -> dict:
    """The pod template of one part of a pool. Leaders and workers get what an engine pod
    gets (image, security, model volume, shm, RDMA, placement, overrides); only the pods that
    serve get the probes, the fleet secret and the engine's API key."""
    spec = ctx.spec
    serves = part != WORKER
    image = ctx.engine_image(pool)
    rdma = spec.rdma.enabled and pool.role in KV_ROLES
    security = _container_security()
    volume, init_containers = engine_model_volume(spec.model, image, security)
    adapter_vols, adapter_mounts, adapter_inits = adapter_volumes(spec.adapters, image, security)
    init_containers = [*init_containers, *adapter_inits]
    mounts = [
        {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": spec.model.source != "image"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
        *adapter_mounts,
    ]
    volumes = [
        volume,
        {"name": "tmp", "emptyDir": {}},
        # PyTorch, NCCL, NIXL and Ray's object store use shared memory; the runtime's 64 MiB
        # default is too small.
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": pool.shm_size}},
        *adapter_vols,
    ]
    if serves:
        mounts.append(_FLEET_SECRET_MOUNT)
        volumes.append(_fleet_secret_volume(ctx))
    container: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "command": part_command(spec, pool, part),
        "ports": [
            {"name": port, "containerPort": number, "protocol": "TCP"}
            for port, number in container_ports(spec, pool, part).items()
        ],
        "env": _engine_env(ctx, pool, part),
    }
    if serves:
        container.update(
            {
                "readinessProbe": _http_probe("/health", "http", 5, 3),
                "livenessProbe": _http_probe("/health", "http", 10, 6),
                "startupProbe": _startup_probe(pool),
            }
        )
    container["securityContext"] = _rdma_security(security) if rdma else security
    container["volumeMounts"] = mounts
    resources = _with_rdma(pool.resources, spec.rdma.resources) if rdma else pool.resources
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        # Engines never call the Kubernetes API: no token for a compromised engine to use.
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,
    }
    host_network = rdma and spec.rdma.host_network
    if pool.multi_node and not host_network:
        pod_spec["securityContext"]["sysctls"] = [
            {"name": LOCAL_PORT_RANGE_SYSCTL, "value": f"{EPHEMERAL_PORTS[0]} {EPHEMERAL_PORTS[1]}"}
        ]
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if pool.service_account:
        pod_spec["serviceAccountName"] = pool.service_account
    if pool.node_selector:
        pod_spec["nodeSelector"] = pool.node_selector
    if pool.tolerations:
        pod_spec["tolerations"] = pool.tolerations
    if host_network:
        # The RDMA device's own address; NetworkPolicies do not apply to host-network pods.
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if spec.placement is not None and pool.role in KV_ROLES:
        pod_spec["affinity"] = _placement_affinity(ctx)
    overlay(pod_spec, container, pool.pod)
    template_meta: dict[str, Any] = {"labels": {**pool.pod.labels, **engine_labels(ctx, pool)}}
    annotations = dict(pool.pod.annotations)
    if rdma and spec.rdma.networks:
        annotations[MULTUS_NETWORKS] = spec.rdma.networks
    if annotations:
        template_meta["annotations"] = annotations
    return {"metadata": template_meta, "spec": pod_spec}


def part_command(spec: Spec, pool: Pool, part: str) -> list[str]:
    if part == LEADER:
        return leader_command(spec, pool)
    if part == WORKER:
        return worker_command(pool)
    return engine_command(spec, pool)


def engine_workload(ctx: _Context, pool: Pool, replicas: int | None) -> dict:
    """The pool's Deployment, or its LeaderWorkerSet when an engine spans nodes."""
    if pool.multi_node:
        return engine_leader_worker_set(ctx, pool, replicas)
    return engine_deployment(ctx, pool, replicas)


def engine_deployment(ctx: _Context, pool: Pool, replicas: int | None) -> dict:
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": pool_selector(ctx.name, pool.name)},
        "template": engine_pod_template(ctx, pool),
    }
    strategy = pool.strategy or _default_strategy(pool)
    if strategy:
        deployment_spec["strategy"] = strategy
    if replicas is not None:
        deployment_spec = {"replicas": replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ctx, pool_object_name(ctx.name, pool.name), engine_labels(ctx, pool)),
        "spec": deployment_spec,
    }


def engine_leader_worker_set(ctx: _Context, pool: Pool, replicas: int | None) -> dict:
    """A multi-node pool, the way llm-d deploys one: `replicas` groups of `nodes` pods each, one
    engine per group. The LeaderWorkerSet (its scale subresource is what autoscalers and
    `kubectl scale` move) makes a StatefulSet of leaders and one of workers per group, names
    the group's pods after itself, and injects LWS_LEADER_ADDRESS, resolved through the
    headless Service of the same name that the operator makes (engine_service). A pod or
    container that fails restarts its whole group: the engine's ranks live and die together."""
    rolling = (pool.strategy or {}).get("rollingUpdate", {})
    lws_spec: dict[str, Any] = {
        # Workers start with their leader: the leader's engine waits for their ranks, so
        # LeaderReady (workers after a ready leader) would never start them.
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {
                # A surge group would need `nodes` spare GPU nodes: roll one group at a time.
                "maxSurge": rolling.get("maxSurge", 0),
                "maxUnavailable": rolling.get("maxUnavailable", 1),
            },
        },
        "leaderWorkerTemplate": {
            "size": pool.nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": engine_pod_template(ctx, pool, LEADER),
            "workerTemplate": engine_pod_template(ctx, pool, WORKER),
        },
    }
    if replicas is not None:
        lws_spec = {"replicas": replicas, **lws_spec}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": _metadata(ctx, pool_object_name(ctx.name, pool.name), engine_labels(ctx, pool)),
        "spec": lws_spec,
    }


def _engine_env(ctx: _Context, pool: Pool, part: str = ENGINE) -> list[dict]:
    env = [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if part != WORKER:
        env.append(_secret_env(API_KEY_ENV, engine_api_key(ctx)))
    if part == LEADER:
        # The engine's Ray executor joins the head its own pod started (after POD_IP, which
        # the kubelet expands here).
        env.append({"name": "RAY_ADDRESS", "value": f"$({POD_IP_ENV}):{RAY_GCS_PORT}"})
    if _uses_ucx(ctx.spec, pool):
        env.append({"name": "UCX_TCP_PORT_RANGE", "value": f"{UCX_PORTS[0]}-{UCX_PORTS[1]}"})
        if ctx.spec.rdma.enabled:
            env.append({"name": "UCX_TLS", "value": ctx.spec.rdma.ucx_tls})
    return env


def _default_strategy(pool: Pool) -> dict[str, Any] | None:
    """GPU pools roll one pod at a time without a surge pod: a surge would need a spare GPU
    node, which a full cluster does not have, and the rollout would hang."""
    if not pool.gpus:
        return None
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def _rdma_security(security: dict[str, Any]) -> dict[str, Any]:
    """IPC_LOCK lets UCX pin (register) memory for RDMA beyond the default memlock limit."""
    return {**security, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}


def _with_rdma(resources: dict[str, dict], rdma: dict[str, Any]) -> dict[str, dict]:
    """Extended resources (RDMA devices) go into requests and limits alike."""
    merged = {kind: dict(resources.get(kind, {})) for kind in ("requests", "limits")}
    for kind in merged:
        merged[kind].update(rdma)
    return merged


def _placement_affinity(ctx: _Context) -> dict[str, Any]:
    """Every prefill and decode pod of this ModelDeployment in one topology domain (a rack,
    a zone), where KV moves fastest; the first pod matches itself, so it may go anywhere."""
    placement = ctx.spec.placement
    assert placement is not None
    selector = {"matchLabels": {LABEL_INSTANCE: ctx.name, "app.kubernetes.io/component": "engine"}}
    term = {"labelSelector": selector, "topologyKey": placement.topology_key}
    if placement.required:
        rules = {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
    else:
        weighted = {"weight": 100, "podAffinityTerm": term}
        rules = {"preferredDuringSchedulingIgnoredDuringExecution": [weighted]}
    return {"podAffinity": rules}


def disruption_budget(ctx: _Context, pool: Pool) -> dict:
    """At most maxUnavailable of the pool's pods drained at once (node upgrades, autoscaler)."""
    selector = pool_selector(ctx.name, pool.name)
    labels = {**_common_labels(ctx, "engine"), **selector}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(ctx, pool_object_name(ctx.name, pool.name), labels),
        "spec": {"maxUnavailable": pool.max_unavailable, "selector": {"matchLabels": selector}},
    }


def container_ports(spec: Spec, pool: Pool, part: str) -> dict[str, int]:
    """The named ports of one part's container: the engine's where it serves, Ray's in a
    multi-node pool (the GCS on the leader)."""
    ports = engine_ports(spec, pool) if part != WORKER else {}
    if part == LEADER:
        ports["ray-gcs"] = RAY_GCS_PORT
    if part != ENGINE:
        ports.update({"ray-node": RAY_NODE_MANAGER_PORT, "ray-objects": RAY_OBJECT_MANAGER_PORT})
    return ports


def group_ports() -> tuple[dict, ...]:
    """What the pods of one multi-node pool open to each other (EPHEMERAL_PORTS, RAY_*)."""
    return (
        *tcp(RAY_GCS_PORT, RAY_NODE_MANAGER_PORT, RAY_OBJECT_MANAGER_PORT),
        tcp_range(RAY_WORKER_PORTS),
        tcp_range(EPHEMERAL_PORTS),
    )


def engine_ports(spec: Spec, pool: Pool) -> dict[str, int]:
    """An engine container's named ports: HTTP, KV events where the router follows them, the
    KV-transfer port on prefill and decode pods."""
    ports = {"http": HTTP_PORT}
    if spec.router.precise:
        ports.update({"kv-events": KV_EVENTS_PORT, "kv-replay": KV_REPLAY_PORT})
    if pool.role in KV_ROLES:
        ports["kv-transfer"] = KV_TRANSFER_PORT
    return ports


def _uses_ucx(spec: Spec, pool: Pool) -> bool:
    """Whether the pool's pods move KV with NIXL (UCX), whose ports NetworkPolicies open."""
    return pool.role in KV_ROLES and spec.kv_connector == "nixl"


def engine_service(ctx: _Context, pool: Pool) -> dict:
    """Headless: clients (the router, Prometheus) address engine pods one by one; in a
    multi-node pool, the group leaders only. Its name is the LeaderWorkerSet's, so the
    LeaderWorkerSet controller finds it and makes none of its own: it is the subdomain of the
    group's pods, through which LWS_LEADER_ADDRESS resolves, and publishes leaders before
    they are ready (a leader is ready only once its workers have joined it)."""
    selector = serving_selector(ctx.name, pool)
    ports = [
        {"name": port, "port": number, "targetPort": port, "protocol": "TCP"}
        for port, number in engine_ports(ctx.spec, pool).items()
    ]
    labels = {**_common_labels(ctx, "engine"), **pool_selector(ctx.name, pool.name)}
    service_spec: dict[str, Any] = {"clusterIP": "None", "selector": selector, "ports": ports}
    if pool.multi_node:
        service_spec["publishNotReadyAddresses"] = True
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ctx, pool_object_name(ctx.name, pool.name), labels),
        "spec": service_spec,
    }


def waiting_query(ctx_namespace: str, md_name: str, pool: str, model: str) -> str:
    """PromQL: the pool's total queue (pods are named after their Deployment)."""
    matchers = (
        f'namespace="{ctx_namespace}",pod=~"{pool_object_name(md_name, pool)}-.*",'
        f'model_name="{model}"'
    )
    return f"sum(vllm:num_requests_waiting{{{matchers}}})"


def queued_query(namespace: str, md_name: str, model: str) -> str:
    """PromQL: requests the ModelDeployment's router holds for its model, over its replicas
    (router pods are named after their Deployment, <name>-router)."""
    matchers = f'namespace="{namespace}",pod=~"{md_name}-router-.*",model="{model}"'
    return f"sum(pagefleet_router:queued_requests{{{matchers}}})"


def scaled_object(ctx: _Context, pool: Pool, prometheus_url: str | None) -> dict:
    if not prometheus_url:
        raise SpecError(
            f"spec.pools.{pool.name}.autoscaling.mode keda needs the operator's --prometheus-url"
        )
    a = pool.autoscaling
    name = pool_object_name(ctx.name, pool.name)
    behavior = {
        "scaleUp": {
            "stabilizationWindowSeconds": a.scale_up_stabilization_s,
            "policies": [{"type": "Pods", "value": a.max_scale_up_step, "periodSeconds": 15}],
        },
        "scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_s},
    }
    keda = a.keda
    waiting = waiting_query(ctx.namespace, ctx.name, pool.name, ctx.spec.model.name)
    waiting_trigger = _prometheus_trigger("engines-waiting", waiting, a, prometheus_url)
    if keda.activation_threshold is not None:
        waiting_trigger["metadata"]["activationThreshold"] = f"{keda.activation_threshold:g}"
    # The router's queue is the only demand Prometheus sees at zero pods (no engine, no
    # vllm:* series): KEDA activates the pool from 0 when it exceeds the activation threshold
    # (strictly: 0 wakes on the first held request), and counts it as waiting after that.
    queued = queued_query(ctx.namespace, ctx.name, ctx.spec.model.name)
    queue_trigger = _prometheus_trigger("router-queued", queued, a, prometheus_url)
    queue_trigger["metadata"]["activationThreshold"] = f"{keda.activation_threshold or 0:g}"
    # Running requests wait for nothing, so no trigger above sees them; yet KEDA scales to 0
    # once every trigger has been inactive for cooldownPeriod. This one is active while any
    # request runs (never to 0 under one), and its threshold is so high that it never asks
    # the HPA for more than one pod.
    running = waiting.replace("vllm:num_requests_waiting", "vllm:num_requests_running")
    running_trigger = _prometheus_trigger("engines-running", running, a, prometheus_url)
    running_trigger["metadata"].update(threshold=str(IN_FLIGHT_THRESHOLD), activationThreshold="0")
    spec: dict[str, Any] = {
        "scaleTargetRef": dict(
            zip(("apiVersion", "kind", "name"), workload_ref(ctx.name, pool), strict=True)
        ),
        "minReplicaCount": a.min_replicas,
        "maxReplicaCount": a.max_replicas,
        "cooldownPeriod": keda_cooldown(a),
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior}},
        "triggers": [waiting_trigger, queue_trigger, running_trigger],
    }
    if keda.polling_interval_s is not None:
        spec["pollingInterval"] = keda.polling_interval_s
    if keda.fallback:
        # Held while Prometheus cannot be read (KEDA needs an AverageValue trigger for it).
        spec["fallback"] = {"failureThreshold": keda.fallback[0], "replicas": keda.fallback[1]}
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {
            **_metadata(ctx, name, _common_labels(ctx, "autoscaler")),
            # Explicit, so that a ScaledObject paused by retired_objects() resumes.
            "annotations": {KEDA_PAUSED: "false"},
        },
        "spec": spec,
    }


def keda_cooldown(a: Autoscaling) -> float:
    """KEDA's cooldownPeriod: how long every trigger must be inactive before it scales the
    pool to 0, which is scaleToZeroIdleSeconds' meaning (KEDA ignores it above 0 replicas,
    where the HPA's scale-down window rules)."""
    if a.keda.cooldown_s is not None:
        return a.keda.cooldown_s
    return a.scale_to_zero_idle_s if a.min_replicas == 0 else a.scale_down_stabilization_s


def _prometheus_trigger(name: str, query: str, a: Autoscaling, prometheus_url: str) -> dict:
    """A KEDA prometheus trigger at the pool's target per replica (KEDA's metadata values
    are strings), with the pool's TriggerAuthentication if it names one."""
    trigger: dict[str, Any] = {
        "type": "prometheus",
        "name": name,
        # AverageValue: KEDA's HPA computes ceil(sum / threshold) replicas.
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": prometheus_url,
            "query": query,
            "threshold": f"{a.target_waiting_per_replica:g}",
        },
    }
    if a.keda.auth_modes:
        trigger["metadata"]["authModes"] = a.keda.auth_modes
    if a.keda.authentication:
        kind, auth_name = a.keda.authentication
        trigger["authenticationRef"] = {"name": auth_name, "kind": kind}
    return trigger


def network_policies(ctx: _Context, peers: PolicyPeers) -> list[dict]:
    """One NetworkPolicy for the router's pods, one for the Endpoint Picker's (if any) and one
    per engine pool (network_policy.py)."""
    spec = ctx.spec
    inputs = PolicyInputs(
        name=ctx.name,
        router_selector=router_selector(ctx.name),
        engines_selector={LABEL_INSTANCE: ctx.name, "app.kubernetes.io/component": "engine"},
        pool_selectors={p.name: pool_selector(ctx.name, p.name) for p in spec.pools},
        router_port=ROUTER_PORT,
        engine_port=HTTP_PORT,
        events_ports=(KV_EVENTS_PORT, KV_REPLAY_PORT) if spec.router.precise else (),
        kv_transfer_port=KV_TRANSFER_PORT,
        ucx_ports=UCX_PORTS if any(_uses_ucx(spec, p) for p in spec.pools) else None,
        download_ports=download_ports(spec),
        group_pools=tuple(p.name for p in spec.pools if p.multi_node),
        group_ports=group_ports(),
    )
    if spec.inference_pool is not None:
        inputs = dataclasses.replace(
            inputs,
            epp_selector=epp_selector(ctx.name),
            epp_port=EPP_GRPC_PORT,
            epp_metrics_port=EPP_METRICS_PORT,
            gateway_pools=(inference_pool_serving(spec).name,),
        )
    labels = _common_labels(ctx, "network-policy")
    policies = [(f"{ctx.name}-router", router_policy(inputs, peers))]
    if spec.inference_pool is not None:
        policies.append((f"{ctx.name}-epp", epp_policy(inputs, peers)))
    for pool in spec.pools:
        policies.append(
            (pool_object_name(ctx.name, pool.name), pool_policy(inputs, pool.name, peers))
        )
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(ctx, name, labels),
            "spec": policy,
        }
        for name, policy in policies
    ]


def download_ports(spec: Spec) -> tuple[int, ...]:
    """The ports of the hf:// model's and adapters' endpoints (443 for huggingface.co)."""
    sources = [spec.model, *(a.source for a in spec.adapters)]
    ports = []
    for source in sources:
        if source.source == "hf":
            url = urllib.parse.urlsplit(source.endpoint or "https://huggingface.co")
            ports.append(url.port or (443 if url.scheme == "https" else 80))
    return tuple(sorted(set(ports)))


def router_selector(md_name: str) -> dict[str, str]:
    return {LABEL_INSTANCE: md_name, "app.kubernetes.io/component": "router"}


def router_config(spec: Spec) -> str:
    config = {
        "filters": ["healthy", "model", "role"],
        "scorers": spec.router.weights_for(spec.adapters),
        "pd_threshold_tokens": spec.router.pd_threshold_tokens,
    }
    return yaml.safe_dump(config, sort_keys=False)


def queue_flags(queue: QueueBounds) -> list[str]:
    """The router's flow-control flags from spec.router.queue, those at the router's own
    defaults (the CRD's) left out: a router image without flow control still starts for a
    ModelDeployment that does not use it."""
    flags = []
    if queue.size != QueueBounds.size:
        flags += ["--queue-size", str(queue.size)]
    if queue.timeout_s != QueueBounds.timeout_s:
        flags += ["--queue-timeout", str(queue.timeout_s)]
    if queue.saturation_waiting is not None:
        flags += ["--saturation-waiting", str(queue.saturation_waiting)]
    if queue.saturation_kv is not None:
        flags += ["--saturation-kv", f"{queue.saturation_kv:g}"]
    return flags


def _startup_probe(pool: Pool) -> dict[str, Any]:
    """Loading weights and warming up can take long: up to 30 minutes. A pool woken from zero
    has a request waiting on it, so it is checked every 2 s rather than 10 (up to 10 s off
    every cold start)."""
    if scales_to_zero(pool):
        return _http_probe("/health", "http", 2, 900)
    return _http_probe("/health", "http", 10, 180)


def scales_to_zero(pool: Pool) -> bool:
    return pool.autoscaling.mode in ("builtin", "keda") and pool.autoscaling.min_replicas == 0


def router_readiness_path(spec: Spec) -> str:
    """/health (an engine is healthy) unless a pool can scale to zero: then /livez, or no
    request would reach the router to wake the pool."""
    return "/livez" if any(scales_to_zero(p) for p in spec.pools) else "/health"


def router_objects(ctx: _Context) -> list[dict]:
    """ConfigMap, RBAC to watch pods, Deployment and Service of the router."""
    spec = ctx.spec
    name = f"{ctx.name}-router"
    labels = _common_labels(ctx, "router")
    selector = router_selector(ctx.name)
    config_text = router_config(spec)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ctx, name, labels),
        "data": {"router.yaml": config_text},
    }
    command = ["pagefleet", "router", "--host", "0.0.0.0", "--port", str(ROUTER_PORT)]
    container = _picker_container(
        ctx,
        "router",
        command + _picking_flags(ctx),
        [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "http",
        spec.router.resources,
    )
    deployment = _picker_deployment(
        ctx, name, labels, selector, container, spec.router.replicas, spec.router.pod
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ctx, name, labels),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    return [config_map, *_pod_reader_rbac(ctx, name, labels), deployment, service]


def _picking_flags(ctx: _Context) -> list[str]:
    """The flags of the router's picking core, the same for `pagefleet router` and `pagefleet
    epp`: what they discover, how they score, hash, follow KV events and hold requests."""
    spec = ctx.spec
    flags = [
        "--kubernetes-namespace",
        ctx.namespace,
        # Discovery trusts only pods of this ModelDeployment's own engine Deployments.
        "--deployment",
        ctx.name,
        "--selector",
        # The deployment's own engines only: another ModelDeployment may serve the same model.
        f"{LABEL_INSTANCE}={ctx.name},{LABEL_MODEL}={spec.model.name}",
        "--engine-port",
        str(HTTP_PORT),
        "--model",
        spec.model.name,
        "--config",
        ROUTER_CONFIG_FILE,
        # Signs kv_transfer_params for the engines and opens their encrypted KV events.
        "--fleet-secret-file",
        FLEET_SECRET_FILE,
        # Hash prompts with the engines' tokenizer.
        "--tokenizer",
        model_path(spec.model),
        "--prefix-index",
        spec.router.prefix_index,
    ]
    if spec.router.precise:
        # Follow the engines' KV events (replayed from port + 1 when the picker starts, so a
        # restarted one rebuilds its index).
        flags += ["--kv-events-port", str(KV_EVENTS_PORT)]
    return flags + queue_flags(spec.router.queue)


def _pod_reader_rbac(ctx: _Context, name: str, labels: dict[str, str]) -> list[dict]:
    """A ServiceAccount whose Role reads pods, nothing else: discovery watches the engines."""
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(ctx, name, labels),
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(ctx, name, labels),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(ctx, name, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}],
    }
    return [account, role, binding]


def _picker_container(
    ctx: _Context,
    name: str,
    command: list[str],
    ports: list[dict],
    probe_port: str,
    resources: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The container of a router or Endpoint Picker pod."""
    spec = ctx.spec
    env = [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
        _secret_env(UPSTREAM_API_KEY_ENV, engine_api_key(ctx)),
    ]
    if spec.api_key_secret is not None:
        env.append(_secret_env(API_KEY_ENV, spec.api_key_secret))
    return {
        "name": name,
        "image": ctx.router_image,
        "command": command,
        "ports": ports,
        "env": env,
        # Ready while an engine is healthy, or, where a pool can sit at zero, while the
        # process serves: it holds requests and its queue wakes the pool, so its Service must
        # send them. Alive while the process serves (/health would restart it while engines
        # load, in an outage and at zero replicas).
        "readinessProbe": _http_probe(router_readiness_path(spec), probe_port, 5, 3),
        "livenessProbe": _http_probe("/livez", probe_port, 10, 6),
        "securityContext": _container_security(),
        "resources": resources,
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/pagefleet", "readOnly": True},
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            _FLEET_SECRET_MOUNT,
        ],
    }


def _picker_deployment(
    ctx: _Context,
    name: str,
    labels: dict[str, str],
    selector: dict[str, str],
    container: dict[str, Any],
    replicas: int,
    overrides: PodOverrides,
) -> dict:
    """A router or Endpoint Picker Deployment: the router's config, the model's tokenizer and
    the fleet secret mounted, discovery under its own ServiceAccount (named as it is)."""
    spec = ctx.spec
    security = container["securityContext"]
    model_volume, init_containers = router_model_volume(spec.model, ctx.router_image, security)
    pod_spec: dict[str, Any] = {
        # Discovery watches pods with this account's token (its Role: pods, read-only).
        "serviceAccountName": name,
        "automountServiceAccountToken": True,
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": f"{ctx.name}-router"}},
            model_volume,
            {"name": "tmp", "emptyDir": {}},
            _fleet_secret_volume(ctx),
        ],
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    overlay(pod_spec, container, overrides)
    # A config change must roll the pods: they read the file once at start.
    config_hash = hashlib.sha256(router_config(spec).encode()).hexdigest()[:16]
    annotations = {**overrides.annotations, "pagefleet.io/config-hash": config_hash}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ctx, name, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": {**overrides.labels, **labels, **selector},
                    "annotations": annotations,
                },
                "spec": pod_spec,
            },
        },
    }


def epp_selector(md_name: str) -> dict[str, str]:
    return {LABEL_INSTANCE: md_name, "app.kubernetes.io/component": "epp"}


def inference_pool_serving(spec: Spec) -> Pool:
    """The pool a Gateway sends requests to: decode pods where the fleet is disaggregated (the
    picker runs the prefill), else the colocated pool."""
    return spec.pool("decode" if spec.mode == "disaggregated" else "colocated")


def epp_objects(ctx: _Context) -> list[dict]:
    """spec.inferencePool: RBAC to watch pods, Deployment and Service of `pagefleet epp`, and
    the InferencePool (inference.networking.k8s.io/v1) over the serving pods naming it as its
    Endpoint Picker. The picker shares the router's config (its ConfigMap)."""
    spec, pool = ctx.spec, ctx.spec.inference_pool
    assert pool is not None
    name = f"{ctx.name}-epp"
    labels = _common_labels(ctx, "epp")
    selector = epp_selector(ctx.name)
    command = ["pagefleet", "epp", "--host", "0.0.0.0", "--port", str(EPP_GRPC_PORT)]
    command += ["--metrics-port", str(EPP_METRICS_PORT)]
    command += [*_picking_flags(ctx), "--fallback-endpoints", str(pool.fallback_endpoints)]
    ports = [
        {"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
    ]
    container = _picker_container(ctx, "epp", command, ports, "metrics", pool.resources)
    deployment = _picker_deployment(ctx, name, labels, selector, container, pool.replicas, pool.pod)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ctx, name, labels),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {
                    "name": "grpc",
                    "port": EPP_GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    # gRPC without TLS: Gateways must speak HTTP/2 to it in the clear.
                    "appProtocol": "kubernetes.io/h2c",
                },
                {
                    "name": "metrics",
                    "port": EPP_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }
    inference_pool = {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": _metadata(ctx, ctx.name, _common_labels(ctx, "inference-pool")),
        "spec": {
            "selector": {"matchLabels": serving_selector(ctx.name, inference_pool_serving(spec))},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "name": name,
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": pool.failure_mode,
            },
        },
    }
    return [*_pod_reader_rbac(ctx, name, labels), deployment, service, inference_pool]
