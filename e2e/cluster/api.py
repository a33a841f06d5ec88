"""The lab's API server: kmock's KubernetesEmulator (its object store with history, discovery and
error shapes), taught what a real API server does that our objects rely on:

- metadata the server owns: uid, resourceVersion (one counter, bumped by every change and
  untouched by no-op writes), creationTimestamp, generation (bumped when anything but metadata
  and status changes), `generateName`;
- defaults the real server fills in (Deployment replicas and strategy, pod-spec and probe
  defaults, Service ports and clusterIP), so that "what I wrote" differs from "what I read" as
  on a cluster;
- the status subresource: writes to the object ignore status, writes to /status change only
  status;
- merge, JSON, strategic-merge (by each list's merge key) and apply patches, PUT, and
  optimistic concurrency (409 on a stale resourceVersion);
- `labelSelector` on list and watch, watches that resume from a resourceVersion and end after
  `timeoutSeconds`;
- deletion as the server does it: finalizers, graceful pod deletion (deletionTimestamp first;
  the kubelet removes the pod), and foreground/orphan propagation via finalizers that the
  garbage collector (controllers.py) honours;
- CustomResourceDefinitions that add their resource (with its subresources) to discovery;
- mutating admission webhooks of pods that add-ons install (`pod_webhooks`);
- bearer tokens required on the TLS port (pods log in with their service-account token); the
  plain port is an unauthenticated local endpoint, like `kubectl proxy`.

Authorization (RBAC) and admission are not emulated. Controllers and the kubelet call the
`create/get/list/patch/replace/delete` methods on the server's own event loop; clients use HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import ipaddress
import json
import random
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import dicts, enums, rendering

from .labels import Requirement, matches, parse_selector
from .probes import within

Res = kmock.resource

# group/version/plural: (kind, namespaced, subresources) served from the start.
BUILTIN_RESOURCES: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "v1/namespaces": ("Namespace", False, ("status",)),
    "v1/pods": ("Pod", True, ("status",)),
    "v1/services": ("Service", True, ("status",)),
    "v1/endpoints": ("Endpoints", True, ()),
    "v1/configmaps": ("ConfigMap", True, ()),
    "v1/secrets": ("Secret", True, ()),
    "v1/serviceaccounts": ("ServiceAccount", True, ()),
    "v1/events": ("Event", True, ()),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True, ("status",)),
    "apps/v1/deployments": ("Deployment", True, ("status", "scale")),
    "apps/v1/replicasets": ("ReplicaSet", True, ("status", "scale")),
    "apps/v1/statefulsets": ("StatefulSet", True, ("status", "scale")),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, ()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, ()),
    "rbac.authorization.k8s.io/v1/clusterroles": ("ClusterRole", False, ()),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", False, ()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, ()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, ("status",)),
    "coordination.k8s.io/v1/leases": ("Lease", True, ()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": (
        "CustomResourceDefinition",
        False,
        ("status",),
    ),
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
NAMESPACE_PATH = re.compile(
    r"^/api/v1/namespaces(?:/(?P<name>[^/]+)(?:/(?P<sub>status|finalize))?)?/?$"
)
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/16")
_NAME_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet of generateName's suffix
# Lists merged element-wise by a strategic merge patch, by their patchMergeKey.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
    "conditions": "type",
    "ownerReferences": "uid",
    "imagePullSecrets": "name",
}


# Objects with a pod template whose defaults the server fills in.
WORKLOADS = frozenset({"Deployment", "ReplicaSet", "StatefulSet"})


def now_iso(offset_s: float = 0.0) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def api_error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details)


def not_found(res: Res, name: str) -> kmock.KubernetesError:
    return api_error(404, "NotFound", f'{res.plural} "{name}" not found', name=name)


# --- defaults the real API server applies --------------------------------------------------


def _default_probe(probe: dict | None) -> None:
    if probe is None:
        return
    for key, value in {
        "timeoutSeconds": 1,
        "periodSeconds": 10,
        "successThreshold": 1,
        "failureThreshold": 3,
    }.items():
        probe.setdefault(key, value)
    if "httpGet" in probe:
        probe["httpGet"].setdefault("scheme", "HTTP")
        probe["httpGet"].setdefault("path", "/")


def quantity(value: int | float | str) -> str:
    """A resource quantity as the server stores it: always a string (1 -> "1", 0.5 -> "500m")."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def default_pod_spec(spec: dict) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        image = container.get("image", "")
        latest = ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
        container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        resources = container.setdefault("resources", {})
        for kind in ("requests", "limits"):
            if kind in resources:
                resources[kind] = {k: quantity(v) for k, v in resources[kind].items()}
        for port in container.get("ports", []):
            port.setdefault("protocol", "TCP")
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            _default_probe(container.get(kind))
    for volume in spec.get("volumes", []):
        for source in ("configMap", "secret"):
            if source in volume:
                volume[source].setdefault("defaultMode", 0o644)


