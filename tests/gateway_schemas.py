"""The InferencePool, HTTPRoute and Gateway fields pagefleet renders or ships, as closed JSON
schemas written from the upstream CRDs (kubernetes-validate knows none of these kinds, and the
CRDs are not available offline):

- InferencePool (inference.networking.k8s.io/v1): kubernetes-sigs/gateway-api-inference-extension
  config/crd/bases/inference.networking.k8s.io_inferencepools.yaml at commit
  84436a96b9e6ce2b59ddacd3d04c31b4fbd442de (Aug 2026): types, patterns, bounds, enums and
  required fields; its two CEL rules (endpointPickerRef.port required for a Service, unique
  target ports) are checked in Python.
- HTTPRoute and Gateway (gateway.networking.k8s.io/v1, standard channel):
  kubernetes-sigs/gateway-api config/crd/standard/gateway.networking.k8s.io_httproutes.yaml and
  gateway.networking.k8s.io_gateways.yaml at commit 4564255ac2c35d582249b3cdf261bdf51c8bca32
  (Aug 2026): the fields an HTTPRoute to an InferencePool uses (parentRefs, hostnames, rules'
  path matches, backendRefs, timeouts) and a Gateway's listeners; the backendRef rule (a
  Service needs a port) and the path rules (Exact/PathPrefix values absolute, no '//') in
  Python.

Closed (additionalProperties false), as the API server's strict field validation treats unknown
fields. Metadata is checked with a built-in kind's rules (kubernetes-validate) by the callers."""

from __future__ import annotations

import jsonschema
from keda_schema import _closed  # closed objects, as strict field validation treats them

_DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_GROUP = {"type": "string", "maxLength": 253, "pattern": r"^$|" + _DNS1123_SUBDOMAIN}
_KIND = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_NAMESPACE = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
_HOSTNAME = {
    "type": "string",
    "minLength": 1,
    "maxLength": 253,
    "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}


def _kind(api_version: str, kind: str, spec: dict) -> dict:
    return _closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {"type": "object"},
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


INFERENCE_POOL_SCHEMA = _kind(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _closed(
        {
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": _closed(
                {
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    "group": _GROUP,
                    "kind": _KIND,
                    "name": _NAME,
                    "port": _closed({"number": _PORT}, ("number",)),
                },
                ("name",),
            ),
            "selector": _closed(
                {
                    "matchLabels": {
                        "type": "object",
                        "maxProperties": 64,
                        "additionalProperties": _LABEL_VALUE,
                    }
                },
                ("matchLabels",),
            ),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": _closed({"number": _PORT}, ("number",)),
            },
        },
        ("selector", "targetPorts"),
    ),
)

_PARENT_REF = _closed(
    {
        "group": _GROUP,
        "kind": _KIND,
        "name": _NAME,
        "namespace": _NAMESPACE,
        "port": _PORT,
        "sectionName": {
            "type": "string",
            "minLength": 1,
            "maxLength": 253,
            "pattern": _DNS1123_SUBDOMAIN,
        },
    },
    ("name",),
)
_BACKEND_REF = _closed(
    {
        "group": _GROUP,
        "kind": _KIND,
        "name": _NAME,
        "namespace": _NAMESPACE,
        "port": _PORT,
        "weight": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
    },
    ("name",),
)
_MATCH = _closed(
    {
        "path": _closed(
            {
                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                "value": {"type": "string", "maxLength": 1024},
            }
        )
    }
)
HTTP_ROUTE_SCHEMA = _kind(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _closed(
        {
            "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
            "hostnames": {"type": "array", "maxItems": 16, "items": _HOSTNAME},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": _closed(
                    {
                        "name": _NAME,
                        "matches": {"type": "array", "maxItems": 64, "items": _MATCH},
                        "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND_REF},
                        "timeouts": _closed({"request": _DURATION, "backendRequest": _DURATION}),
                    }
                ),
            },
        }
    ),
)
GATEWAY_SCHEMA = _kind(
    "gateway.networking.k8s.io/v1",
    "Gateway",
    _closed(
        {
            "gatewayClassName": {"type": "string", "minLength": 1, "maxLength": 253},
            "listeners": {
                "type": "array",
                "minItems": 1,
                "maxItems": 64,
                "items": _closed(
                    {
                        "name": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 253,
                            "pattern": _DNS1123_SUBDOMAIN,
                        },
                        "hostname": _HOSTNAME,
                        "port": _PORT,
                        "protocol": {"type": "string", "minLength": 1, "maxLength": 255},
                    },
                    ("name", "port", "protocol"),
                ),
            },
        },
        ("gatewayClassName", "listeners"),
    ),
)


def validate_inference_pool(obj: dict) -> None:
    jsonschema.Draft7Validator(INFERENCE_POOL_SCHEMA).validate(obj)
    ref = obj["spec"].get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service":
        assert "port" in ref, "port is required when kind is 'Service' or unspecified"
    numbers = [p["number"] for p in obj["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "port number must be unique"


def validate_http_route(obj: dict) -> None:
    jsonschema.Draft7Validator(HTTP_ROUTE_SCHEMA).validate(obj)
    for rule in obj["spec"].get("rules", []):
        for ref in rule.get("backendRefs", []):
            if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service":
                assert "port" in ref, "Must have port for Service reference"
        for match in rule.get("matches", []):
            path = match.get("path", {})
            if path.get("type", "PathPrefix") in ("Exact", "PathPrefix"):
                value = path.get("value", "/")
                assert value.startswith("/") and "//" not in value, f"bad path {value!r}"


def validate_gateway(obj: dict) -> None:
    jsonschema.Draft7Validator(GATEWAY_SCHEMA).validate(obj)
    names = [listener["name"] for listener in obj["spec"]["listeners"]]
    assert len(names) == len(set(names)), "Listener name must be unique within the Gateway"
