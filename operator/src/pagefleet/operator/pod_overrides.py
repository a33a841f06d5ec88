"""A pool's (or the router's) pod overrides: typed fields checked here, then laid over the pod
the operator builds. What the operator must own stays its own: the command, probes, security
context, the fleet secret, its labels, the volumes and paths it mounts."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from pagefleet.operator.crd import RESERVED_LABEL_PREFIXES

# Names and paths the operator's pods already use (reconcile.py); an override of one would
# silently replace the model, the fleet secret or the API key.
RESERVED_ENV = frozenset(
    {
        "POD_IP",
        "PAGEFLEET_API_KEY",
        "PAGEFLEET_UPSTREAM_API_KEY",
        "HF_TOKEN",
        "HF_HUB_OFFLINE",
        # Multi-node pools: the leader's own Ray head, and what the LeaderWorkerSet injects.
        "RAY_ADDRESS",
        "LWS_LEADER_ADDRESS",
        "LWS_GROUP_SIZE",
        "LWS_WORKER_INDEX",
    }
)
RESERVED_VOLUMES = frozenset({"model", "tmp", "shm", "fleet-secret", "config", "adapters"})
RESERVED_VOLUME_PREFIX = "adapter-"  # spec.adapters' claims: adapter-0, adapter-1, ...
RESERVED_MOUNTS = (
    "/models",
    "/tmp",
    "/dev/shm",
    "/var/run/secrets/pagefleet.io",
    "/etc/pagefleet",
    "/adapters",
    "/adapter-claims",
)
LIST_FIELDS = ("env", "envFrom", "volumes", "volumeMounts", "topologySpreadConstraints")
POD_FIELDS = (
    *LIST_FIELDS,
    "affinity",
    "podAnnotations",
    "podLabels",
    "imagePullSecrets",
    "priorityClassName",
    "runtimeClassName",
    "terminationGracePeriodSeconds",
)


class OverrideError(ValueError):
    """An override the operator refuses; spec.py turns it into a SpecError."""


@dataclass(frozen=True)
class PodOverrides:
    env: tuple[dict, ...] = ()
    env_from: tuple[dict, ...] = ()
    volumes: tuple[dict, ...] = ()
    volume_mounts: tuple[dict, ...] = ()
    topology_spread: tuple[dict, ...] = ()
    affinity: dict[str, Any] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    image_pull_secrets: tuple[dict, ...] = ()
    priority_class: str | None = None
    runtime_class: str | None = None
    grace_period_s: int | None = None


def _objects(raw: dict, key: str, where: str) -> tuple[dict, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, dict) and v for v in value):
        raise OverrideError(f"{where}.{key} must be a list of objects")
    return tuple(dict(v) for v in value)


def _strings(raw: dict, key: str, where: str) -> dict[str, str]:
    value = raw.get(key) or {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise OverrideError(f"{where}.{key} must map strings to strings")
    return dict(value)


def _names(items: tuple[dict, ...], where: str) -> list[str]:
    names = [item.get("name") for item in items]
    if not all(isinstance(n, str) and n for n in names):
        raise OverrideError(f"{where}: every item needs a name")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise OverrideError(f"{where}: duplicate name(s) {', '.join(duplicates)}")
    return names


def _under(path: str, root: str) -> bool:
    """Whether `path` is `root` or inside it, as the kubelet resolves them (`..` and `.`
    folded), so `/scratch/../models` is `/models`."""
    clean, top = (posixpath.normpath("/" + p.lstrip("/")) for p in (path, root))
    return clean == top or clean.startswith(top.rstrip("/") + "/")


def _check_reserved(o: PodOverrides, where: str) -> None:
    taken = sorted(set(_names(o.env, f"{where}.env")) & RESERVED_ENV)
    if taken:
        raise OverrideError(f"{where}.env: {', '.join(taken)} is set by the operator")
    volumes = _names(o.volumes, f"{where}.volumes")
    taken = sorted(
        v for v in volumes if v in RESERVED_VOLUMES or v.startswith(RESERVED_VOLUME_PREFIX)
    )
    if taken:
        raise OverrideError(f"{where}.volumes: the name(s) {', '.join(taken)} are the operator's")
    for mount in o.volume_mounts:
        name, path = mount.get("name"), mount.get("mountPath")
        if name not in volumes:
            raise OverrideError(f"{where}.volumeMounts: {name!r} is not one of {where}.volumes")
        if not isinstance(path, str) or not path.startswith("/"):
            raise OverrideError(f"{where}.volumeMounts.{name}: mountPath must be absolute")
        if any(_under(path, root) or _under(root, path) for root in RESERVED_MOUNTS):
            raise OverrideError(
                f"{where}.volumeMounts.{name}: {path} overlaps a path the operator mounts "
                f"({', '.join(RESERVED_MOUNTS)})"
            )
    for key in (*o.labels, *o.annotations):
        if key.startswith(RESERVED_LABEL_PREFIXES):
            raise OverrideError(f"{where}: label/annotation {key} is reserved to the operator")


def parse_pod_overrides(raw: dict[str, Any], where: str) -> PodOverrides:
    """The override fields of a pool or the router (other keys are the caller's)."""
    grace = raw.get("terminationGracePeriodSeconds")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int) or grace < 0):
        raise OverrideError(f"{where}.terminationGracePeriodSeconds must be an integer >= 0")
    affinity = raw.get("affinity") or {}
    if not isinstance(affinity, dict):
        raise OverrideError(f"{where}.affinity must be an object")
    for key in ("priorityClassName", "runtimeClassName"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise OverrideError(f"{where}.{key} must be a string")
    overrides = PodOverrides(
        env=_objects(raw, "env", where),
        env_from=_objects(raw, "envFrom", where),
        volumes=_objects(raw, "volumes", where),
        volume_mounts=_objects(raw, "volumeMounts", where),
        topology_spread=_objects(raw, "topologySpreadConstraints", where),
        affinity=dict(affinity),
        annotations=_strings(raw, "podAnnotations", where),
        labels=_strings(raw, "podLabels", where),
        image_pull_secrets=_objects(raw, "imagePullSecrets", where),
        priority_class=raw.get("priorityClassName") or None,
        runtime_class=raw.get("runtimeClassName") or None,
        grace_period_s=grace,
    )
    _check_reserved(overrides, where)
    return overrides


def merge_affinity(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The user's affinity with the operator's pod-affinity terms added to its own lists."""
    merged = {k: dict(v) for k, v in theirs.items()}
    for kind, rules in ours.items():
        target = merged.setdefault(kind, {})
        for key, terms in rules.items():
            target[key] = [*target.get(key, []), *terms]
    return merged


def overlay(pod: dict[str, Any], container: dict[str, Any], o: PodOverrides) -> None:
    """Lay the overrides over one pod template's spec and its main container, in place.
    Lists are appended after the operator's items; scalars are set."""
    if o.env:
        container["env"] = [*container.get("env", []), *o.env]
    if o.env_from:
        container["envFrom"] = list(o.env_from)
    if o.volume_mounts:
        container["volumeMounts"] = [*container.get("volumeMounts", []), *o.volume_mounts]
    if o.volumes:
        pod["volumes"] = [*pod.get("volumes", []), *o.volumes]
    if o.topology_spread:
        pod["topologySpreadConstraints"] = list(o.topology_spread)
    if o.affinity or pod.get("affinity"):
        pod["affinity"] = merge_affinity(pod.get("affinity", {}), o.affinity)
    if o.image_pull_secrets:
        pod["imagePullSecrets"] = list(o.image_pull_secrets)
    if o.priority_class:
        pod["priorityClassName"] = o.priority_class
    if o.runtime_class:
        pod["runtimeClassName"] = o.runtime_class
    if o.grace_period_s is not None:
        pod["terminationGracePeriodSeconds"] = o.grace_period_s
