"""The LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) fields pagefleet renders, as a closed JSON
schema taken from the LWS API reference (kubernetes-sigs/lws, api/leaderworkerset/v1/
leaderworkerset_types.go: enums, minimums and defaults as its kubebuilder markers say), so a
misspelt or invented field fails; the CRD itself is not available offline. The two pod templates
are validated as what they are, core/v1 PodTemplateSpecs, by kubernetes-validate."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate

_INT_OR_STRING = {
    "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%?$"}]
}
_POD_TEMPLATE = {"type": "object"}  # checked by kubernetes-validate, below

LEADER_WORKER_SET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "partition": {"type": "integer", "minimum": 0},
                                "maxUnavailable": _INT_OR_STRING,
                                "maxSurge": _INT_OR_STRING,
                            },
                        },
                    },
                },
                "networkConfig": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["subdomainPolicy"],
                    "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
                },
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "leaderTemplate": _POD_TEMPLATE,
                        "workerTemplate": _POD_TEMPLATE,
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {
                            "enum": [
                                "RecreateGroupOnPodRestart",
                                "RecreateGroupAfterStart",
                                "None",
                                "Default",
                            ]
                        },
                        "subGroupPolicy": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                                "subGroupSize": {"type": "integer", "minimum": 1},
                            },
                        },
                    },
                },
            },
        },
    },
}


def validate_builtin(obj: dict, versions: tuple[str, ...]) -> None:
    """A built-in kind, strictly, for each Kubernetes version (kubernetes-validate)."""
    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(
                f"{obj['kind']} invalid for Kubernetes {version} at {e.json_path}: {e.message}"
            ) from None


def validate_pod_template(template: dict, versions: tuple[str, ...]) -> None:
    """A PodTemplateSpec, as the API server would take it inside a PodTemplate."""
    wrapper = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "lws-template"},
        "template": template,
    }
    validate_builtin(wrapper, versions)


def validate_leader_worker_set(obj: dict, versions: tuple[str, ...]) -> None:
    """The object against the schema above, its pod templates as PodTemplateSpecs, and the
    rule the LWS webhook adds (maxUnavailable and maxSurge not both 0: a rollout that could
    never start)."""
    jsonschema.Draft7Validator(LEADER_WORKER_SET_SCHEMA).validate(obj)
    template = obj["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        if key in template:
            validate_pod_template(template[key], versions)
    rolling = obj["spec"].get("rolloutStrategy", {}).get("rollingUpdateConfiguration", {})
    if rolling:
        assert (rolling.get("maxUnavailable", 1), rolling.get("maxSurge", 0)) != (0, 0), (
            "maxUnavailable and maxSurge are both 0"
        )
