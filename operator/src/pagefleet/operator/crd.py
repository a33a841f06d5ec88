"""The ModelDeployment CustomResourceDefinition, built in Python; the chart's CRD file is its
rendering (`pagefleet operator crd`), and a test keeps the two equal."""

from __future__ import annotations

from typing import Any

import yaml

from pagefleet.common.names import GROUP, KIND, LORA_NAME_PATTERN, PLURAL, VERSION

POOL_NAMES = ("colocated", "prefill", "decode")
AUTOSCALING_MODES = ("builtin", "keda", "none")
MODEL_SOURCES = ("pvc", "image", "hostPath")
# model.uri schemes: hf://org/name[@revision] (downloaded by an init container), pvc://claim[/path].
MODEL_URI_PATTERN = "^(hf://[A-Za-z0-9][-._A-Za-z0-9]*/[-._A-Za-z0-9]+(@[-._/A-Za-z0-9]+)?|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?)$"
DEPLOYMENT_MODES = ("colocated", "disaggregated")
# The engines' model runner (vLLM's --runner): pooling serves embeddings, auto lets each engine
# pick from the checkpoint. A pooling model has no decode phase to disaggregate.
RUNNERS = ("auto", "generate", "pooling")
POOLING_MODE_MESSAGE = "runner pooling takes mode colocated (embeddings have no decode phase)"
KV_CONNECTORS = ("nixl", "tcp")
SCORERS = ("prefix", "queue", "kv-usage", "inflight", "lora-affinity")
# LoRA adapters one ModelDeployment lists at most (each is an init container or a volume).
MAX_ADAPTERS = 32
# The router's LoRA affinity weight when spec.adapters is set and scorerWeights names none.
LORA_AFFINITY_DEFAULT = 2
PREFIX_INDEXES = ("precise", "approximate")
# Kubernetes' names: a Secret's name is a DNS subdomain, its keys [-._a-zA-Z0-9]+.
DNS_SUBDOMAIN_PATTERN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = "^[-._a-zA-Z0-9]+$"
# The served name is also a label value, so it must be one (the router selects pods by it).
MODEL_NAME_PATTERN = "^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
# A ModelDeployment's name prefixes its objects' names: Services are DNS-1035 labels (63
# characters, no dots), and "-colocated" is the longest suffix.
OBJECT_NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
OBJECT_NAME_MAX = 63 - len("-colocated")
# Reserved to the operator: what it sets on every pod (overrides may not replace them).
RESERVED_LABEL_PREFIXES = ("pagefleet.io/", "app.kubernetes.io/")
RESOURCE_KINDS = ("TriggerAuthentication", "ClusterTriggerAuthentication")
# UCX transports for NIXL over RDMA: verbs (rc), then GPU copies; tcp as a last resort.
RDMA_UCX_TLS = "rc,sm,self,cuda_copy,cuda_ipc,tcp"
GPU_RESOURCE = "nvidia.com/gpu"
# Engine flags a pool's fields decide (one place for each decision): refused in engineArgs, by
# the CRD's CEL rules and by operator/spec.py, with these messages.
RESERVED_ENGINE_ARGS = {
    "tensor-parallel-size": "engineArgs.tensor-parallel-size: set the pool's tensorParallelSize "
    "instead (the operator sets the flag and checks the pod's GPUs against it)",
    "distributed-executor-backend": "engineArgs.distributed-executor-backend is the operator's: "
    "mp for the ranks of one pod, ray when a pool spans nodes",
    "pipeline-parallel-size": "engineArgs.pipeline-parallel-size: pipeline parallelism is not "
    "offered (the engine builds tensor parallelism only)",
    "lora-modules": "engineArgs.lora-modules: list the adapters in spec.adapters instead (the "
    "operator puts them in the pods and sets the flag)",
    "runner": "engineArgs.runner: set spec.runner instead (the operator checks the pools "
    "against it)",
}
# The pool rules on parallelism (CEL here, the same words in operator/spec.py).
TP_NODES_MESSAGE = (
    "tensorParallelSize must be a multiple of nodes "
    "(each pod runs tensorParallelSize / nodes ranks)"
)
GPU_MESSAGE = (
    f"{GPU_RESOURCE} per pod must equal tensorParallelSize / nodes (one GPU per rank: a GPU no "
    "rank uses is wasted, a rank without one cannot run)"
)
GROUP_STRATEGY_MESSAGE = (
    "a pool with nodes > 1 is a LeaderWorkerSet, which rolls one group at a time: "
    "strategy.type must be RollingUpdate"
)

