"""The ScaledObject (keda.sh/v1alpha1) fields pagefleet renders, as a closed JSON schema written
from KEDA's published CRD, kedacore/keda config/crd/bases/keda.sh_scaledobjects.yaml at commit
8b4f083ca8c8c2baf8477e322bd4d16ac4dfa09a (v2.20.1-117, Aug 2026): its types, minimums, required
fields and its one CEL rule (minReplicaCount <= maxReplicaCount, checked in Python), closed
(additionalProperties false) as the API server's strict field validation treats unknown fields;
and the prometheus scaler's metadata as KEDA's docs state it (keda.sh/docs/latest/scalers/
prometheus: serverAddress, query and threshold required; every metadata value a string). The CRD
itself is not available offline; kubernetes-validate knows no KEDA kinds."""

from __future__ import annotations

from typing import Any

import jsonschema
from lws_schema import validate_builtin

_INT32_MIN_0 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_STRING = {"type": "string"}


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }
    if required:
        schema["required"] = list(required)
    return schema


_SCALING_RULES = _closed(
    {
        "policies": {
            "type": "array",
            "items": _closed(
                {
                    "type": _STRING,
                    "value": {"type": "integer", "minimum": 1},
                    "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
                },
                ("periodSeconds", "type", "value"),
            ),
        },
        "selectPolicy": _STRING,
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
    }
)

# The prometheus scaler's metadata (trigger type "prometheus"): strings, the three required.
_NUMBER_STRING = {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$"}
_PROMETHEUS_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["serverAddress", "query", "threshold"],
    "properties": {
        "serverAddress": {"type": "string", "pattern": "^https?://"},
        "query": {"type": "string", "minLength": 1},
        "threshold": _NUMBER_STRING,
        "activationThreshold": _NUMBER_STRING,
        "authModes": {"enum": ["basic", "bearer", "tls", "custom"]},
        "ignoreNullValues": {"enum": ["true", "false"]},
    },
}

_TRIGGER = _closed(
    {
        "type": {"const": "prometheus"},  # the only scaler pagefleet renders
        "name": _STRING,
        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
        "metadata": _PROMETHEUS_METADATA,
        "useCachedMetrics": {"type": "boolean"},
        "authenticationRef": _closed(
            {
                "name": _STRING,
                "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
            },
            ("name",),
        ),
    },
    ("metadata", "type"),
)

SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object"},
        "spec": _closed(
            {
                "scaleTargetRef": _closed(
                    {
                        "apiVersion": _STRING,
                        "kind": _STRING,
                        "name": {"type": "string", "minLength": 1},
                        "envSourceContainerName": _STRING,
                    },
                    ("name",),
                ),
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": _INT32_MIN_0,
                "initialCooldownPeriod": _INT32_MIN_0,
                "idleReplicaCount": _INT32_MIN_0,
                "minReplicaCount": _INT32_MIN_0,
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": _closed(
                    {
                        "failureThreshold": _INT32_MIN_0,
                        "replicas": _INT32_MIN_0,
                        "behavior": {
                            "enum": [
                                "static",
                                "currentReplicas",
                                "currentReplicasIfHigher",
                                "currentReplicasIfLower",
                                "scalingModifiers",
                            ]
                        },
                    },
                    ("failureThreshold", "replicas"),
                ),
                "advanced": _closed(
                    {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": _closed(
                            {
                                "name": _STRING,
                                "behavior": _closed(
                                    {"scaleUp": _SCALING_RULES, "scaleDown": _SCALING_RULES}
                                ),
                            }
                        ),
                    }
                ),
                "triggers": {"type": "array", "minItems": 1, "items": _TRIGGER},
            },
            ("scaleTargetRef", "triggers"),
        ),
    },
}


def validate_scaled_object(obj: dict, versions: tuple[str, ...]) -> None:
    """The object against the schema above, the CRD's CEL rule (KEDA's default
    maxReplicaCount is 100), and the HPA behavior KEDA passes through as what it is, an
    autoscaling/v2 HorizontalPodAutoscaler's (kubernetes-validate, strict)."""
    jsonschema.Draft7Validator(SCALED_OBJECT_SCHEMA).validate(obj)
    spec = obj["spec"]
    maximum = spec.get("maxReplicaCount", 100)
    if "minReplicaCount" in spec:
        assert spec["minReplicaCount"] <= maximum, (
            "minReplicaCount must be less than or equal to maxReplicaCount"
        )
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
    if "behavior" in behavior:
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": obj["metadata"]["name"]},
            "spec": {
                "scaleTargetRef": spec["scaleTargetRef"],
                "maxReplicas": maximum,
                "behavior": behavior["behavior"],
            },
        }
        validate_builtin(hpa, versions)
