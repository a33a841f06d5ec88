"""A ModelDeployment's spec as dataclasses: defaults applied and every rule of the CRD's schema
(CEL rules included) checked, so handlers and tests get one answer on what is valid."""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from pagefleet.common import __version__
from pagefleet.common.serve_command import JSON_ENGINE_ARGS, EngineArg
from pagefleet.operator.crd import (
    AUTOSCALING_DEFAULTS,
    AUTOSCALING_MODES,
    DEPLOYMENT_MODES,
    DNS_SUBDOMAIN_PATTERN,
    KV_CONNECTORS,
    MODEL_NAME_PATTERN,
    MODEL_SOURCES,
    POOL_NAMES,
    PREFIX_INDEXES,
    ROUTER_DEFAULTS,
    SCORER_DEFAULTS,
    SECRET_KEY_PATTERN,
)

DEFAULT_IMAGE = f"ghcr.io/pagefleet/pagefleet:{__version__}"
# The router runs from its own image (deploy/docker/Dockerfile.slim): no torch, a tenth the size.
DEFAULT_ROUTER_IMAGE = f"ghcr.io/pagefleet/pagefleet-router:{__version__}"
ROLE_OF_POOL = {"colocated": "both", "prefill": "prefill", "decode": "decode"}


class SpecError(ValueError):
    """The spec cannot work; the message says which field and why."""

    reason = "InvalidSpec"  # the Degraded condition's reason


class HostPathNotAllowed(SpecError):
    """A hostPath model source outside the folders the operator was started to allow."""

    reason = "HostPathNotAllowed"


@dataclass(frozen=True)
class Autoscaling:
    mode: str = AUTOSCALING_DEFAULTS["mode"]
    min_replicas: int = AUTOSCALING_DEFAULTS["minReplicas"]
    max_replicas: int = AUTOSCALING_DEFAULTS["maxReplicas"]
    target_waiting_per_replica: float = AUTOSCALING_DEFAULTS["targetWaitingPerReplica"]
    scale_up_stabilization_s: float = AUTOSCALING_DEFAULTS["scaleUpStabilizationSeconds"]
    scale_down_stabilization_s: float = AUTOSCALING_DEFAULTS["scaleDownStabilizationSeconds"]
    max_scale_up_step: int = AUTOSCALING_DEFAULTS["maxScaleUpStep"]


@dataclass(frozen=True)
class Pool:
    name: str  # colocated | prefill | decode
    replicas: int = 1
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    engine_args: dict[str, EngineArg] = field(default_factory=dict)
    autoscaling: Autoscaling = field(default_factory=Autoscaling)

    @property
    def role(self) -> str:
        return ROLE_OF_POOL[self.name]


@dataclass(frozen=True)
class Model:
    name: str
    source: str = "pvc"
    claim_name: str | None = None
    path: str | None = None  # inside the PVC, the image, or on the host
    image: str | None = None


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = ROUTER_DEFAULTS["replicas"]
    scorer_weights: dict[str, float] = field(default_factory=lambda: dict(SCORER_DEFAULTS))
    pd_threshold_tokens: int = ROUTER_DEFAULTS["pdThresholdTokens"]
    prefix_index: str = ROUTER_DEFAULTS["prefixIndex"]  # precise: follow the engines' KV events

    @property
    def precise(self) -> bool:
        return self.prefix_index == "precise"


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the ModelDeployment's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class Spec:
    model: Model
    image: str
    mode: str
    pools: tuple[Pool, ...]
    engine_args: dict[str, EngineArg]
    router: RouterSpec
    kv_connector: str
    api_key_secret: SecretKeyRef | None = None  # the key clients must send the router

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


def parse_autoscaling(raw: Any, where: str) -> Autoscaling:
    a = {**AUTOSCALING_DEFAULTS, **_mapping(raw, where)}
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
    )
    if parsed.min_replicas > parsed.max_replicas:
        raise SpecError(f"{where}: minReplicas must not exceed maxReplicas")
    return parsed


def parse_pool(name: str, raw: Any) -> Pool:
    where = f"spec.pools.{name}"
    p = _mapping(raw, where)
    known = {"replicas", "resources", "nodeSelector", "tolerations", "engineArgs", "autoscaling"}
    _reject_unknown(p, known, where)
    resources = _mapping(p.get("resources"), f"{where}.resources")
    _reject_unknown(resources, {"requests", "limits"}, f"{where}.resources")
    tolerations = p.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
        raise SpecError(f"{where}.tolerations must be a list of objects")
    node_selector = _mapping(p.get("nodeSelector"), f"{where}.nodeSelector")
    if not all(isinstance(v, str) for v in node_selector.values()):
        raise SpecError(f"{where}.nodeSelector values must be strings")
    return Pool(
        name=name,
        replicas=_int(p.get("replicas", 1), f"{where}.replicas", 0),
        resources={k: dict(_mapping(v, f"{where}.resources.{k}")) for k, v in resources.items()},
        node_selector=dict(node_selector),
        tolerations=[dict(t) for t in tolerations],
        engine_args=parse_engine_args(p.get("engineArgs"), f"{where}.engineArgs"),
        autoscaling=parse_autoscaling(p.get("autoscaling"), f"{where}.autoscaling"),
    )


def parse_model(raw: Any) -> Model:
    m = _mapping(raw, "spec.model")
    _reject_unknown(m, {"name", "source", "pvc", "image", "path"}, "spec.model")
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("spec.model.name is required")
    if len(name) > 63 or not re.match(MODEL_NAME_PATTERN, name):
        raise SpecError(
            f"spec.model.name {name!r} must be a label value (63 characters of A-Z a-z 0-9 . _ -)"
        )
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


def parse_router(raw: Any) -> RouterSpec:
    r = {**ROUTER_DEFAULTS, **_mapping(raw, "spec.router")}
    _reject_unknown(
        r, {"replicas", "scorerWeights", "pdThresholdTokens", "prefixIndex"}, "spec.router"
    )
    weights = {**SCORER_DEFAULTS, **_mapping(r.get("scorerWeights"), "spec.router.scorerWeights")}
    _reject_unknown(weights, set(SCORER_DEFAULTS), "spec.router.scorerWeights")
    for key, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise SpecError(f"spec.router.scorerWeights.{key} must be a number >= 0")
    return RouterSpec(
        replicas=_int(r["replicas"], "spec.router.replicas", 0),
        scorer_weights=weights,
        pd_threshold_tokens=_int(r["pdThresholdTokens"], "spec.router.pdThresholdTokens", 0),
        prefix_index=_choice(r["prefixIndex"], "spec.router.prefixIndex", PREFIX_INDEXES),
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


def parse_spec(raw: Any, default_image: str | None = None) -> Spec:
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
    _reject_unknown(kv, {"connector"}, "spec.kvTransfer")
    return Spec(
        model=parse_model(s["model"]),
        image=s.get("image") or default_image or DEFAULT_IMAGE,
        mode=mode,
        pools=tuple(parse_pool(name, raw_pools[name]) for name in expected),
        engine_args=parse_engine_args(s.get("engineArgs"), "spec.engineArgs"),
        router=parse_router(s.get("router")),
        kv_connector=_choice(
            kv.get("connector", "nixl"), "spec.kvTransfer.connector", KV_CONNECTORS
        ),
        api_key_secret=parse_secret_key_ref(s.get("apiKeySecret"), "spec.apiKeySecret"),
    )