# One place for the defaults: the schema carries them (the API server applies them) and
# operator/spec.py reads them from here for specs that never went through an API server.
AUTOSCALING_DEFAULTS: dict[str, Any] = {
    "mode": "none",
    "minReplicas": 1,
    "maxReplicas": 4,
    "targetWaitingPerReplica": 4,
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 300,
    "maxScaleUpStep": 4,
    "scaleToZeroIdleSeconds": 300,
}
SCORER_DEFAULTS: dict[str, float] = {"prefix": 3, "queue": 2, "kv-usage": 2, "inflight": 1}
ROUTER_DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "pdThresholdTokens": 512,
    "prefixIndex": "precise",
}
# The router's queue (spec.router.queue): requests it holds while no engine of the model is
# ready or all are saturated (the router's --queue-size and --queue-timeout defaults).
ROUTER_QUEUE_DEFAULTS: dict[str, Any] = {"size": 256, "timeoutSeconds": 120}
# spec.inferencePool: the Gateway API Inference Extension's InferencePool over the serving
# pods, with `pagefleet epp` as its Endpoint Picker (a Gateway routes to it beside, or instead
# of, the router).
FAILURE_MODES = ("FailClose", "FailOpen")
INFERENCE_POOL_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "failureMode": "FailClose",
    "replicas": 1,
    "fallbackEndpoints": 0,
}
EPP_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}
# The router's requests and limits unless spec.router.resources says otherwise (a router
# without any would be BestEffort: the first pod evicted under node pressure).
ROUTER_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = required
    return schema


def _int(minimum: int = 0, default: int | None = None, description: str = "") -> dict:
    schema: dict[str, Any] = {"type": "integer", "minimum": minimum}
    if default is not None:
        schema["default"] = default
    if description:
        schema["description"] = description
    return schema


def _quantities() -> dict:
    # Kubernetes quantities are int-or-string ("1", 1, "16Gi").
    return {
        "type": "object",
        "additionalProperties": {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
        },
    }


def _string_map() -> dict:
    return {"type": "object", "additionalProperties": {"type": "string"}}


def _int_or_string() -> dict:
    return {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}


def _objects(required: list[str] | None = None, description: str = "") -> dict:
    """A list of Kubernetes objects (EnvVar, Volume...) kept as given: the API server checks
    them when the operator creates the Deployment; operator/pod_overrides.py checks names."""
    item: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if required:
        item["required"] = required
        item["properties"] = {key: {"type": "string", "minLength": 1} for key in required}
    schema: dict[str, Any] = {"type": "array", "items": item}
    if description:
        schema["description"] = description
    return schema


def pod_overrides_schema() -> dict[str, dict]:
    """Typed pod fields a pool (and the router) may set; the operator keeps what it must own
    (command, probes, security context, the fleet secret, its labels)."""
    return {
        "env": _objects(["name"], "extra EnvVars of the main container"),
        "envFrom": _objects(description="EnvFromSources of the main container"),
        "volumes": _objects(["name"], "extra Volumes of the pod"),
        "volumeMounts": _objects(["name", "mountPath"], "mounts of those volumes"),
        "affinity": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "topologySpreadConstraints": _objects(["topologyKey"]),
        "podAnnotations": _string_map(),
        "podLabels": _string_map(),
        "imagePullSecrets": _objects(["name"]),
        "priorityClassName": {"type": "string"},
        "runtimeClassName": {"type": "string"},
        "terminationGracePeriodSeconds": _int(0),
    }


def _engine_args() -> dict:
    # Values are string | int | number | bool; a structural schema cannot say "one of four
    # scalar types", so the values are preserved as given and operator/spec.py checks them.
    return {
        "type": "object",
        "description": 'vLLM flag names without "--" and their values (bools give --x/--no-x).',
        "additionalProperties": {"x-kubernetes-preserve-unknown-fields": True},
        "x-kubernetes-validations": [
            {"rule": f"!('{flag}' in self)", "message": message}
            for flag, message in RESERVED_ENGINE_ARGS.items()
        ],
    }


def _gpu_rule(kind: str) -> str:
    """CEL: the pod's GPUs (when it names any) are the ranks it runs."""
    gpus = f"self.resources.{kind}['{GPU_RESOURCE}']"
    return (
        f"!has(self.resources) || !has(self.resources.{kind}) || "
        f"!('{GPU_RESOURCE}' in self.resources.{kind}) || int({gpus}) == 0 || "
        f"int({gpus}) * self.nodes == self.tensorParallelSize"
    )


def pool_rules() -> list[dict]:
    return [
        {"rule": "self.tensorParallelSize % self.nodes == 0", "message": TP_NODES_MESSAGE},
        {"rule": _gpu_rule("limits"), "message": GPU_MESSAGE},
        {"rule": _gpu_rule("requests"), "message": GPU_MESSAGE},
        {
            "rule": "self.nodes == 1 || !has(self.strategy) || !has(self.strategy.type) || "
            "self.strategy.type == 'RollingUpdate'",
            "message": GROUP_STRATEGY_MESSAGE,
        },
    ]


def autoscaling_schema() -> dict:
    d = AUTOSCALING_DEFAULTS
    return _obj(
        {
            "mode": {"type": "string", "enum": list(AUTOSCALING_MODES), "default": d["mode"]},
            "minReplicas": _int(
                0,
                d["minReplicas"],
                "0 lets an idle pool scale to zero (builtin and keda modes): the router holds "
                "requests (spec.router.queue) and wakes it, and the first request after idle "
                "pays a cold start: pod scheduling, image pull and model load (minutes for "
                "large models; set router.queue.timeoutSeconds above it)",
            ),
            "maxReplicas": _int(1, d["maxReplicas"]),
            "targetWaitingPerReplica": {
                "type": "number",
                "exclusiveMinimum": True,
                "minimum": 0,
                "default": d["targetWaitingPerReplica"],
                "description": "vllm:num_requests_waiting per replica the autoscaler aims at.",
            },
            "scaleUpStabilizationSeconds": _int(0, d["scaleUpStabilizationSeconds"]),
            "scaleDownStabilizationSeconds": _int(0, d["scaleDownStabilizationSeconds"]),
            "maxScaleUpStep": _int(1, d["maxScaleUpStep"], "most replicas added per decision"),
            "scaleToZeroIdleSeconds": _int(
                0,
                d["scaleToZeroIdleSeconds"],
                "minReplicas 0 only: seconds with nothing running, waiting or queued at the "
                "router before the pool goes to 0 (the builtin autoscaler; KEDA's "
                "cooldownPeriod unless keda.cooldownPeriod is set). Never while a request is "
                "in flight",
            ),
            "keda": keda_schema(),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "self.minReplicas <= self.maxReplicas",
                    "message": "minReplicas must not exceed maxReplicas",
                }
            ]
        },
    )


def keda_schema() -> dict:
    """KEDA ScaledObject settings (autoscaling.mode keda only)."""
    return _obj(
        {
            "pollingInterval": _int(1, description="seconds between KEDA's queries (30)"),
            "cooldownPeriod": _int(
                0,
                description="seconds after the last active trigger before scaling to "
                "minReplicas 0 (default: scaleToZeroIdleSeconds)",
            ),
            "activationThreshold": {
                "type": "number",
                "minimum": 0,
                "description": "waiting (engines) or queued (router) requests above which "
                "a pool at 0 replicas activates (default 0: the first queued request)",
            },
            "fallback": _obj(
                {"failureThreshold": _int(1), "replicas": _int(0)},
                ["failureThreshold", "replicas"],
                description="replicas to hold while Prometheus cannot be read",
            ),
            "authenticationRef": _obj(
                {
                    "name": {"type": "string", "minLength": 1},
                    "kind": {"type": "string", "enum": list(RESOURCE_KINDS)},
                },
                ["name"],
                description="a KEDA TriggerAuthentication for a secured Prometheus",
            ),
            "authModes": {
                "type": "string",
                "enum": ["basic", "bearer", "tls", "custom"],
                "description": "the Prometheus trigger's authModes",
            },
        }
    )


def _resources() -> dict:
    return _obj({"requests": _quantities(), "limits": _quantities()})


def pool_schema() -> dict:
    return _obj(
        {
            "replicas": _int(
                0,
                1,
                "replicas when autoscaling is none (applied when it changes: between "
                "changes, kubectl scale deployment <name>-<pool> and an HPA may scale the pool)",
            ),
            "image": {
                "type": "string",
                "description": "this pool's engine image (default: spec.image, else the "
                "operator's CUDA image when the pool requests nvidia.com/gpu, its CPU image "
                "otherwise; pinned in status at creation)",
            },
            "resources": _resources(),
            "nodeSelector": _string_map(),
            "tolerations": {
                "type": "array",
                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
            "engineArgs": _engine_args(),
            "tensorParallelSize": _int(
                1,
                1,
                "tensor-parallel ranks of one engine (--tensor-parallel-size): on a GPU pool "
                f"each pod requests {GPU_RESOURCE} = tensorParallelSize / nodes; a pool that "
                "requests no GPU runs its ranks on CPU (gloo)",
            ),
            "nodes": _int(
                1,
                1,
                "pods per engine: above 1 the pool is a LeaderWorkerSet of groups of this size "
                "(a Ray head and pagefleet serve in the leader, Ray workers in the others); "
                "needs the LeaderWorkerSet controller",
            ),
            "autoscaling": autoscaling_schema(),
            **pod_overrides_schema(),
            "serviceAccountName": {"type": "string", "pattern": DNS_SUBDOMAIN_PATTERN},
            "shmSize": {
                "type": "string",
                "pattern": "^[0-9]+(Ki|Mi|Gi|Ti)?$",
                "description": "size of /dev/shm (default 2Gi per GPU of the pod, at least 2Gi, "
                "and 1Gi more for Ray's object store when nodes > 1)",
            },
            "strategy": _obj(
                {
                    "type": {"type": "string", "enum": ["RollingUpdate", "Recreate"]},
                    "rollingUpdate": _obj(
                        {"maxSurge": _int_or_string(), "maxUnavailable": _int_or_string()}
                    ),
                },
                description="the Deployment's rollout (GPU pools default to maxSurge 0, "
                "maxUnavailable 1: no spare GPU is needed to roll)",
            ),
            "disruptionBudget": _obj(
                {"maxUnavailable": _int_or_string()},
                description="the pool's PodDisruptionBudget (maxUnavailable 1)",
            ),
        },
        **{"x-kubernetes-validations": pool_rules()},
    )


def model_schema() -> dict:
    return _obj(
        {
            "name": {
                "type": "string",
                "pattern": MODEL_NAME_PATTERN,
                "maxLength": 63,
                "description": "served model name; also the pods' pagefleet.io/model label",
            },
            "uri": {
                "type": "string",
                "pattern": MODEL_URI_PATTERN,
                "description": "hf://org/name[@revision] (an init container downloads it into "
                "cache, or the pod's own volume) or pvc://claim[/path]; instead of source",
            },
            "hf": _obj(
                {
                    "tokenSecret": secret_key_ref_schema("Secret key holding an HF token"),
                    "endpoint": {
                        "type": "string",
                        "pattern": "^https?://[^\\s]+$",
                        "description": "HF_ENDPOINT (a mirror); default huggingface.co",
                    },
                }
            ),
            "cache": _obj(
                {"claimName": {"type": "string", "minLength": 1}},
                ["claimName"],
                description="hf:// only: a ReadWriteMany claim the download is kept in, shared "
                "by replicas (one downloads, the others wait); default: each pod's own emptyDir",
            ),
            "source": {"type": "string", "enum": list(MODEL_SOURCES)},
            "pvc": _obj(
                {"claimName": {"type": "string", "minLength": 1}, "path": {"type": "string"}},
                ["claimName"],
            ),
            "image": {"type": "string", "minLength": 1, "description": "image holding /model"},
            "path": {"type": "string", "description": "hostPath, or the path in the image"},
        },
        ["name"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.uri) || !(has(self.source) || has(self.pvc) || "
                    "has(self.image) || has(self.path))",
                    "message": "uri replaces source, pvc, image and path: give one or the other",
                },
                {
                    "rule": "has(self.uri) || (has(self.source) && self.source != 'pvc') "
                    "|| has(self.pvc)",
                    "message": "pvc is required when source is pvc",
                },
                {
                    "rule": "!has(self.source) || self.source != 'image' || has(self.image)",
                    "message": "image is required when source is image",
                },
                {
                    "rule": "!has(self.source) || self.source != 'hostPath' || has(self.path)",
                    "message": "path is required when source is hostPath",
                },
                {
                    "rule": "(!has(self.hf) && !has(self.cache)) || "
                    "(has(self.uri) && self.uri.startsWith('hf://'))",
                    "message": "hf and cache go with an hf:// uri",
                },
            ]
        },
    )


def adapters_schema() -> dict:
    item = _obj(
        {
            "name": {
                "type": "string",
                "pattern": f"^{LORA_NAME_PATTERN}$",
                "description": "the adapter's name: a request's model selects it",
            },
            "uri": {
                "type": "string",
                "pattern": MODEL_URI_PATTERN,
                "description": "hf://org/name[@revision] (downloaded into each engine pod, like "
                "an hf:// model) or pvc://claim[/path] (a PEFT folder: adapter_config.json and "
                "adapter_model.safetensors)",
            },
            "hf": model_schema()["properties"]["hf"],
            "rank": _int(
                1,
                description="the adapter's rank, for a pvc:// adapter's admission check "
                "(an hf:// adapter's is read from its adapter_config.json)",
            ),
        },
        ["name", "uri"],
    )
    return {
        "type": "array",
        "maxItems": MAX_ADAPTERS,
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
        "description": "LoRA adapters every engine loads at start (--enable-lora "
        "--lora-modules); one whose rank is above a pool's engineArgs max-lora-rank (16) is "
        "refused at admission",
    }


def router_schema() -> dict:
    weights = {name: {"type": "number", "minimum": 0} for name in SCORERS}
    return _obj(
        {
            "replicas": _int(0, ROUTER_DEFAULTS["replicas"]),
            "resources": _resources(),
            **pod_overrides_schema(),
            "scorerWeights": _obj(weights),
            "pdThresholdTokens": _int(0, ROUTER_DEFAULTS["pdThresholdTokens"]),
            "prefixIndex": {
                "type": "string",
                "enum": list(PREFIX_INDEXES),
                "default": ROUTER_DEFAULTS["prefixIndex"],
                "description": "precise: engines publish KV events (on their pod IP) and the "
                "router follows them; approximate: no events, the router remembers what it sent",
            },
            "queue": router_queue_schema(),
        },
        default={},
    )


def inference_pool_schema() -> dict:
    d = INFERENCE_POOL_DEFAULTS
    return _obj(
        {
            "enabled": {
                "type": "boolean",
                "default": d["enabled"],
                "description": "render an InferencePool (inference.networking.k8s.io/v1) over "
                "the serving pods and its Endpoint Picker (`pagefleet epp`: the router's "
                "picking, for a Gateway's proxy); the router stays unless its replicas are 0",
            },
            "failureMode": {
                "type": "string",
                "enum": list(FAILURE_MODES),
                "default": d["failureMode"],
                "description": "what the Gateway does when the picker cannot be reached: "
                "FailOpen sends the request on by its own balancing, FailClose answers an error",
            },
            "replicas": _int(0, d["replicas"], "Endpoint Picker replicas"),
            "fallbackEndpoints": _int(
                0,
                d["fallbackEndpoints"],
                "endpoints named after the pick for a Gateway that retries down the list "
                "(override_host); 0 for one that routes on a single ip:port (ORIGINAL_DST)",
            ),
            "resources": _resources(),
            **pod_overrides_schema(),
        },
        default={},
    )


def router_queue_schema() -> dict:
    d = ROUTER_QUEUE_DEFAULTS
    return _obj(
        {
            "size": _int(
                0,
                d["size"],
                "requests the router holds per model while no engine is ready or all are "
                "saturated (a pool waking from 0 replicas); beyond it a 503 with Retry-After. "
                "0: never hold (503 at once)",
            ),
            "timeoutSeconds": _int(
                1,
                d["timeoutSeconds"],
                "longest a request is held before a 503 with Retry-After: cover the pool's "
                "cold start (pod start + model load) if it scales to 0",
            ),
            "saturationWaiting": _int(
                1,
                description="an engine with this many waiting requests counts as saturated "
                "(unset: never by its queue)",
            ),
            "saturationKv": {
                "type": "number",
                "exclusiveMinimum": True,
                "minimum": 0,
                "maximum": 1,
                "description": "an engine whose KV cache is this full (0-1] counts as saturated "
                "(unset: never by its KV cache)",
            },
        },
        default={},
        description="the router's flow control: what it holds, for how long, and when engines "
        "count as full",
    )


def rdma_schema() -> dict:
    return _obj(
        {
            "enabled": {"type": "boolean", "default": False},
            "resources": {
                **_quantities(),
                "description": 'RDMA device resources per prefill/decode pod, e.g. {"rdma/ib": 1}',
            },
            "ucxTls": {
                "type": "string",
                "default": RDMA_UCX_TLS,
                "description": "UCX_TLS for NIXL (UCX) on prefill and decode pods",
            },
            "networks": {
                "type": "string",
                "description": "k8s.v1.cni.cncf.io/networks annotation (Multus): the RDMA "
                "network(s) to attach",
            },
            "hostNetwork": {"type": "boolean", "default": False},
        },
        description="RDMA for NIXL between prefill and decode pods: IPC_LOCK, RDMA devices, "
        "UCX transports, the RDMA network",
    )


def secret_key_ref_schema(description: str) -> dict:
    return _obj(
        {
            "name": {"type": "string", "pattern": DNS_SUBDOMAIN_PATTERN, "maxLength": 253},
            "key": {"type": "string", "pattern": SECRET_KEY_PATTERN, "maxLength": 253},
        },
        ["name", "key"],
        description=description,
    )


def capacity_schema() -> dict:
    """spec.capacity: what the admission check (operator/admission.py) cannot read from the
    cluster; every field optional."""
    number = {"type": "number", "minimum": 0}
    return _obj(
        {
            "modelConfig": {
                "type": "object",
                "description": "the checkpoint's config.json (layers, KV heads, head dim...); "
                "hf:// models: fetched from the model's endpoint when not given",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "gpu": {
                "type": "string",
                "maxLength": 63,
                "description": "GPU type: L4, A10G, A100-40GB, A100-80GB, H100-80GB, H200, B200 "
                "(default: the pool's nodeSelector nvidia.com/gpu.product)",
            },
            "gpuMemoryGB": {**number, "description": "memory per GPU in GB (instead of gpu)"},
            "weightsFormat": {
                "type": "string",
                "maxLength": 32,
                "description": "bf16, fp8, int4 (default: the engine's dtype)",
            },
            "numParameters": {**number, "description": "parameters (estimated from the config)"},
            "overheadGB": {**number, "description": "activations, CUDA graphs, runtime (0)"},
            "admitAnyway": {
                "type": "boolean",
                "description": "deploy even when the KV pool cannot hold one request of "
                "max-model-len, or no max-model-len is set",
            },
        },
        description="Admission: before any pod starts, a GPU pool whose KV cache cannot hold one "
        "request of its max-model-len (or that sets none) is refused, with the numbers",
    )


def spec_schema() -> dict:
    pools = _obj({name: pool_schema() for name in POOL_NAMES}, default={"colocated": {}})
    colocated_ok = (
        "has(self.pools.colocated) && !has(self.pools.prefill) && !has(self.pools.decode)"
    )
    disagg_ok = "has(self.pools.prefill) && has(self.pools.decode) && !has(self.pools.colocated)"
    return _obj(
        {
            "model": model_schema(),
            "image": {"type": "string", "description": "engine/router image (operator default)"},
            "engineArgs": _engine_args(),
            "mode": {"type": "string", "enum": list(DEPLOYMENT_MODES), "default": "colocated"},
            "runner": {
                "type": "string",
                "enum": list(RUNNERS),
                "default": "auto",
                "description": "the engines' model runner (--runner): pooling serves an "
                "embedding model on /v1/embeddings and /pooling; auto lets each engine pick "
                "from the checkpoint (pooling for a sentence-transformers or *Model one)",
            },
            "pools": pools,
            "router": router_schema(),
            "inferencePool": inference_pool_schema(),
            "kvTransfer": _obj(
                {
                    "connector": {
                        "type": "string",
                        "enum": list(KV_CONNECTORS),
                        "default": "nixl",
                    },
                    "rdma": rdma_schema(),
                    "placement": _obj(
                        {
                            "topologyKey": {"type": "string", "minLength": 1},
                            "required": {"type": "boolean", "default": False},
                        },
                        ["topologyKey"],
                        description="keep every engine of this ModelDeployment in one "
                        "topology domain (e.g. topology.kubernetes.io/zone or a rack label), "
                        "preferred or required",
                    ),
                },
                default={},
            ),
            "apiKeySecret": secret_key_ref_schema(
                "Secret key holding the API key clients must send the router (Bearer); the "
                "engines always require a key of their own, generated in <name>-fleet-secret"
            ),
            "capacity": capacity_schema(),
            "adapters": adapters_schema(),
        },
        ["model"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": f"self.mode != 'colocated' || ({colocated_ok})",
                    "message": "mode colocated takes exactly the pool colocated",
                },
                {
                    "rule": f"self.mode != 'disaggregated' || ({disagg_ok})",
                    "message": "mode disaggregated takes exactly the pools prefill and decode",
                },
                {
                    "rule": "!has(self.runner) || self.runner != 'pooling' || "
                    "self.mode == 'colocated'",
                    "message": POOLING_MODE_MESSAGE,
                },
            ]
        },
    )


def status_schema() -> dict:
    pool_status = _obj(
        {
            "replicas": {"type": "integer"},
            "readyReplicas": {"type": "integer"},
            "desiredReplicas": {"type": "integer"},
            "reason": {"type": "string"},
            "specReplicas": {
                "type": "integer",
                "description": "spec replicas last applied (a change applies again)",
            },
            "workload": {
                "type": "string",
                "enum": ["Deployment", "LeaderWorkerSet"],
                "description": "the kind that runs the pool (LeaderWorkerSet when nodes > 1)",
            },
            "lastScaleTime": {"type": "string", "format": "date-time"},
            "recommendations": {
                "type": "array",
                "description": "builtin autoscaler: the recommendations its windows still need",
                "items": _obj(
                    {
                        "time": {"type": "string", "format": "date-time"},
                        "replicas": {"type": "integer"},
                    },
                    ["time", "replicas"],
                ),
            },
        }
    )
    # metav1.Condition's shape.
    condition = _obj(
        {
            "type": {"type": "string", "maxLength": 316},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "observedGeneration": {"type": "integer", "minimum": 0},
            "reason": {"type": "string", "maxLength": 1024},
            "message": {"type": "string", "maxLength": 32768},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
        },
        ["type", "status", "lastTransitionTime", "reason", "message"],
    )
    return _obj(
        {
            "observedGeneration": {"type": "integer"},
            "replicas": {"type": "integer", "description": "serving pool's replicas (scale)"},
            "selector": {"type": "string", "description": "serving pool's pods (scale)"},
            "pools": {"type": "object", "additionalProperties": pool_status},
            "ready": {"type": "string", "description": "ready/desired per pool, for kubectl"},
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "images": _obj(
                {"cpu": {"type": "string"}, "cuda": {"type": "string"}},
                description="the operator's engine images when this ModelDeployment was "
                "created: kept across operator upgrades (set null to take the current ones)",
            ),
        },
        # kopf keeps its own bookkeeping under status; keep it rather than prune it.
        **{"x-kubernetes-preserve-unknown-fields": True},
    )


def name_rule() -> dict:
    """Names that cannot make the objects the operator derives fail at admission, not later."""
    return {
        "rule": f"size(self.metadata.name) <= {OBJECT_NAME_MAX} && "
        f"self.metadata.name.matches('{OBJECT_NAME_PATTERN}')",
        "message": f"metadata.name must be a DNS-1035 label of at most {OBJECT_NAME_MAX} "
        "characters (lower-case letters, digits, '-'; starting with a letter): it prefixes "
        "the Services and Deployments the operator creates",
    }


def printer_columns() -> list[dict]:
    return [
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
        {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": ".status.ready",
            "description": "ready/desired replicas per pool",
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> dict:
    """The CRD object. `kubectl scale` works through the scale subresource on the colocated
    pool (the one pool that single number can mean); disaggregated pools are scaled in spec."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["md"],
                "categories": ["pagefleet"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": _obj(
                            {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                            ["spec"],
                            **{"x-kubernetes-validations": [name_rule()]},
                        )
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.pools.colocated.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }


def render_crd() -> str:
    """The CRD as the YAML document the chart ships."""
    header = "# Generated by `pagefleet operator crd` from operator/crd.py: do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)