def default_templates(kind: str, obj: dict) -> None:
    """Defaults of every write, not only of creation: a merge patch that replaces a list (the
    containers) gets its defaults back, so a template the patch did not change keeps its hash
    (a Deployment does not roll because its operator re-applied it)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    if kind == "Pod":
        default_pod_spec(spec)
    elif kind in WORKLOADS and isinstance(spec.get("template"), dict):
        default_pod_spec(spec["template"].setdefault("spec", {}))


def apply_defaults(kind: str, obj: dict, allocate_ip: Callable[[], str]) -> None:
    spec = obj.setdefault("spec", {}) if kind in {"Pod", *WORKLOADS} else None
    if kind == "Pod":
        default_pod_spec(spec)
        obj["status"] = {"phase": "Pending"}
    elif kind in WORKLOADS:
        spec.setdefault("replicas", 1)
        default_pod_spec(spec.setdefault("template", {}).setdefault("spec", {}))
        if kind == "StatefulSet":
            spec.setdefault("podManagementPolicy", "OrderedReady")
            spec.setdefault("revisionHistoryLimit", 10)
            spec.setdefault("updateStrategy", {"type": "RollingUpdate"})
        if kind == "Deployment":
            spec.setdefault("revisionHistoryLimit", 10)
            spec.setdefault("progressDeadlineSeconds", 600)
            strategy = spec.setdefault("strategy", {"type": "RollingUpdate"})
            if strategy.get("type", "RollingUpdate") == "RollingUpdate":
                rolling = strategy.setdefault("rollingUpdate", {})
                rolling.setdefault("maxSurge", "25%")
                rolling.setdefault("maxUnavailable", "25%")
    elif kind == "Service":
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        if spec.get("clusterIP") != "None":
            spec["clusterIP"] = allocate_ip()
            spec["clusterIPs"] = [spec["clusterIP"]]
        for port in spec.get("ports", []):
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    elif kind == "Namespace":
        obj.setdefault("spec", {"finalizers": ["kubernetes"]})
        obj["status"] = {"phase": "Active"}


# --- patches -------------------------------------------------------------------------------


def strategic_merge(old: Any, patch: Any, key: str | None = None) -> Any:
    """A strategic merge patch as far as our objects need it: dicts merge (null deletes), lists
    named in MERGE_KEYS merge element-wise by their key, other lists are replaced."""
    if isinstance(patch, dict) and isinstance(old, dict):
        out = dict(old)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(old.get(k), v, k)
        return out
    merge_key = MERGE_KEYS.get(key or "")
    if merge_key and isinstance(patch, list) and isinstance(old, list):
        out = list(old)
        index = {item.get(merge_key): i for i, item in enumerate(out) if isinstance(item, dict)}
        for item in patch:
            i = index.get(item.get(merge_key)) if isinstance(item, dict) else None
            if i is None:
                out.append(item)
            else:
                out[i] = strategic_merge(out[i], item)
        return out
    return copy.deepcopy(patch)


def apply_patch(old: dict, body: bytes, content_type: str) -> dict:
    """The object after a PATCH request with this body and Content-Type."""
    kind = content_type.split(";")[0].strip()
    try:
        if kind == "application/json-patch+json":
            return jsonpatch.apply_patch(old, json.loads(body), in_place=False)
        if kind == "application/apply-patch+yaml":
            return strategic_merge(old, yaml.safe_load(body))
        patch = json.loads(body)
    except (ValueError, yaml.YAMLError, jsonpatch.JsonPatchException) as e:
        raise api_error(400, "BadRequest", f"the patch cannot be applied: {e}") from None
    if not isinstance(patch, dict):
        raise api_error(400, "BadRequest", "a merge patch must be a JSON object")
    if kind == "application/merge-patch+json":
        return dict(dicts.merge_patch_dict(old, patch))
    return strategic_merge(old, patch)  # application/strategic-merge-patch+json


def _content(obj: dict) -> dict:
    """What generation counts: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in {"metadata", "status"}}


