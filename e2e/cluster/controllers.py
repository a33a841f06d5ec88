"""The lab's controller-manager: what kube-controller-manager does for our objects.

- Deployments -> ReplicaSets (named `<deployment>-<pod-template-hash>`, one per pod template;
  RollingUpdate with maxSurge/maxUnavailable, or Recreate) and their status;
- ReplicaSets -> Pods (`generateName`, the template's labels plus `pod-template-hash`, a
  controller owner reference), scaling down not-ready and newest pods first, replacing pods that
  are gone, and their status;
- StatefulSets -> Pods named `<set>-<ordinal>` (from `ordinals.start`), each with its hostname
  and the set's Service as subdomain, created in order (OrderedReady) or all at once
  (Parallel), recreated when gone or ended, removed from the highest ordinal down, rolled from
  the highest ordinal down when the template changes; and their status;
- Services -> Endpoints of their selected pods (ready ones as addresses, every one under
  publishNotReadyAddresses; with the pod's hostname where the pod's subdomain is the Service);
- PersistentVolumeClaims the lab has a directory for -> Bound;
- the garbage collector: dependents whose owners are all gone are deleted; foreground deletion
  waits for dependents, orphan deletion strips the owner references.

Level-triggered: every change in the API (and a periodic resync) re-runs every sync over the
current objects, on the API server's event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable, Iterable

import kmock

from .api import LabApi, Res
from .labels import from_label_selector, from_map, matches
from .probes import within

log = logging.getLogger("cluster.controllers")

DEPLOYMENTS = Res("apps/v1/deployments")
REPLICASETS = Res("apps/v1/replicasets")
STATEFULSETS = Res("apps/v1/statefulsets")
PODS = Res("v1/pods")
SERVICES = Res("v1/services")
ENDPOINTS = Res("v1/endpoints")
CLAIMS = Res("v1/persistentvolumeclaims")
NAMESPACES = Res("v1/namespaces")
ACCOUNTS = Res("v1/serviceaccounts")
CONFIGMAPS = Res("v1/configmaps")
TEMPLATE_HASH = "pod-template-hash"
REVISION_HASH = "controller-revision-hash"  # a StatefulSet pod's template revision
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
RESYNC_S = 1.0
_HASH_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def template_hash(template: dict) -> str:
    """A stable, DNS-safe hash of a pod template (Kubernetes uses FNV over the same input)."""
    digest = hashlib.sha256(repr(_canonical(template)).encode()).digest()
    return "".join(_HASH_ALPHABET[b % len(_HASH_ALPHABET)] for b in digest[:10])


def _canonical(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_canonical(v) for v in value)
    return value


def controller_of(obj: dict) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref["uid"]
    return None


def owner_reference(owner: dict) -> dict:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def is_active(pod: dict) -> bool:
    terminal = (pod.get("status") or {}).get("phase") in {"Succeeded", "Failed"}
    return not pod["metadata"].get("deletionTimestamp") and not terminal


def resolve_fraction(value: int | str | None, replicas: int, round_up: bool) -> int:
    """maxSurge / maxUnavailable: an absolute number or a percentage of replicas."""
    if value is None:
        return 0
    if isinstance(value, str) and value.endswith("%"):
        exact = int(value[:-1]) * replicas / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def removal_order(pods: list[dict]) -> list[dict]:
    """Which pods a ReplicaSet scales away first: not ready before ready, newest first."""
    newest_first = sorted(
        pods,
        key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]),
        reverse=True,
    )
    return sorted(newest_first, key=is_ready)


class ControllerManager:
    def __init__(
        self,
        api: LabApi,
        ca_pem: str,
        claims: Iterable[str] = (),
        add_ons: Iterable[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self.api, self.ca_pem = api, ca_pem
        self.claims = set(claims)
        self.add_ons = list(add_ons)  # syncs of controllers installed beside these (LWS)

    async def run(self) -> None:
        listener = self.api.listen()
        while True:
            listener.clear()
            for sync in (
                self.sync_namespaces,
                self.sync_deployments,
                self.sync_replicasets,
                *self.add_ons,
                self.sync_statefulsets,
                self.sync_endpoints,
                self.sync_claims,
                self.collect_garbage,
            ):
                try:
                    await sync()
                except kmock.KubernetesError as e:  # a race with another writer: next round
                    log.debug("%s: %s", getattr(sync, "__name__", sync), e)
            with contextlib.suppress(TimeoutError):
                await within(listener.wait(), RESYNC_S)

    # -- namespaces

    async def sync_namespaces(self) -> None:
        """Every namespace gets its `default` ServiceAccount and the cluster's CA
        (`kube-root-ca.crt`), as the service-account and root-CA controllers do."""
        for namespace in self.api.list(NAMESPACES):
            ns = namespace["metadata"]["name"]
            if namespace["metadata"].get("deletionTimestamp"):
                continue
            if self.api.get(ACCOUNTS, ns, "default") is None:
                await self.api.create(ACCOUNTS, ns, {"metadata": {"name": "default"}})
            if self.api.get(CONFIGMAPS, ns, "kube-root-ca.crt") is None:
                ca = {"metadata": {"name": "kube-root-ca.crt"}, "data": {"ca.crt": self.ca_pem}}
                await self.api.create(CONFIGMAPS, ns, ca)

    # -- Deployments

    async def sync_deployments(self) -> None:
        for deployment in self.api.list(DEPLOYMENTS):
            if not deployment["metadata"].get("deletionTimestamp"):
                await self.sync_deployment(deployment)

    async def sync_deployment(self, d: dict) -> None:
        meta, spec = d["metadata"], d["spec"]
        ns = meta["namespace"]
        owned = [rs for rs in self.api.list(REPLICASETS, ns) if controller_of(rs) == meta["uid"]]
        hash_ = template_hash(spec["template"])
        new = next(
            (rs for rs in owned if rs["metadata"]["labels"].get(TEMPLATE_HASH) == hash_), None
        )
        old = [rs for rs in owned if rs is not new]
        if new is None:
            new = await self.api.create(REPLICASETS, ns, self._replicaset(d, hash_))
        replicas = spec["replicas"]
        if spec["strategy"]["type"] == "Recreate":
            await self._recreate(new, old, replicas)
        else:
            await self._roll(d, new, old, replicas)
        await self._deployment_status(d, new, hash_)

    def _replicaset(self, d: dict, hash_: str) -> dict:
        template = d["spec"]["template"]
        labels = {**template["metadata"].get("labels", {}), TEMPLATE_HASH: hash_}
        selector = dict(d["spec"]["selector"])
        selector["matchLabels"] = {**selector.get("matchLabels", {}), TEMPLATE_HASH: hash_}
        return {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{d['metadata']['name']}-{hash_}",
                "namespace": d["metadata"]["namespace"],
                "labels": labels,
                "ownerReferences": [owner_reference(d)],
            },
            "spec": {
                "replicas": 0,
                "selector": selector,
                "template": {**template, "metadata": {**template["metadata"], "labels": labels}},
            },
        }

    async def _scale(self, rs: dict, replicas: int) -> None:
        if rs["spec"]["replicas"] != replicas:
            meta = rs["metadata"]
            await self.api.patch(
                REPLICASETS, meta["namespace"], meta["name"], {"spec": {"replicas": replicas}}
            )

    async def _recreate(self, new: dict, old: list[dict], replicas: int) -> None:
        for rs in old:
            await self._scale(rs, 0)
        ns = new["metadata"]["namespace"]
        old_uids = {rs["metadata"]["uid"] for rs in old}
        if any(controller_of(p) in old_uids for p in self.api.list(PODS, ns)):
            return  # Recreate: no new pod while an old one still runs
        await self._scale(new, replicas)

    async def _roll(self, d: dict, new: dict, old: list[dict], replicas: int) -> None:
        live_old = [rs for rs in old if rs["spec"]["replicas"] > 0]
        if not live_old:
            await self._scale(new, replicas)
            return
        rolling = d["spec"]["strategy"].get("rollingUpdate") or {}
        surge = resolve_fraction(rolling.get("maxSurge"), replicas, round_up=True)
        unavailable = resolve_fraction(rolling.get("maxUnavailable"), replicas, round_up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        total = sum(rs["spec"]["replicas"] for rs in [new, *old])
        room = replicas + surge - total
        if new["spec"]["replicas"] < replicas and room > 0:
            await self._scale(new, min(replicas, new["spec"]["replicas"] + room))
        ready = sum((rs.get("status") or {}).get("readyReplicas", 0) for rs in [new, *old])
        removable = ready - (replicas - unavailable)
        for rs in sorted(live_old, key=lambda r: r["metadata"]["creationTimestamp"]):
            current = rs["spec"]["replicas"]
            unhealthy = current - (rs.get("status") or {}).get("readyReplicas", 0)
            cut = min(current, unhealthy + max(0, removable))
            removable -= max(0, cut - unhealthy)
            await self._scale(rs, current - cut)

    async def _deployment_status(self, d: dict, new: dict, hash_: str) -> None:
        ns, uid = d["metadata"]["namespace"], d["metadata"]["uid"]
        rs_uids = {
            rs["metadata"]["uid"]: rs
            for rs in self.api.list(REPLICASETS, ns)
            if controller_of(rs) == uid
        }
        pods = [p for p in self.api.list(PODS, ns) if controller_of(p) in rs_uids and is_active(p)]
        updated = [p for p in pods if p["metadata"]["labels"].get(TEMPLATE_HASH) == hash_]
        ready = sum(map(is_ready, pods))
        status = {
            "observedGeneration": d["metadata"]["generation"],
            "replicas": len(pods),
            "updatedReplicas": len(updated),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(0, d["spec"]["replicas"] - ready),
        }
        status = {k: v for k, v in status.items() if v or k == "observedGeneration"}
        await self._write_status(DEPLOYMENTS, d, status)

    async def _write_status(self, res: Res, obj: dict, status: dict) -> None:
        await write_status(self.api, res, obj, status)

    # -- ReplicaSets

    async def sync_replicasets(self) -> None:
        for rs in self.api.list(REPLICASETS):
            if not rs["metadata"].get("deletionTimestamp"):
                await self.sync_replicaset(rs)

    async def sync_replicaset(self, rs: dict) -> None:
        meta, spec = rs["metadata"], rs["spec"]
        ns = meta["namespace"]
        pods = [p for p in self.api.list(PODS, ns) if controller_of(p) == meta["uid"]]
        active = [p for p in pods if is_active(p)]
        missing = spec["replicas"] - len(active)
        for _ in range(max(0, missing)):
            await self.api.create(PODS, ns, self._pod(rs))
        for pod in removal_order(active)[: max(0, -missing)]:
            await self.api.delete(PODS, ns, pod["metadata"]["name"])
        ready = sum(map(is_ready, active))
        status = {
            "observedGeneration": meta["generation"],
            "replicas": len(active),
            "fullyLabeledReplicas": len(active),
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        status = {k: v for k, v in status.items() if v or k in {"observedGeneration", "replicas"}}
        await self._write_status(REPLICASETS, rs, status)

    @staticmethod
    def _pod(rs: dict) -> dict:
        template = rs["spec"]["template"]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                **template.get("metadata", {}),
                "generateName": f"{rs['metadata']['name']}-",
                "namespace": rs["metadata"]["namespace"],
                "ownerReferences": [owner_reference(rs)],
            },
            "spec": template["spec"],
        }

    # -- StatefulSets

    async def sync_statefulsets(self) -> None:
        for sts in self.api.list(STATEFULSETS):
            if not sts["metadata"].get("deletionTimestamp"):
                await self.sync_statefulset(sts)

    async def sync_statefulset(self, sts: dict) -> None:
        meta, spec = sts["metadata"], sts["spec"]
        ns = meta["namespace"]
        revision = f"{meta['name']}-{template_hash(spec['template'])}"
        owned = {
            p["metadata"]["name"]: p
            for p in self.api.list(PODS, ns)
            if controller_of(p) == meta["uid"]
        }
        wanted = ordinal_names(sts)
        parallel = spec.get("podManagementPolicy") == "Parallel"
        for name in wanted:
            pod = owned.get(name) or self.api.get(PODS, ns, name)
            if pod is None:
                await self.api.create(PODS, ns, statefulset_pod(sts, name, revision))
            elif not is_active(pod) and not pod["metadata"].get("deletionTimestamp"):
                await self.api.delete(PODS, ns, name)  # Failed or Succeeded: replaced
            elif parallel or (is_active(pod) and is_ready(pod)):
                continue
            if not parallel:
                break  # OrderedReady: the next ordinal waits for this one to be Ready
        surplus = sorted(
            (p for n, p in owned.items() if n not in wanted and is_active(p)),
            key=pod_ordinal,
            reverse=True,
        )
        for pod in surplus if parallel else surplus[:1]:
            await self.api.delete(PODS, ns, pod["metadata"]["name"])
        present = [owned[n] for n in wanted if n in owned]
        if len(present) == len(wanted):
            await self._roll_statefulset(sts, present, revision)
        await self._statefulset_status(sts, revision)

    async def _roll_statefulset(self, sts: dict, pods: list[dict], revision: str) -> None:
        """RollingUpdate: one pod of an old revision at a time, from the highest ordinal, once
        every pod is there and Ready."""
        strategy = sts["spec"].get("updateStrategy") or {}
        if strategy.get("type", "RollingUpdate") != "RollingUpdate":
            return
        if not all(is_active(p) and is_ready(p) for p in pods):
            return
        old = [p for p in pods if p["metadata"]["labels"].get(REVISION_HASH) != revision]
        if old:
            victim = max(old, key=pod_ordinal)
            await self.api.delete(PODS, sts["metadata"]["namespace"], victim["metadata"]["name"])

    async def _statefulset_status(self, sts: dict, revision: str) -> None:
        meta = sts["metadata"]
        pods = [
            p
            for p in self.api.list(PODS, meta["namespace"])
            if controller_of(p) == meta["uid"] and is_active(p)
        ]
        updated = [p for p in pods if p["metadata"]["labels"].get(REVISION_HASH) == revision]
        ready = sum(map(is_ready, pods))
        status = {
            "observedGeneration": meta["generation"],
            "replicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "currentReplicas": len(updated),
            "updatedReplicas": len(updated),
            "currentRevision": revision,
            "updateRevision": revision,
        }
        status = {k: v for k, v in status.items() if v or k in {"observedGeneration", "replicas"}}
        await self._write_status(STATEFULSETS, sts, status)

    # -- Services

    async def sync_endpoints(self) -> None:
        services = {
            (s["metadata"]["namespace"], s["metadata"]["name"]): s for s in self.api.list(SERVICES)
        }
        for endpoints in self.api.list(ENDPOINTS):
            key = (endpoints["metadata"]["namespace"], endpoints["metadata"]["name"])
            if key not in services:
                await self.api.delete(ENDPOINTS, *key)
        for (ns, name), service in services.items():
            selector = service["spec"].get("selector")
            if not selector:
                continue
            pods = [
                p
                for p in self.api.list(PODS, ns, from_map(selector))
                if is_active(p) and (p.get("status") or {}).get("podIP")
            ]
            wanted = endpoints_of(service, pods)
            current = self.api.get(ENDPOINTS, ns, name)
            if current is None:
                await self.api.create(ENDPOINTS, ns, wanted)
            elif current.get("subsets") != wanted["subsets"]:
                await self.api.update(
                    ENDPOINTS, ns, name, lambda old, w=wanted: {**old, "subsets": w["subsets"]}
                )

    # -- claims

    async def sync_claims(self) -> None:
        for claim in self.api.list(CLAIMS):
            meta = claim["metadata"]
            if meta["name"] in self.claims and (claim.get("status") or {}).get("phase") != "Bound":
                await self.api.patch(
                    CLAIMS,
                    meta["namespace"],
                    meta["name"],
                    {"status": {"phase": "Bound"}},
                    "status",
                )

    # -- garbage collector

    def _everything(self) -> list[tuple[Res, dict]]:
        return [(res, obj) for res in list(self.api.resources) for obj in self.api.list(res)]

    async def collect_garbage(self) -> None:
        objects = self._everything()
        by_uid = {obj["metadata"]["uid"]: obj for _, obj in objects}
        dependents: dict[str, list[tuple[Res, dict]]] = {}
        for res, obj in objects:
            for ref in obj["metadata"].get("ownerReferences") or []:
                dependents.setdefault(ref["uid"], []).append((res, obj))
        for res, obj in objects:
            await self._collect(res, obj, by_uid)
        for res, owner in objects:
            await self._finish_deletion(res, owner, dependents.get(owner["metadata"]["uid"], []))

    async def _collect(self, res: Res, obj: dict, by_uid: dict[str, dict]) -> None:
        meta = obj["metadata"]
        refs = meta.get("ownerReferences") or []
        if not refs or meta.get("deletionTimestamp"):
            return
        owners = [by_uid.get(ref["uid"]) for ref in refs]
        if all(owner is None for owner in owners):
            await self.api.delete(res, meta.get("namespace"), meta["name"])
            return
        orphaning = [o["metadata"]["uid"] for o in owners if o and "orphan" in _finalizers(o)]
        if orphaning:
            kept = [ref for ref in refs if ref["uid"] not in orphaning]
            await self.api.patch(
                res,
                meta.get("namespace"),
                meta["name"],
                {"metadata": {"ownerReferences": kept or None}},
            )
            return
        if any(o and "foregroundDeletion" in _finalizers(o) for o in owners):
            await self.api.delete(res, meta.get("namespace"), meta["name"], "Foreground")

    async def _finish_deletion(
        self, res: Res, owner: dict, dependents: list[tuple[Res, dict]]
    ) -> None:
        """Drop the foregroundDeletion / orphan finalizer once no dependent is left that holds
        it (blockOwnerDeletion for foreground, any reference for orphan)."""
        meta = owner["metadata"]
        finalizers = _finalizers(owner)
        if not meta.get("deletionTimestamp"):
            return
        done = set()
        if "foregroundDeletion" in finalizers and not any(
            ref.get("blockOwnerDeletion")
            for _, d in dependents
            for ref in d["metadata"].get("ownerReferences") or []
            if ref["uid"] == meta["uid"]
        ):
            done.add("foregroundDeletion")
        if "orphan" in finalizers and not dependents:
            done.add("orphan")
        if done:
            kept = [f for f in finalizers if f not in done]
            await self.api.patch(
                res, meta.get("namespace"), meta["name"], {"metadata": {"finalizers": kept}}
            )


async def write_status(api: LabApi, res: Res, obj: dict, status: dict) -> None:
    """Replace the status (zero counts are left out, as the real controllers do)."""
    if (obj.get("status") or {}) != status:
        meta = obj["metadata"]
        await api.update(
            res, meta["namespace"], meta["name"], lambda old: {**old, "status": status}, "status"
        )


def ordinal_names(sts: dict) -> list[str]:
    """The names of a StatefulSet's pods: `<set>-<ordinal>` from `ordinals.start`."""
    start = (sts["spec"].get("ordinals") or {}).get("start", 0)
    name = sts["metadata"]["name"]
    return [f"{name}-{i}" for i in range(start, start + sts["spec"]["replicas"])]


def pod_ordinal(pod: dict) -> int:
    return int(pod["metadata"]["name"].rsplit("-", 1)[1])


def statefulset_pod(sts: dict, name: str, revision: str) -> dict:
    """A StatefulSet's pod: the template's labels plus its identity, its hostname and the
    set's governing Service as subdomain."""
    template = sts["spec"]["template"]
    labels = {
        **(template.get("metadata") or {}).get("labels", {}),
        POD_NAME_LABEL: name,
        POD_INDEX_LABEL: name.rsplit("-", 1)[1],
        REVISION_HASH: revision,
    }
    spec = {**template["spec"], "hostname": name}
    if sts["spec"].get("serviceName"):
        spec["subdomain"] = sts["spec"]["serviceName"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **(template.get("metadata") or {}),
            "name": name,
            "namespace": sts["metadata"]["namespace"],
            "labels": labels,
            "ownerReferences": [owner_reference(sts)],
        },
        "spec": spec,
    }


def _finalizers(obj: dict) -> list[str]:
    return list(obj["metadata"].get("finalizers") or [])


def endpoints_of(service: dict, pods: list[dict]) -> dict:
    """The Endpoints object of a Service: ready pods as addresses, the rest not ready; named
    target ports resolved against each pod's container ports."""
    meta = service["metadata"]
    subsets = []
    by_ports: dict[tuple, dict] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        ports = tuple(
            (p.get("name"), _target_port(p, pod), p.get("protocol", "TCP"))
            for p in service["spec"].get("ports", [])
        )
        if any(port is None for _, port, _ in ports):
            continue
        subset = by_ports.setdefault(ports, {"addresses": [], "notReadyAddresses": []})
        address: dict = {"ip": pod["status"]["podIP"]}
        if pod["spec"].get("hostname") and pod["spec"].get("subdomain") == meta["name"]:
            address["hostname"] = pod["spec"]["hostname"]  # what cluster DNS names
        address["targetRef"] = {
            "kind": "Pod",
            "name": pod["metadata"]["name"],
            "namespace": pod["metadata"]["namespace"],
            "uid": pod["metadata"]["uid"],
        }
        published = is_ready(pod) or service["spec"].get("publishNotReadyAddresses")
        subset["addresses" if published else "notReadyAddresses"].append(address)
    for ports, subset in by_ports.items():
        subset = {k: v for k, v in subset.items() if v}
        subset["ports"] = [
            {k: v for k, v in (("name", n), ("port", port), ("protocol", proto)) if v is not None}
            for n, port, proto in ports
        ]
        subsets.append(subset)
    return {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": meta.get("labels", {}),
        },
        "subsets": subsets,
    }


def _target_port(service_port: dict, pod: dict) -> int | None:
    target = service_port.get("targetPort", service_port.get("port"))
    if isinstance(target, int):
        return target
    for container in pod["spec"].get("containers", []):
        for port in container.get("ports", []):
            if port.get("name") == target:
                return port["containerPort"]
    return None


def selected_pods(api: LabApi, deployment: dict) -> list[dict]:
    """The live pods of a Deployment (through its selector)."""
    ns = deployment["metadata"]["namespace"]
    selector = from_label_selector(deployment["spec"]["selector"])
    return [
        p
        for p in api.list(PODS, ns)
        if matches(selector, p["metadata"].get("labels")) and is_active(p)
    ]
