"""The ModelDeployment CustomResourceDefinition, built in Python; the chart's CRD file is its
rendering (`pagefleet operator crd`), and a test keeps the two equal."""

from __future__ import annotations

from typing import Any

import yaml

from pagefleet.common.names import GROUP, KIND, PLURAL, VERSION

POOL_NAMES = ("colocated", "prefill", "decode")
AUTOSCALING_MODES = ("builtin", "keda", "none")
MODEL_SOURCES = ("pvc", "image", "hostPath")
DEPLOYMENT_MODES = ("colocated", "disaggregated")
KV_CONNECTORS = ("nixl", "tcp")
SCORERS = ("prefix", "queue", "kv-usage", "inflight")
PREFIX_INDEXES = ("precise", "approximate")
# Kubernetes' names: a Secret's name is a DNS subdomain, its keys [-._a-zA-Z0-9]+.
DNS_SUBDOMAIN_PATTERN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = "^[-._a-zA-Z0-9]+$"
# The served name is also a label value, so it must be one (the router selects pods by it).
MODEL_NAME_PATTERN = "^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"

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
}
SCORER_DEFAULTS: dict[str, float] = {"prefix": 3, "queue": 2, "kv-usage": 2, "inflight": 1}
ROUTER_DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "pdThresholdTokens": 512,
    "prefixIndex": "precise",
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


def _engine_args() -> dict:
    # Values are string | int | number | bool; a structural schema cannot say "one of four
    # scalar types", so the values are preserved as given and operator/spec.py checks them.
    return {
        "type": "object",
        "description": 'vLLM flag names without "--" and their values (bools give --x/--no-x).',
        "additionalProperties": {"x-kubernetes-preserve-unknown-fields": True},
    }


def autoscaling_schema() -> dict:
    d = AUTOSCALING_DEFAULTS
    return _obj(
        {
            "mode": {"type": "string", "enum": list(AUTOSCALING_MODES), "default": d["mode"]},
            "minReplicas": _int(0, d["minReplicas"]),
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


def pool_schema() -> dict:
    return _obj(
        {
            "replicas": _int(0, 1, "replicas when autoscaling is none (start value otherwise)"),
            "resources": _obj({"requests": _quantities(), "limits": _quantities()}),
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {
                "type": "array",
                "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
            "engineArgs": _engine_args(),
            "autoscaling": autoscaling_schema(),
        }
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
            "source": {"type": "string", "enum": list(MODEL_SOURCES), "default": "pvc"},
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
                    "rule": "self.source != 'pvc' || has(self.pvc)",
                    "message": "pvc is required when source is pvc",
                },
                {
                    "rule": "self.source != 'image' || has(self.image)",
                    "message": "image is required when source is image",
                },
                {
                    "rule": "self.source != 'hostPath' || has(self.path)",
                    "message": "path is required when source is hostPath",
                },
            ]
        },
    )


def router_schema() -> dict:
    weights = {name: {"type": "number", "minimum": 0} for name in SCORERS}
    return _obj(
        {
            "replicas": _int(0, ROUTER_DEFAULTS["replicas"]),
            "scorerWeights": _obj(weights),
            "pdThresholdTokens": _int(0, ROUTER_DEFAULTS["pdThresholdTokens"]),
            "prefixIndex": {
                "type": "string",
                "enum": list(PREFIX_INDEXES),
                "default": ROUTER_DEFAULTS["prefixIndex"],
                "description": "precise: engines publish KV events (on their pod IP) and the "
                "router follows them; approximate: no events, the router remembers what it sent",
            },
        },
        default={},
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
            "pools": pools,
            "router": router_schema(),
            "kvTransfer": _obj(
                {"connector": {"type": "string", "enum": list(KV_CONNECTORS), "default": "nixl"}},
                default={},
            ),
            "apiKeySecret": secret_key_ref_schema(
                "Secret key holding the API key clients must send the router (Bearer); the "
                "engines always require a key of their own, generated in <name>-fleet-secret"
            ),
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
            "lastScaleTime": {"type": "string"},
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
    condition = _obj(
        {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string"},
        },
        ["type", "status"],
    )
    return _obj(
        {
            "observedGeneration": {"type": "integer"},
            "replicas": {"type": "integer", "description": "serving pool's replicas (scale)"},
            "selector": {"type": "string", "description": "serving pool's pods (scale)"},
            "pools": {"type": "object", "additionalProperties": pool_status},
            "ready": {"type": "string", "description": "ready/desired per pool, for kubectl"},
            "conditions": {"type": "array", "items": condition},
        },
        # kopf keeps its own bookkeeping under status; keep it rather than prune it.
        **{"x-kubernetes-preserve-unknown-fields": True},
    )


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