# --- watches -------------------------------------------------------------------------------


@dataclass(eq=False)
class Watch:
    res: Res
    namespace: str | None
    selector: tuple[Requirement, ...]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def sees(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata", {})
        in_namespace = self.namespace is None or meta.get("namespace") == self.namespace
        return in_namespace and matches(self.selector, meta.get("labels"))

    def event(self, old: dict | None, new: dict | None) -> dict | None:
        """What this watch is told of a change: an object entering its selector is ADDED,
        leaving it is DELETED (as the API server does for label-selected watches)."""
        before, after = self.sees(old), self.sees(new)
        if after:
            return {"type": "MODIFIED" if before else "ADDED", "object": new}
        if before:
            return {"type": "DELETED", "object": new or old}
        return None


@dataclass
class Change:
    rv: int
    res: Res
    old: dict | None
    new: dict | None  # None: the object is gone


# --- the server ----------------------------------------------------------------------------


@attrs.define(kw_only=True)
class LabApi(kmock.KubernetesEmulator):
    """kmock's emulator with the real API server's behaviour described in the module doc."""

    _rv: int = attrs.field(default=0, init=False)
    _changes: list[Change] = attrs.field(factory=list, init=False)
    _watches: set[Watch] = attrs.field(factory=set, init=False)
    _kinds: dict[tuple[str, str], Res] = attrs.field(factory=dict, init=False)
    _next_service_ip: int = attrs.field(default=10, init=False)
    _listeners: list[asyncio.Event] = attrs.field(factory=list, init=False)
    # Mutating admission webhooks for pods (an add-on's, e.g. LeaderWorkerSet's), in order.
    pod_webhooks: list[Callable[[dict], None]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, namespaced, subresources) in BUILTIN_RESOURCES.items():
            self.register(Res(key), kind, namespaced, subresources)

    # -- resources

    def register(self, res: Res, kind: str, namespaced: bool, subresources=()) -> None:
        self.resources[res] = kmock.ResourceInfo(
            kind=kind,
            namespaced=namespaced,
            verbs=VERBS,
            subresources=set(subresources),
            singular=kind.lower(),
        )
        api_version = f"{res.group}/{res.version}" if res.group else res.version
        self._kinds[(api_version, kind)] = res

    def resource_of(self, api_version: str, kind: str) -> Res:
        try:
            return self._kinds[(api_version, kind)]
        except KeyError:
            raise api_error(
                404, "NotFound", f'no matches for kind "{kind}" in version "{api_version}"'
            ) from None

    def info(self, res: Res) -> kmock.ResourceInfo:
        if res not in self.resources:
            raise api_error(404, "NotFound", f"the server could not find the resource {res}")
        return self.resources[res]

    @property
    def resource_version(self) -> int:
        return self._rv

    # -- reading

    def _stored(self, res: Res, namespace: str | None, name: str) -> dict | None:
        key = (res, namespace if self.info(res).namespaced else None, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def get(self, res: Res, namespace: str | None, name: str) -> dict | None:
        found = self._stored(res, namespace, name)
        return copy.deepcopy(found) if found is not None else None

    def list(
        self, res: Res, namespace: str | None = None, selector: tuple[Requirement, ...] = ()
    ) -> list[dict]:
        self.info(res)
        items = []
        for (r, ns, _), obj in self.objects.items():
            if r != res or obj.deleted or (namespace is not None and ns != namespace):
                continue
            if matches(selector, obj.raw.get("metadata", {}).get("labels")):
                items.append(copy.deepcopy(obj.raw))
        return sorted(
            items, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"])
        )

    def history(self, res: Res, namespace: str | None, name: str) -> list[dict | None]:
        """Every stored version of the object (None where it was deleted)."""
        key = (res, namespace if self.info(res).namespaced else None, name)
        if key not in self.objects:
            return []
        return [
            None if v is None else copy.deepcopy(dict(v.raw)) for v in self.objects[key].history
        ]

    # -- writing

    def _commit(self, res: Res, namespace: str | None, name: str, new: dict | None) -> dict:
        """Store a new version (or the deletion, `new` None) with the next resourceVersion, and
        tell the watches and the in-process controllers."""
        key = (res, namespace, name)
        old = copy.deepcopy(self._stored(res, namespace, name))
        self._rv += 1
        if new is None:
            result = copy.deepcopy(old)
            result["metadata"]["resourceVersion"] = str(self._rv)
            self.objects[key].delete()
            change = Change(self._rv, res, result, None)
        else:
            result = new
            result["metadata"]["resourceVersion"] = str(self._rv)
            if key not in self.objects:
                self.objects[key] = result
            elif self.objects[key].deleted:
                self.objects[key].create(result)
            else:
                self.objects[key].history.append(result)
            change = Change(self._rv, res, old, copy.deepcopy(result))
        self._changes.append(change)
        for watch in list(self._watches):
            if watch.res == res and (event := watch.event(change.old, change.new)) is not None:
                watch.queue.put_nowait(event)
        for listener in self._listeners:
            listener.set()
        return copy.deepcopy(result)

    def listen(self) -> asyncio.Event:
        """An event set at every change; the in-process controllers clear their own."""
        listener = asyncio.Event()
        self._listeners.append(listener)
        return listener

    def _namespace_of(self, res: Res, namespace: str | None) -> str | None:
        if not self.info(res).namespaced:
            return None
        if not namespace:
            raise api_error(400, "BadRequest", "a namespaced object needs a namespace")
        if self._stored(Res("v1/namespaces"), None, namespace) is None:
            raise api_error(404, "NotFound", f'namespaces "{namespace}" not found')
        return namespace

    def _allocate_service_ip(self) -> str:
        self._next_service_ip += 1
        return str(SERVICE_CIDR.network_address + self._next_service_ip)

    async def create(self, res: Res, namespace: str | None, body: dict) -> dict:
        info = self.info(res)
        async with self._lock:
            obj = copy.deepcopy(body)
            meta = obj.setdefault("metadata", {})
            namespace = self._namespace_of(res, namespace or meta.get("namespace"))
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise api_error(422, "Invalid", "metadata.name or generateName is required")
                suffix = "".join(random.choices(_NAME_SUFFIX, k=5))
                meta["name"] = meta["generateName"] + suffix
            name = meta["name"]
            if self._stored(res, namespace, name) is not None:
                raise api_error(
                    409, "AlreadyExists", f'{res.plural} "{name}" already exists', name=name
                )
            if namespace is not None:
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(server_owned, None)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
            obj["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
            obj["kind"] = info.kind
            if "status" in info.subresources:
                obj.pop("status", None)
            if info.kind == "Pod":
                self._admit_pod(obj, namespace)
                for webhook in self.pod_webhooks:  # after the built-in plugins, as on a cluster
                    webhook(obj)
            apply_defaults(info.kind, obj, self._allocate_service_ip)
            if info.kind == "CustomResourceDefinition":
                self._establish(obj)
            return self._commit(res, namespace, name, obj)

    def _admit_pod(self, pod: dict, namespace: str) -> None:
        """The ServiceAccount admission plugin: the account must exist, and its token, the
        cluster's CA and the namespace are mounted where in-cluster clients look for them."""
        spec = pod.setdefault("spec", {})
        account = spec.setdefault("serviceAccountName", "default")
        found = self._stored(Res("v1/serviceaccounts"), namespace, account)
        if found is None:
            raise api_error(
                403,
                "Forbidden",
                f'pods "{pod["metadata"]["name"]}" is forbidden: error looking up service '
                f'account {namespace}/{account}: serviceaccount "{account}" not found',
            )
        if not spec.get(
            "automountServiceAccountToken", found.get("automountServiceAccountToken", True)
        ):
            return
        volume = "kube-api-access-" + "".join(random.choices(_NAME_SUFFIX, k=5))
        sources = [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {
                "configMap": {
                    "name": "kube-root-ca.crt",
                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                }
            },
            {
                "downwardAPI": {
                    "items": [
                        {
                            "path": "namespace",
                            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                        }
                    ]
                }
            },
        ]
        spec.setdefault("volumes", []).append(
            {"name": volume, "projected": {"defaultMode": 0o644, "sources": sources}}
        )
        for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            mounts = container.setdefault("volumeMounts", [])
            if not any(m["mountPath"] == TOKEN_DIR for m in mounts):
                mounts.append({"name": volume, "mountPath": TOKEN_DIR, "readOnly": True})

    def _establish(self, crd: dict) -> None:
        """Serve the CRD's resource (its storage version) and report it established."""
        spec = crd["spec"]
        version = next(v for v in spec["versions"] if v.get("storage", True))
        res = Res(spec["group"], version["name"], spec["names"]["plural"])
        subresources = tuple((version.get("subresources") or {}).keys())
        self.register(res, spec["names"]["kind"], spec.get("scope") == "Namespaced", subresources)
        crd["status"] = {
            "acceptedNames": spec["names"],
            "storedVersions": [version["name"]],
            "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": now_iso(), "reason": t}
                for t in ("NamesAccepted", "Established")
            ],
        }

    async def update(
        self,
        res: Res,
        namespace: str | None,
        name: str,
        change: Callable[[dict], dict],
        subresource: str | None = None,
    ) -> dict:
        """Write `change(current)` (a patch or a replacement) with the server's rules."""
        info = self.info(res)
        namespace = namespace if info.namespaced else None
        async with self._lock:
            old = self._stored(res, namespace, name)
            if old is None:
                raise not_found(res, name)
            new = copy.deepcopy(change(copy.deepcopy(old)))
            if not isinstance(new, dict):
                raise api_error(422, "Invalid", "the result is not an object")
            wanted_rv = (new.get("metadata") or {}).get("resourceVersion")
            if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
                raise api_error(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.plural} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                    name=name,
                )
            if subresource == "status":
                new = {**old, "status": new.get("status", {})}
            elif "status" in info.subresources:
                new["status"] = copy.deepcopy(old.get("status", {}))
                if not new["status"]:
                    new.pop("status")
            meta = new.setdefault("metadata", {})
            for owned in ("uid", "name", "namespace", "creationTimestamp", "generation"):
                if owned in old["metadata"]:
                    meta[owned] = old["metadata"][owned]
            meta.pop("deletionTimestamp", None)
            for owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                if owned in old["metadata"]:
                    meta[owned] = old["metadata"][owned]
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            if subresource != "status":
                default_templates(info.kind, new)
            if subresource != "status" and _content(new) != _content(old):
                meta["generation"] = old["metadata"].get("generation", 1) + 1
            if new == old:
                return copy.deepcopy(old)  # a no-op write changes nothing, not even the version
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                return self._commit(res, namespace, name, None)
            return self._commit(res, namespace, name, new)

    async def patch(
        self,
        res: Res,
        namespace: str | None,
        name: str,
        patch: dict,
        subresource: str | None = None,
        content_type: str = "application/merge-patch+json",
    ) -> dict:
        body = json.dumps(patch).encode()
        return await self.update(
            res, namespace, name, lambda old: apply_patch(old, body, content_type), subresource
        )

    async def delete(
        self,
        res: Res,
        namespace: str | None,
        name: str,
        propagation: str | None = None,
        grace_s: int | None = None,
    ) -> dict:
        info = self.info(res)
        namespace = namespace if info.namespaced else None
        async with self._lock:
            obj = self._stored(res, namespace, name)
            if obj is None:
                raise not_found(res, name)
            obj = copy.deepcopy(obj)
            meta = obj["metadata"]
            if info.kind == "Pod" and (obj.get("spec") or {}).get("nodeName"):
                # A pod on a node goes gracefully: marked now, removed by the kubelet (grace 0).
                if grace_s is None:
                    grace_s = obj["spec"].get("terminationGracePeriodSeconds", 30)
                current = meta.get("deletionGracePeriodSeconds")
                if grace_s > 0 and (current is None or grace_s < current):
                    meta["deletionTimestamp"] = now_iso(grace_s)
                    meta["deletionGracePeriodSeconds"] = grace_s
                    return self._commit(res, namespace, name, obj)
                if grace_s > 0:
                    return obj
            finalizers = list(meta.get("finalizers") or [])
            wanted = {"Foreground": "foregroundDeletion", "Orphan": "orphan"}.get(propagation or "")
            if wanted and wanted not in finalizers and not meta.get("deletionTimestamp"):
                finalizers.append(wanted)
            if not finalizers:
                return self._commit(res, namespace, name, None)
            if meta.get("deletionTimestamp") and meta.get("finalizers") == finalizers:
                return obj
            meta["finalizers"] = finalizers
            meta.setdefault("deletionTimestamp", now_iso())
            meta.setdefault("deletionGracePeriodSeconds", 0)
            return self._commit(res, namespace, name, obj)

    # -- watching

    async def watch(
        self,
        res: Res,
        namespace: str | None,
        selector: tuple[Requirement, ...],
        since: int | None,
        timeout_s: float | None,
    ) -> AsyncIterator[dict]:
        """Events after resourceVersion `since` (or ADDED for every current object first)."""
        watch = Watch(res, namespace, selector)
        if since is None:
            backlog = [{"type": "ADDED", "object": o} for o in self.list(res, namespace, selector)]
        else:
            backlog = [
                e
                for c in self._changes
                if c.rv > since and c.res == res
                for e in [watch.event(c.old, c.new)]
                if e is not None
            ]
        self._watches.add(watch)  # no await since the snapshot: nothing falls in between
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        try:
            for event in backlog:
                yield event
            while True:
                left = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if left is not None and left <= 0:
                    return
                try:
                    event = await within(watch.queue.get(), left)
                except TimeoutError:
                    return
                yield event
        finally:
            self._watches.discard(watch)

    # -- HTTP

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        """kmock names the core group's version "/v1"; clients (helm) want "v1"."""
        listing = await super()._serve_version(request)
        listing["groupVersion"] = listing["groupVersion"].lstrip("/")
        return listing

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        """A current Kubernetes (charts check kubeVersion against it)."""
        return {
            "major": "1",
            "minor": "31",
            "gitVersion": "v1.31.0-lab",
            "platform": "linux/amd64",
        }

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock reads /api/v1/namespaces[/NAME] as a namespace prefix; these paths name the
        cluster-scoped Namespace resource itself."""
        content_type = raw_request.headers.get("Content-Type", "")
        if "protobuf" in content_type or "cbor" in content_type:
            # JSON only here: client-go falls back to JSON on 415, as with any such server.
            error = api_error(415, "UnsupportedMediaType", f"{content_type} is not served")
            return await self._render_error(error)
        match = NAMESPACE_PATH.match(raw_request.path)
        if not match:
            return await super().__call__(raw_request)
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        method = enums.method(raw_request.method)
        query = dict(raw_request.query)
        action = (
            enums.action.WATCH
            if query.get("watch") == "true"
            else {"GET": enums.action.FETCH if match["name"] else enums.action.LIST}.get(
                raw_request.method
            )
        )
        request = rendering.Request(
            method=method,
            url=raw_request.url,
            params=query,
            headers=dict(raw_request.headers),
            body=body,
            text=body.decode(errors="replace"),
            data=data,
            action=action,
            resource=Res("v1/namespaces"),
            name=match["name"],
            subresource=match["sub"],
            raw_request=raw_request,
        )
        try:
            return await self._handle(request)
        except kmock.KubernetesError as e:
            return await self._render_error(e)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # kmock logs every request and matches discovery and watches against its whole log:
        # unbounded, that costs a long lab quadratic time. Nothing reads the log.
        del self._requests[:-16]
        res = request.resource
        if res is None or res.plural is None or res.version is None:
            # Discovery (/api, /apis, /apis/g/v, /version): kmock serves it from our resources.
            return await kmock.KubernetesScaffold._handle(self, request)
        try:
            self._authenticate(request)
            if request.action == enums.action.WATCH and res == Res("v1/namespaces"):
                # No kmock reaction matches the Namespace requests `__call__` makes; a
                # namespace-scoped kopf (the chart's operator) watches them.
                return await rendering.Response(payload=self._serve_watch)(request)
            if request.action == enums.action.WATCH:
                return await kmock.KubernetesScaffold._handle(self, request)
            status, body = await self._serve(request)
        except kmock.KubernetesError as e:
            return await self._render_error(e)
        return aiohttp.web.json_response(body, status=status)

    def _authenticate(self, request: rendering.Request) -> None:
        if request.url.scheme != "https":
            return
        auth = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise api_error(401, "Unauthorized", "Unauthorized")

    async def _serve(self, request: rendering.Request) -> tuple[int, Any]:
        res, ns, name = request.resource, request.namespace, request.name
        info = self.info(res)
        method = request.method.value.upper()
        sub = request.subresource
        params = request.params
        if method == "GET" and name is None:
            try:
                selector = parse_selector(params.get("labelSelector"))
            except ValueError as e:
                raise api_error(400, "BadRequest", str(e)) from None
            kind = f"{info.kind}List"
            items = self.list(res, ns, selector)
            meta = {"resourceVersion": str(self._rv)}
            return 200, {
                "apiVersion": _api_version(res),
                "kind": kind,
                "metadata": meta,
                "items": items,
            }
        if method == "GET":
            found = self.get(res, ns, name)
            if found is None:
                raise not_found(res, name)
            return 200, _scale(found) if sub == "scale" else found
        if method == "POST" and name is None:
            return 201, await self.create(res, ns, _json_body(request))
        if method == "PATCH" and name is not None:
            ctype = request.headers.get("Content-Type", "application/merge-patch+json")
            if ctype.startswith("application/apply-patch") and self._stored(res, ns, name) is None:
                return 201, await self.create(res, ns, yaml.safe_load(request.body))
            if sub == "scale":
                patch = apply_patch({"spec": {}}, request.body, ctype)
                return 200, _scale(
                    await self.patch(
                        res, ns, name, {"spec": {"replicas": patch["spec"]["replicas"]}}
                    )
                )
            return 200, await self.update(
                res, ns, name, lambda old: apply_patch(old, request.body, ctype), sub
            )
        if method == "PUT" and name is not None:
            body = _json_body(request)
            return 200, await self.update(res, ns, name, lambda old: body, sub)
        if method == "DELETE" and name is not None:
            options = request.data if isinstance(request.data, dict) else {}
            propagation = options.get("propagationPolicy") or params.get("propagationPolicy")
            grace = options.get("gracePeriodSeconds", params.get("gracePeriodSeconds"))
            return 200, await self.delete(
                res, ns, name, propagation, None if grace is None else int(grace)
            )
        raise api_error(405, "MethodNotAllowed", f"{method} is not supported here")

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # headers now: the client is waiting for the stream to start
        params = request.params
        try:
            selector = parse_selector(params.get("labelSelector"))
        except ValueError as e:
            raise api_error(400, "BadRequest", str(e)) from None
        since = params.get("resourceVersion")
        timeout = params.get("timeoutSeconds")
        async for event in self.watch(
            request.resource,
            request.namespace,
            selector,
            int(since) if since and since != "0" else None,
            float(timeout) if timeout else None,
        ):
            yield event


def _api_version(res: Res) -> str:
    return f"{res.group}/{res.version}" if res.group else res.version


def _json_body(request: rendering.Request) -> dict:
    if isinstance(request.data, dict):
        return request.data
    try:
        body = yaml.safe_load(request.body)
    except yaml.YAMLError:
        body = None
    if not isinstance(body, dict):
        raise api_error(400, "BadRequest", "the body is not a JSON object")
    return body


def _scale(obj: dict) -> dict:
    """The autoscaling/v1 Scale view of a Deployment or ReplicaSet."""
    meta = obj["metadata"]
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta
        },
        "spec": {"replicas": obj.get("spec", {}).get("replicas", 0)},
        "status": {"replicas": obj.get("status", {}).get("replicas", 0)},
    }


async def serve(api: LabApi, host: str, port: int, ssl_context=None) -> aiohttp.web.AppRunner:
    """Listen on host:port (TLS with `ssl_context`) in the calling thread's network namespace."""
    # Open watches would hold a graceful shutdown for a minute: the lab ends them at once.
    runner = aiohttp.web.ServerRunner(aiohttp.web.Server(api), shutdown_timeout=0.5)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner
