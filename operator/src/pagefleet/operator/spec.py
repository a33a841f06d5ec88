"""A ModelDeployment's spec as dataclasses: defaults applied and every rule of the CRD's schema
(CEL rules included) checked, so handlers and tests get one answer on what is valid."""

from __future__ import annotations

import json
import posixpath
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from pagefleet.common import __version__
from pagefleet.common.capacity import FORMAT_BYTES, GPU_MEMORY_GB, gpu_key
from pagefleet.common.model_download import HfSource, parse_hf_uri
from pagefleet.common.names import LORA_NAME_PATTERN
from pagefleet.common.serve_command import JSON_ENGINE_ARGS, EngineArg
from pagefleet.operator.crd import (
    AUTOSCALING_DEFAULTS,
    AUTOSCALING_MODES,
    DEPLOYMENT_MODES,
    DNS_SUBDOMAIN_PATTERN,
    EPP_RESOURCES,
    FAILURE_MODES,
    GPU_MESSAGE,
    GPU_RESOURCE,
    GROUP_STRATEGY_MESSAGE,
    INFERENCE_POOL_DEFAULTS,
    KV_CONNECTORS,
    LORA_AFFINITY_DEFAULT,
    MAX_ADAPTERS,
    MODEL_NAME_PATTERN,
    MODEL_SOURCES,
    OBJECT_NAME_MAX,
    OBJECT_NAME_PATTERN,
    POOL_NAMES,
    POOLING_MODE_MESSAGE,
    PREFIX_INDEXES,
    RDMA_UCX_TLS,
    RESERVED_ENGINE_ARGS,
    RESOURCE_KINDS,
    ROUTER_DEFAULTS,
    ROUTER_QUEUE_DEFAULTS,
    ROUTER_RESOURCES,
    RUNNERS,
    SCORER_DEFAULTS,
    SCORERS,
    SECRET_KEY_PATTERN,
    TP_NODES_MESSAGE,
    name_rule,
)
from pagefleet.operator.pod_overrides import (
    POD_FIELDS,
    OverrideError,
    PodOverrides,
    parse_pod_overrides,
)

# One tag scheme: <version> is the CPU build (Dockerfile.cpu), <version>-cuda the CUDA build.
DEFAULT_IMAGE = f"ghcr.io/pagefleet/pagefleet:{__version__}"
DEFAULT_GPU_IMAGE = f"ghcr.io/pagefleet/pagefleet:{__version__}-cuda"
DEFAULT_SHM_SIZE = "2Gi"
# /dev/shm by default: NCCL (and PyTorch's worker processes) share memory per GPU; Ray's
# object store lives there too on multi-node pods, capped at RAY_OBJECT_STORE_GI.
SHM_GI_PER_GPU = 2
RAY_OBJECT_STORE_GI = 1
# A multi-node pool's LeaderWorkerSet is named <md>-<pool>; its worker StatefulSets add
# "-<group>", and a StatefulSet's pods carry "<its name>-<10-character revision hash>" as a
# label value (63 characters at most): 48 leaves room for 999 groups.
GROUP_NAME_MAX = 48
# The router runs from its own image (deploy/docker/Dockerfile.slim): no torch, a tenth the size.
DEFAULT_ROUTER_IMAGE = f"ghcr.io/pagefleet/pagefleet-router:{__version__}"
# The CRD's CEL message (crd.model_schema), so both refusals read the same.
HF_ONLY = "spec.model: hf and cache go with an hf:// uri"
ROLE_OF_POOL = {"colocated": "both", "prefill": "prefill", "decode": "decode"}


class SpecError(ValueError):
    """The spec cannot work; the message says which field and why."""

    reason = "InvalidSpec"  # the Degraded condition's reason


class HostPathNotAllowed(SpecError):
    """A hostPath model source outside the folders the operator was started to allow."""

    reason = "HostPathNotAllowed"


@dataclass(frozen=True)
class KedaOptions:
    polling_interval_s: int | None = None
    cooldown_s: int | None = None  # None: scaleDownStabilizationSeconds
    activation_threshold: float | None = None
    fallback: tuple[int, int] | None = None  # (failureThreshold, replicas)
    authentication: tuple[str, str] | None = None  # (kind, name) of a TriggerAuthentication
    auth_modes: str | None = None


@dataclass(frozen=True)
class Autoscaling:
    mode: str = AUTOSCALING_DEFAULTS["mode"]
    min_replicas: int = AUTOSCALING_DEFAULTS["minReplicas"]
    max_replicas: int = AUTOSCALING_DEFAULTS["maxReplicas"]
    target_waiting_per_replica: float = AUTOSCALING_DEFAULTS["targetWaitingPerReplica"]
    scale_up_stabilization_s: float = AUTOSCALING_DEFAULTS["scaleUpStabilizationSeconds"]
    scale_down_stabilization_s: float = AUTOSCALING_DEFAULTS["scaleDownStabilizationSeconds"]
    max_scale_up_step: int = AUTOSCALING_DEFAULTS["maxScaleUpStep"]
    # minReplicas 0 only: how long nothing may run, wait or queue before the pool goes to 0.
    scale_to_zero_idle_s: float = AUTOSCALING_DEFAULTS["scaleToZeroIdleSeconds"]
    keda: KedaOptions = field(default_factory=KedaOptions)


@dataclass(frozen=True)
class Pool:
    name: str  # colocated | prefill | decode
    replicas: int = 1
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    engine_args: dict[str, EngineArg] = field(default_factory=dict)
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    image: str | None = None
    pod: PodOverrides = field(default_factory=PodOverrides)
    service_account: str | None = None
    shm_size: str = DEFAULT_SHM_SIZE
    strategy: dict[str, Any] | None = None  # None: the default for the pool's device
    max_unavailable: int | str = 1  # its PodDisruptionBudget
    tensor_parallel_size: int = 1  # ranks of one engine
    nodes: int = 1  # pods of one engine (above 1: a LeaderWorkerSet group with Ray)

    @property
    def role(self) -> str:
        return ROLE_OF_POOL[self.name]

    @property
    def gpus(self) -> int:
        """GPUs per pod: the nvidia.com/gpu limit (or request)."""
        for kind in ("limits", "requests"):
            value = self.resources.get(kind, {}).get(GPU_RESOURCE)
            if value is not None:
                return int(str(value))
        return 0

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def executor_backend(self) -> str:
        """How the engine starts its ranks: processes in its pod, Ray actors across pods."""
        return "ray" if self.multi_node else "mp"


@dataclass(frozen=True)
class Model:
    name: str
    source: str = "pvc"  # pvc | image | hostPath | hf
    claim_name: str | None = None  # the weights' claim (pvc), or the download cache's (hf)
    path: str | None = None  # inside the PVC, the image, or on the host
    image: str | None = None
    hf: HfSource | None = None
    token_secret: SecretKeyRef | None = None  # hf: the token's Secret key
    endpoint: str | None = None  # hf: HF_ENDPOINT


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter every engine loads: its name, where its PEFT folder comes from (an
    hf:// or pvc:// source, as a model's), and its rank if the spec says it."""

    name: str
    source: Model
    rank: int | None = None


@dataclass(frozen=True)
class Rdma:
    enabled: bool = False
    resources: dict[str, Any] = field(default_factory=dict)
    ucx_tls: str = RDMA_UCX_TLS
    networks: str | None = None
    host_network: bool = False


@dataclass(frozen=True)
class Placement:
    topology_key: str
    required: bool = False


@dataclass(frozen=True)
class QueueBounds:
    """spec.router.queue: the router's --queue-size, --queue-timeout, --saturation-*."""

    size: int = ROUTER_QUEUE_DEFAULTS["size"]
    timeout_s: int = ROUTER_QUEUE_DEFAULTS["timeoutSeconds"]
    saturation_waiting: int | None = None
    saturation_kv: float | None = None


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = ROUTER_DEFAULTS["replicas"]
    scorer_weights: dict[str, float] = field(default_factory=lambda: dict(SCORER_DEFAULTS))
    pd_threshold_tokens: int = ROUTER_DEFAULTS["pdThresholdTokens"]
    prefix_index: str = ROUTER_DEFAULTS["prefixIndex"]  # precise: follow the engines' KV events
    resources: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(ROUTER_RESOURCES))
    pod: PodOverrides = field(default_factory=PodOverrides)
    queue: QueueBounds = field(default_factory=QueueBounds)

    @property
    def precise(self) -> bool:
        return self.prefix_index == "precise"

    def weights_for(self, adapters: tuple) -> dict[str, float]:
        """The scorer weights the router runs with: LoRA affinity joins them (at
        LORA_AFFINITY_DEFAULT) when the deployment has adapters and scorerWeights names none."""
        if adapters and "lora-affinity" not in self.scorer_weights:
            return {**self.scorer_weights, "lora-affinity": LORA_AFFINITY_DEFAULT}
        return dict(self.scorer_weights)


@dataclass(frozen=True)
class InferencePoolSpec:
    """spec.inferencePool: an InferencePool over the serving pods and its Endpoint Picker."""

    failure_mode: str = INFERENCE_POOL_DEFAULTS["failureMode"]
    replicas: int = INFERENCE_POOL_DEFAULTS["replicas"]
    fallback_endpoints: int = INFERENCE_POOL_DEFAULTS["fallbackEndpoints"]
    resources: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(EPP_RESOURCES))
    pod: PodOverrides = field(default_factory=PodOverrides)


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the ModelDeployment's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class CapacitySpec:
    """spec.capacity: what the admission check (operator/admission.py) cannot read from the
    cluster. Every field optional: the GPU may come from a pool's nodeSelector, the model's
    shape from an hf:// model's config.json."""

    model_config: dict[str, Any] | None = None  # the checkpoint's config.json
    gpu: str | None = None  # a GPU type of pagefleet.common.capacity's table
    gpu_memory_gb: float | None = None  # instead of gpu
    weights_format: str | None = None  # default: the engine's dtype
    num_parameters: int | None = None  # default: estimated from the config
    overhead_gb: float = 0.0
    admit_anyway: bool = False  # the expert's override: deploy even if it does not fit


@dataclass(frozen=True)
class Spec:
    model: Model
    image: str | None  # the user's engine image for every pool (None: by device)
    mode: str
    pools: tuple[Pool, ...]
    engine_args: dict[str, EngineArg]
    router: RouterSpec
    kv_connector: str
    api_key_secret: SecretKeyRef | None = None  # the key clients must send the router
    rdma: Rdma = field(default_factory=Rdma)
    placement: Placement | None = None
    capacity: CapacitySpec = field(default_factory=CapacitySpec)
    adapters: tuple[Adapter, ...] = ()
    inference_pool: InferencePoolSpec | None = None  # None: no InferencePool, no picker
    runner: str = "auto"  # the engines' --runner (pooling: embeddings)

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{where} must be an object")
    return value


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{where} must be an integer >= {minimum}, not {value!r}")
    return value


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SpecError(f"{where} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _reject_unknown(raw: dict[str, Any], known: set[str], where: str) -> None:
    # The API server's strict field validation (kubectl's default) rejects unknown fields;
    # a typo such as `autoscalling` must not silently become "no autoscaling".
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}")


def parse_engine_args(raw: Any, where: str) -> dict[str, EngineArg]:
    args = _mapping(raw, where)
    for key, value in args.items():
        if not isinstance(key, str) or not key or key.startswith("-"):
            raise SpecError(f'{where}: flag names come without "--", not {key!r}')
        if key in RESERVED_ENGINE_ARGS:
            raise SpecError(f"{where.removesuffix('.engineArgs')}.{RESERVED_ENGINE_ARGS[key]}")
        if not isinstance(value, str | int | float | bool):
            raise SpecError(f"{where}.{key} must be a string, number or bool")
        if key in JSON_ENGINE_ARGS:
            json_object(value, f"{where}.{key}")
    return dict(args)


def json_object(value: EngineArg, where: str) -> dict[str, Any]:
    """A JSON-object engine arg (given as a string, e.g. '{"kv_connector": "tcp"}') as a dict."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise SpecError(f"{where} must be a JSON object in a string, not {value!r}")
    return parsed


def _number(value: Any, where: str, minimum: float = 0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise SpecError(f"{where} must be a number >= {minimum:g}, not {value!r}")
    return float(value)


def parse_keda(raw: Any, where: str) -> KedaOptions:
    k = _mapping(raw, where)
    known = {
        "pollingInterval",
        "cooldownPeriod",
        "activationThreshold",
        "fallback",
        "authenticationRef",
        "authModes",
    }
    _reject_unknown(k, known, where)
    fallback = None
    if "fallback" in k:
        f = _mapping(k["fallback"], f"{where}.fallback")
        _reject_unknown(f, {"failureThreshold", "replicas"}, f"{where}.fallback")
        fallback = (
            _int(f.get("failureThreshold"), f"{where}.fallback.failureThreshold", 1),
            _int(f.get("replicas"), f"{where}.fallback.replicas", 0),
        )
    authentication = None
    if "authenticationRef" in k:
        ref = _mapping(k["authenticationRef"], f"{where}.authenticationRef")
        _reject_unknown(ref, {"name", "kind"}, f"{where}.authenticationRef")
        name = ref.get("name")
        if not isinstance(name, str) or not re.match(DNS_SUBDOMAIN_PATTERN, name):
            raise SpecError(f"{where}.authenticationRef.name must name a TriggerAuthentication")
        kind = _choice(
            ref.get("kind", RESOURCE_KINDS[0]), f"{where}.authenticationRef.kind", RESOURCE_KINDS
        )
        authentication = (kind, name)
    modes = k.get("authModes")
    return KedaOptions(
        polling_interval_s=_optional_int(k, "pollingInterval", where, 1),
        cooldown_s=_optional_int(k, "cooldownPeriod", where, 0),
        activation_threshold=(
            _number(k["activationThreshold"], f"{where}.activationThreshold")
            if "activationThreshold" in k
            else None
        ),
        fallback=fallback,
        authentication=authentication,
        auth_modes=(
            _choice(modes, f"{where}.authModes", ("basic", "bearer", "tls", "custom"))
            if modes is not None
            else None
        ),
    )


def _optional_int(raw: dict, key: str, where: str, minimum: int) -> int | None:
    return _int(raw[key], f"{where}.{key}", minimum) if raw.get(key) is not None else None


def parse_autoscaling(raw: Any, where: str) -> Autoscaling:
    a = {**AUTOSCALING_DEFAULTS, **_mapping(raw, where)}
    keda = parse_keda(a.pop("keda", None), f"{where}.keda")
    _reject_unknown(a, set(AUTOSCALING_DEFAULTS), where)
    target = a["targetWaitingPerReplica"]
    if isinstance(target, bool) or not isinstance(target, int | float) or target <= 0:
        raise SpecError(f"{where}.targetWaitingPerReplica must be a number > 0")
    parsed = Autoscaling(
        mode=_choice(a["mode"], f"{where}.mode", AUTOSCALING_MODES),
        min_replicas=_int(a["minReplicas"], f"{where}.minReplicas", 0),
        max_replicas=_int(a["maxReplicas"], f"{where}.maxReplicas", 1),
        target_waiting_per_replica=float(target),
        scale_up_stabilization_s=_int(
            a["scaleUpStabilizationSeconds"], f"{where}.scaleUpStabilizationSeconds", 0
        ),
        scale_down_stabilization_s=_int(
            a["scaleDownStabilizationSeconds"], f"{where}.scaleDownStabilizationSeconds", 0
        ),
        max_scale_up_step=_int(a["maxScaleUpStep"], f"{where}.maxScaleUpStep", 1),
        scale_to_zero_idle_s=_int(
            a["scaleToZeroIdleSeconds"], f"{where}.scaleToZeroIdleSeconds", 0
        ),
        keda=keda,
    )
    if keda != KedaOptions() and parsed.mode != "keda":
        raise SpecError(f"{where}.keda needs mode keda")
    if parsed.min_replicas > parsed.max_replicas:
        raise SpecError(f"{where}: minReplicas must not exceed maxReplicas")
    return parsed


def parse_overrides(raw: dict[str, Any], where: str) -> PodOverrides:
    try:
        return parse_pod_overrides(raw, where)
    except OverrideError as e:
        raise SpecError(str(e)) from None


def parse_resources(raw: Any, where: str) -> dict[str, dict[str, Any]]:
    resources = _mapping(raw, where)
    _reject_unknown(resources, {"requests", "limits"}, where)
    return {k: dict(_mapping(v, f"{where}.{k}")) for k, v in resources.items()}


def parse_strategy(raw: Any, where: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    strategy = _mapping(raw, where)
    _reject_unknown(strategy, {"type", "rollingUpdate"}, where)
    kind = _choice(strategy.get("type", "RollingUpdate"), f"{where}.type", STRATEGY_TYPES)
    rolling = _mapping(strategy.get("rollingUpdate"), f"{where}.rollingUpdate")
    _reject_unknown(rolling, {"maxSurge", "maxUnavailable"}, f"{where}.rollingUpdate")
    if kind == "Recreate" and rolling:
        raise SpecError(f"{where}.rollingUpdate goes with type RollingUpdate only")
    for key, value in rolling.items():
        _int_or_percent(value, f"{where}.rollingUpdate.{key}")
    return {"type": kind, **({"rollingUpdate": dict(rolling)} if rolling else {})}


def _int_or_percent(value: Any, where: str) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and re.fullmatch(r"[0-9]+%", value):
        return value
    raise SpecError(f"{where} must be an integer >= 0 or a percentage, not {value!r}")


def parse_pool(name: str, raw: Any) -> Pool:
    where = f"spec.pools.{name}"
    p = _mapping(raw, where)
    known = {
        "replicas",
        "resources",
        "nodeSelector",
        "tolerations",
        "engineArgs",
        "autoscaling",
        "image",
        "serviceAccountName",
        "shmSize",
        "strategy",
        "disruptionBudget",
        "tensorParallelSize",
        "nodes",
        *POD_FIELDS,
    }
    _reject_unknown(p, known, where)
    resources = parse_resources(p.get("resources"), f"{where}.resources")
    tolerations = p.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
        raise SpecError(f"{where}.tolerations must be a list of objects")
    node_selector = _mapping(p.get("nodeSelector"), f"{where}.nodeSelector")
    if not all(isinstance(v, str) for v in node_selector.values()):
        raise SpecError(f"{where}.nodeSelector values must be strings")
    account = p.get("serviceAccountName")
    if account is not None and not (
        isinstance(account, str) and re.match(DNS_SUBDOMAIN_PATTERN, account)
    ):
        raise SpecError(f"{where}.serviceAccountName must name a ServiceAccount")
    tensor_parallel = _int(p.get("tensorParallelSize", 1), f"{where}.tensorParallelSize", 1)
    nodes = _int(p.get("nodes", 1), f"{where}.nodes", 1)
    if tensor_parallel % nodes:
        raise SpecError(f"{where}: {TP_NODES_MESSAGE}")
    gpus = pod_gpus(resources, where)
    shm = p.get("shmSize") or default_shm_size(gpus, nodes)
    if not isinstance(shm, str) or not re.fullmatch(r"[0-9]+(Ki|Mi|Gi|Ti)?", shm):
        raise SpecError(f"{where}.shmSize must be a quantity such as 8Gi, not {shm!r}")
    budget = _mapping(p.get("disruptionBudget"), f"{where}.disruptionBudget")
    _reject_unknown(budget, {"maxUnavailable"}, f"{where}.disruptionBudget")
    image = p.get("image")
    if image is not None and (not isinstance(image, str) or not image):
        raise SpecError(f"{where}.image must be an image reference")
    strategy = parse_strategy(p.get("strategy"), f"{where}.strategy")
    if nodes > 1 and strategy is not None and strategy["type"] != "RollingUpdate":
        raise SpecError(f"{where}: {GROUP_STRATEGY_MESSAGE}")
    pool = Pool(
        name=name,
        replicas=_int(p.get("replicas", 1), f"{where}.replicas", 0),
        resources=resources,
        node_selector=dict(node_selector),
        tolerations=[dict(t) for t in tolerations],
        engine_args=parse_engine_args(p.get("engineArgs"), f"{where}.engineArgs"),
        autoscaling=parse_autoscaling(p.get("autoscaling"), f"{where}.autoscaling"),
        image=image,
        pod=parse_overrides(p, where),
        service_account=account,
        shm_size=shm,
        strategy=strategy,
        max_unavailable=_int_or_percent(
            budget.get("maxUnavailable", 1), f"{where}.disruptionBudget.maxUnavailable"
        ),
        tensor_parallel_size=tensor_parallel,
        nodes=nodes,
    )
    check_gpus(pool)
    return pool


def pod_gpus(resources: dict[str, dict[str, Any]], where: str) -> int:
    """GPUs each pod requests (limits, else requests; 0: a CPU pool). A quantity the engine
    cannot count, or limits and requests that disagree, fail here, not in a pod."""
    counts = []
    for kind in ("limits", "requests"):
        value = resources.get(kind, {}).get(GPU_RESOURCE)
        if value is None:
            continue
        text = str(value)
        if isinstance(value, bool) or not text.isdigit():
            raise SpecError(f"{where}.resources: {GPU_RESOURCE} must be a whole number")
        counts.append(int(text))
    if len(set(counts)) > 1:
        # Kubernetes requires them equal for extended resources; say so before a pod fails.
        raise SpecError(f"{where}.resources: {GPU_RESOURCE} limits and requests must be equal")
    return counts[0] if counts else 0


def default_shm_size(gpus: int, nodes: int) -> str:
    """/dev/shm unless the pool says: 2Gi per GPU (NCCL's shared-memory transport and PyTorch's
    tensors between rank processes), at least 2Gi, and 1Gi more for Ray's object store on the
    pods of a multi-node pool."""
    size = SHM_GI_PER_GPU * max(1, gpus) + (RAY_OBJECT_STORE_GI if nodes > 1 else 0)
    return f"{size}Gi"


def parse_model(raw: Any) -> Model:
    m = _mapping(raw, "spec.model")
    known = {"name", "uri", "hf", "cache", "source", "pvc", "image", "path"}
    _reject_unknown(m, known, "spec.model")
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("spec.model.name is required")
    if len(name) > 63 or not re.match(MODEL_NAME_PATTERN, name):
        raise SpecError(
            f"spec.model.name {name!r} must be a label value (63 characters of A-Z a-z 0-9 . _ -)"
        )
    if "uri" in m:
        return parse_model_uri(name, m)
    if "hf" in m or "cache" in m:
        raise SpecError(HF_ONLY)
    source = _choice(m.get("source", "pvc"), "spec.model.source", MODEL_SOURCES)
    pvc = _mapping(m.get("pvc"), "spec.model.pvc")
    if source == "pvc" and not pvc:
        raise SpecError("spec.model.pvc is required when source is pvc")
    if pvc and not pvc.get("claimName"):
        raise SpecError("spec.model.pvc.claimName is required")
    if source == "image" and not m.get("image"):
        raise SpecError("spec.model.image is required when source is image")
    if source == "hostPath" and not m.get("path"):
        raise SpecError("spec.model.path is required when source is hostPath")
    path = pvc.get("path") if source == "pvc" else m.get("path")
    return Model(name, source, pvc.get("claimName"), path, m.get("image"))


def parse_model_uri(name: str, m: dict[str, Any], where: str = "spec.model") -> Model:
    """`uri: hf://org/name[@revision]` or `pvc://claim[/path]`, which replace source."""
    clash = sorted({"source", "pvc", "image", "path"} & set(m))
    if clash:
        raise SpecError(
            f"{where}: uri replaces source, pvc, image and path: give one or the other "
            f"(found {', '.join(clash)})"
        )
    uri = m["uri"]
    if not isinstance(uri, str):
        raise SpecError(f"{where}.uri must be a string")
    if uri.startswith("pvc://"):
        if "hf" in m or "cache" in m:
            raise SpecError(HF_ONLY)
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        if not re.match(DNS_SUBDOMAIN_PATTERN, claim):
            raise SpecError(f"{where}.uri {uri!r}: {claim!r} is not a claim name")
        return Model(name, "pvc", claim, path.strip("/") or None)
    if not uri.startswith("hf://"):
        raise SpecError(f"{where}.uri {uri!r} must start with hf:// or pvc://")
    try:
        source = parse_hf_uri(uri)
    except ValueError as e:
        raise SpecError(f"{where}.uri: {e}") from None
    hf = _mapping(m.get("hf"), f"{where}.hf")
    _reject_unknown(hf, {"tokenSecret", "endpoint"}, f"{where}.hf")
    endpoint = hf.get("endpoint")
    if endpoint is not None and not (
        isinstance(endpoint, str) and re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", endpoint)
    ):
        raise SpecError(f"{where}.hf.endpoint must be an http(s) URL, not {endpoint!r}")
    if endpoint is not None:
        try:
            urllib.parse.urlsplit(endpoint).port  # noqa: B018 - the policies open this port
        except ValueError as e:
            raise SpecError(f"{where}.hf.endpoint {endpoint!r}: {e}") from None
    cache = _mapping(m.get("cache"), "spec.model.cache")
    _reject_unknown(cache, {"claimName"}, "spec.model.cache")
    claim = cache.get("claimName")
    if cache and not (isinstance(claim, str) and re.match(DNS_SUBDOMAIN_PATTERN, claim)):
        raise SpecError("spec.model.cache.claimName must name a PersistentVolumeClaim")
    return Model(
        name,
        "hf",
        claim_name=claim,
        hf=source,
        token_secret=parse_secret_key_ref(hf.get("tokenSecret"), f"{where}.hf.tokenSecret"),
        endpoint=endpoint,
    )


def parse_adapters(raw: Any, model_name: str) -> tuple[Adapter, ...]:
    """spec.adapters: LoRA adapters by unique name (none the model's), each an hf:// or
    pvc:// PEFT folder, at most MAX_ADAPTERS."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_ADAPTERS:
        raise SpecError(f"spec.adapters must be a list of at most {MAX_ADAPTERS} adapters")
    adapters: list[Adapter] = []
    for i, item in enumerate(raw):
        where = f"spec.adapters[{i}]"
        a = _mapping(item, where)
        _reject_unknown(a, {"name", "uri", "hf", "rank"}, where)
        name = a.get("name")
        if not isinstance(name, str) or not re.fullmatch(LORA_NAME_PATTERN, name):
            raise SpecError(
                f"{where}.name {name!r}: 1-128 characters of letters, digits and . _ : / @ + -"
            )
        if name == model_name or name in (x.name for x in adapters):
            raise SpecError(f"{where}.name {name!r} is taken (by the model or an adapter)")
        if "uri" not in a:
            raise SpecError(f"{where}.uri is required: hf://org/name[@revision] or pvc://claim")
        source = parse_model_uri(name, a, where)
        adapters.append(Adapter(name, source, _optional_int(a, "rank", where, 1)))
    return tuple(adapters)


def parse_router(raw: Any) -> RouterSpec:
    r = {**ROUTER_DEFAULTS, **_mapping(raw, "spec.router")}
    known = {"replicas", "scorerWeights", "pdThresholdTokens", "prefixIndex", "resources", "queue"}
    _reject_unknown(r, known | set(POD_FIELDS), "spec.router")
    weights = {**SCORER_DEFAULTS, **_mapping(r.get("scorerWeights"), "spec.router.scorerWeights")}
    _reject_unknown(weights, set(SCORERS), "spec.router.scorerWeights")
    for key, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise SpecError(f"spec.router.scorerWeights.{key} must be a number >= 0")
    return RouterSpec(
        replicas=_int(r["replicas"], "spec.router.replicas", 0),
        scorer_weights=weights,
        pd_threshold_tokens=_int(r["pdThresholdTokens"], "spec.router.pdThresholdTokens", 0),
        prefix_index=_choice(r["prefixIndex"], "spec.router.prefixIndex", PREFIX_INDEXES),
        resources=parse_resources(r.get("resources", ROUTER_RESOURCES), "spec.router.resources"),
        pod=parse_overrides(r, "spec.router"),
        queue=parse_queue(r.get("queue")),
    )


def parse_inference_pool(raw: Any) -> InferencePoolSpec | None:
    where = "spec.inferencePool"
    p = {**INFERENCE_POOL_DEFAULTS, **_mapping(raw, where)}
    known = {"enabled", "failureMode", "replicas", "fallbackEndpoints", "resources"}
    _reject_unknown(p, known | set(POD_FIELDS), where)
    if not isinstance(p["enabled"], bool):
        raise SpecError(f"{where}.enabled must be true or false")
    if not p["enabled"]:
        return None
    return InferencePoolSpec(
        failure_mode=_choice(p["failureMode"], f"{where}.failureMode", FAILURE_MODES),
        replicas=_int(p["replicas"], f"{where}.replicas", 0),
        fallback_endpoints=_int(p["fallbackEndpoints"], f"{where}.fallbackEndpoints", 0),
        resources=parse_resources(p.get("resources", EPP_RESOURCES), f"{where}.resources"),
        pod=parse_overrides(p, where),
    )


def parse_queue(raw: Any) -> QueueBounds:
    where = "spec.router.queue"
    q = {**ROUTER_QUEUE_DEFAULTS, **_mapping(raw, where)}
    _reject_unknown(q, {"size", "timeoutSeconds", "saturationWaiting", "saturationKv"}, where)
    kv = q.get("saturationKv")
    if kv is not None and _bounded(kv, f"{where}.saturationKv", 0, 1) == 0:
        raise SpecError(f"{where}.saturationKv must be above 0, not {kv!r}")
    return QueueBounds(
        size=_int(q["size"], f"{where}.size", 0),
        timeout_s=_int(q["timeoutSeconds"], f"{where}.timeoutSeconds", 1),
        saturation_waiting=_optional_int(q, "saturationWaiting", where, 1),
        saturation_kv=float(kv) if kv is not None else None,
    )


def parse_secret_key_ref(raw: Any, where: str) -> SecretKeyRef | None:
    if raw is None:
        return None
    ref = _mapping(raw, where)
    _reject_unknown(ref, {"name", "key"}, where)
    name, key = ref.get("name"), ref.get("key")
    if not isinstance(name, str) or not re.match(DNS_SUBDOMAIN_PATTERN, name):
        raise SpecError(f"{where}.name must name a Secret (a DNS subdomain), not {name!r}")
    if not isinstance(key, str) or not re.match(SECRET_KEY_PATTERN, key):
        raise SpecError(f"{where}.key must be a Secret key ([-._a-zA-Z0-9]+), not {key!r}")
    return SecretKeyRef(name, key)


def check_host_path(model: Model, allowed: tuple[str, ...]) -> None:
    """Refuse a hostPath model source outside every allowed folder (compared by path
    components after normalising, so `/srv/models/../etc` is not under `/srv/models`)."""
    if model.source != "hostPath" or model.path is None:
        return
    path = PurePosixPath(posixpath.normpath(model.path))
    if path.is_absolute() and any(
        path.is_relative_to(posixpath.normpath(root)) for root in allowed
    ):
        return
    roots = ", ".join(allowed) if allowed else "none"
    raise HostPathNotAllowed(
        f"spec.model.path {model.path!r}: hostPath model sources must be under a folder the "
        f"operator allows (--allowed-host-paths, the chart's operator.allowedHostPaths: {roots})"
    )


STRATEGY_TYPES = ("RollingUpdate", "Recreate")


def parse_spec(raw: Any) -> Spec:
    """Parse and validate `spec` (a dict as stored by the API server, defaults applied or not)."""
    s = _mapping(raw, "spec")
    known = {
        "model",
        "image",
        "engineArgs",
        "mode",
        "pools",
        "router",
        "kvTransfer",
        "apiKeySecret",
        "capacity",
        "adapters",
        "inferencePool",
        "runner",
    }
    _reject_unknown(s, known, "spec")
    if "model" not in s:
        raise SpecError("spec.model is required")
    mode = _choice(s.get("mode", "colocated"), "spec.mode", DEPLOYMENT_MODES)
    raw_pools = _mapping(s.get("pools", {"colocated": {}}), "spec.pools")
    unknown = sorted(set(raw_pools) - set(POOL_NAMES))
    if unknown:
        raise SpecError(
            f"spec.pools: unknown pool(s) {', '.join(unknown)} (roles: colocated, prefill, decode)"
        )
    expected = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    if sorted(raw_pools) != sorted(expected):
        wanted = "the pool colocated" if mode == "colocated" else "the pools prefill and decode"
        raise SpecError(f"mode {mode} takes exactly {wanted}")
    kv = _mapping(s.get("kvTransfer"), "spec.kvTransfer")
    _reject_unknown(kv, {"connector", "rdma", "placement"}, "spec.kvTransfer")
    image = s.get("image")
    if image is not None and not isinstance(image, str):
        raise SpecError("spec.image must be an image reference")
    model = parse_model(s["model"])
    spec = Spec(
        model=model,
        image=image or None,
        mode=mode,
        pools=tuple(parse_pool(name, raw_pools[name]) for name in expected),
        engine_args=parse_engine_args(s.get("engineArgs"), "spec.engineArgs"),
        router=parse_router(s.get("router")),
        kv_connector=_choice(
            kv.get("connector", "nixl"), "spec.kvTransfer.connector", KV_CONNECTORS
        ),
        api_key_secret=parse_secret_key_ref(s.get("apiKeySecret"), "spec.apiKeySecret"),
        rdma=parse_rdma(kv.get("rdma")),
        placement=parse_placement(kv.get("placement")),
        capacity=parse_capacity(s.get("capacity")),
        adapters=parse_adapters(s.get("adapters"), model.name),
        inference_pool=parse_inference_pool(s.get("inferencePool")),
        runner=_choice(s.get("runner", "auto"), "spec.runner", RUNNERS),
    )
    if spec.runner == "pooling" and mode != "colocated":
        raise SpecError(POOLING_MODE_MESSAGE)
    if spec.rdma.enabled and (mode != "disaggregated" or spec.kv_connector != "nixl"):
        raise SpecError("spec.kvTransfer.rdma needs mode disaggregated and the nixl connector")
    if spec.placement is not None and mode != "disaggregated":
        # Only prefill and decode pods move KV between them: nothing to place together.
        raise SpecError("spec.kvTransfer.placement needs mode disaggregated")
    return spec


CAPACITY_FIELDS = {
    "modelConfig",
    "gpu",
    "gpuMemoryGB",
    "weightsFormat",
    "numParameters",
    "overheadGB",
    "admitAnyway",
}


def parse_capacity(raw: Any) -> CapacitySpec:
    where = "spec.capacity"
    c = _mapping(raw, where)
    _reject_unknown(c, CAPACITY_FIELDS, where)
    config = c.get("modelConfig")
    if config is not None and (not isinstance(config, dict) or not config):
        raise SpecError(f"{where}.modelConfig must be the checkpoint's config.json (an object)")
    gpu = c.get("gpu")
    if gpu is not None and (not isinstance(gpu, str) or gpu_key(gpu) is None):
        raise SpecError(
            f"{where}.gpu {gpu!r} is not a GPU type the operator knows: "
            f"{', '.join(GPU_MEMORY_GB)} (or give gpuMemoryGB)"
        )
    weights = c.get("weightsFormat")
    if weights is not None and str(weights).lower() not in FORMAT_BYTES:
        raise SpecError(f"{where}.weightsFormat must be one of {', '.join(FORMAT_BYTES)}")
    if not isinstance(c.get("admitAnyway", False), bool):
        raise SpecError(f"{where}.admitAnyway must be true or false")
    params = c.get("numParameters")
    memory = c.get("gpuMemoryGB")
    return CapacitySpec(
        model_config=config,
        gpu=gpu,
        gpu_memory_gb=_bounded(memory, f"{where}.gpuMemoryGB", 1, MAX_GB)
        if memory is not None
        else None,
        weights_format=weights,
        num_parameters=int(_bounded(params, f"{where}.numParameters", 1, MAX_PARAMETERS))
        if params
        else None,
        overhead_gb=_bounded(c.get("overheadGB", 0), f"{where}.overheadGB", 0, MAX_GB),
        admit_anyway=c.get("admitAnyway", False),
    )


# spec.capacity's largest figures: far above any GPU or model, low enough that the capacity
# sums stay finite (1e300 GB overflowed a float into int(inf)).
MAX_GB = 1e6
MAX_PARAMETERS = 1e15


def _bounded(value: Any, where: str, minimum: float, maximum: float) -> float:
    number = _number(value, where, minimum)
    if not number <= maximum:  # NaN included
        raise SpecError(f"{where} must be a number from {minimum:g} to {maximum:g}, not {value!r}")
    return number


def parse_rdma(raw: Any) -> Rdma:
    where = "spec.kvTransfer.rdma"
    r = _mapping(raw, where)
    _reject_unknown(r, {"enabled", "resources", "ucxTls", "networks", "hostNetwork"}, where)
    for key in ("enabled", "hostNetwork"):
        if not isinstance(r.get(key, False), bool):
            raise SpecError(f"{where}.{key} must be true or false")
    tls = r.get("ucxTls", RDMA_UCX_TLS)
    if not isinstance(tls, str) or not re.fullmatch(r"[a-z_]+(,[a-z_]+)*", tls):
        raise SpecError(f"{where}.ucxTls must be a comma-separated list of UCX transports")
    networks = r.get("networks")
    if networks is not None and not isinstance(networks, str):
        raise SpecError(f"{where}.networks must be a string (the Multus annotation's value)")
    return Rdma(
        enabled=r.get("enabled", False),
        resources=dict(_mapping(r.get("resources"), f"{where}.resources")),
        ucx_tls=tls,
        networks=networks or None,
        host_network=r.get("hostNetwork", False),
    )


def parse_placement(raw: Any) -> Placement | None:
    if raw is None:
        return None
    where = "spec.kvTransfer.placement"
    p = _mapping(raw, where)
    _reject_unknown(p, {"topologyKey", "required"}, where)
    key = p.get("topologyKey")
    if not isinstance(key, str) or not key:
        raise SpecError(f"{where}.topologyKey is required (e.g. topology.kubernetes.io/zone)")
    if not isinstance(p.get("required", False), bool):
        raise SpecError(f"{where}.required must be true or false")
    return Placement(key, p.get("required", False))


def check_gpus(pool: Pool) -> None:
    """The one rule between GPUs and parallelism: a pool that requests GPUs (a GPU pool) runs
    one rank per GPU, so each pod requests tensorParallelSize / nodes of them; a pool that
    requests none runs its ranks on CPU (gloo). The operator never adds GPUs a pool did not
    ask for: whether a pool runs on GPUs is the user's choice, made in resources."""
    gpus = pool.gpus
    if gpus and gpus * pool.nodes != pool.tensor_parallel_size:
        raise SpecError(
            f"spec.pools.{pool.name}: {gpus} {GPU_RESOURCE} per pod x {pool.nodes} node(s), "
            f"but tensorParallelSize is {pool.tensor_parallel_size}: {GPU_MESSAGE}"
        )


def check_group_name(md_name: str, pool: Pool) -> None:
    """A multi-node pool's LeaderWorkerSet name leaves room for its StatefulSets' names."""
    name = f"{md_name}-{pool.name}"
    if pool.multi_node and len(name) > GROUP_NAME_MAX:
        raise SpecError(
            f"spec.pools.{pool.name}.nodes > 1: the LeaderWorkerSet {name} would be "
            f"{len(name)} characters; its StatefulSets need it at most {GROUP_NAME_MAX} "
            "(shorten the ModelDeployment's name)"
        )


def check_name(name: str) -> None:
    """The CRD's admission rule (crd.name_rule), for objects that skipped an API server."""
    if len(name) > OBJECT_NAME_MAX or not re.match(OBJECT_NAME_PATTERN, name):
        raise SpecError(f"{name_rule()['message']}; not {name!r}")
