"""LeaderWorkerSet (sigs.k8s.io/lws) in the lab: its CRD, controller and pod webhook, as the LWS
release installs them, in the default Ordinal group identity with the Shared subdomain:

- per LeaderWorkerSet a leader StatefulSet `<lws>` (Parallel): `replicas` leader pods
  `<lws>-<group>` from the leader template (else the worker template), labelled with the
  template revision (a hash of the whole leaderWorkerTemplate, so a change to either template
  rolls the leaders, one group at a time);
- per leader pod a worker StatefulSet named like it (Parallel, ordinals from 1): `size - 1`
  pods `<lws>-<group>-<index>` owned through it by the leader pod, so a group's workers go with
  their leader; made at once (startupPolicy LeaderCreated) or once the leader is Ready
  (LeaderReady);
- the pod webhook: labels name / group-index / worker-index / group-key (sha1 of
  `<namespace>/<leader>`), the size annotation (the leader's name on workers), hostname and
  subdomain `<lws>` (so the headless Service named like the LWS resolves `<leader>.<lws>.<ns>`),
  and LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX first in every container's env;
- restartPolicy RecreateGroupOnPodRestart (the default): when a container of a group's pod has
  restarted or the pod is being deleted, the group's leader is deleted (foreground), its
  workers follow through the garbage collector, and the StatefulSets make the group anew;
- status: replicas (leader pods), readyReplicas (groups whose leader and workers are all Ready),
  hpaPodSelector (the leaders, what the scale subresource reports), the Available condition.

Not here: maxSurge / partition rollouts, subgroups, exclusive placement, UniquePerReplica
subdomains, Hash group identity, RecreateGroupAfterStart, volumeClaimTemplates.
"""

from __future__ import annotations

import hashlib

from .api import LabApi, Res
from .controllers import (
    PODS,
    STATEFULSETS,
    controller_of,
    is_active,
    is_ready,
    owner_reference,
    template_hash,
    write_status,
)

GROUP, VERSION = "leaderworkerset.x-k8s.io", "v1"
LEADER_WORKER_SETS = Res(f"{GROUP}/{VERSION}/leaderworkersets")
PREFIX = "leaderworkerset.sigs.k8s.io"
NAME, GROUP_INDEX, WORKER_INDEX = (
    f"{PREFIX}/name",
    f"{PREFIX}/group-index",
    f"{PREFIX}/worker-index",
)
GROUP_KEY, REVISION = f"{PREFIX}/group-key", f"{PREFIX}/template-revision-hash"
SIZE, LEADER_NAME, REPLICAS = f"{PREFIX}/size", f"{PREFIX}/leader-name", f"{PREFIX}/replicas"
LEADER_ADDRESS_ENV, GROUP_SIZE_ENV, WORKER_INDEX_ENV = (
    "LWS_LEADER_ADDRESS",
    "LWS_GROUP_SIZE",
    "LWS_WORKER_INDEX",
)
RECREATE_GROUP = "RecreateGroupOnPodRestart"

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"leaderworkersets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "kind": "LeaderWorkerSet",
            "listKind": "LeaderWorkerSetList",
            "plural": "leaderworkersets",
            "singular": "leaderworkerset",
            "shortNames": ["lws"],
        },
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.hpaPodSelector",
                    },
                },
            }
        ],
    },
}


# --- what the controller and the webhook compute (pure) -----------------------------------


def group_key(namespace: str, leader: str) -> str:
    return hashlib.sha1(f"{namespace}/{leader}".encode()).hexdigest()


def group_size(lws: dict) -> int:
    return int(lws["spec"]["leaderWorkerTemplate"].get("size", 1))


def revision_of(lws: dict) -> str:
    return template_hash(lws["spec"]["leaderWorkerTemplate"])


def leader_selector(name: str) -> dict[str, str]:
    return {NAME: name, WORKER_INDEX: "0"}


def _template(template: dict, labels: dict[str, str], annotations: dict[str, str]) -> dict:
    meta = template.get("metadata") or {}
    return {
        **template,
        "metadata": {
            **meta,
            "labels": {**(meta.get("labels") or {}), **labels},
            "annotations": {**(meta.get("annotations") or {}), **annotations},
        },
    }


def leader_statefulset(lws: dict) -> dict:
    """The leader StatefulSet of a LeaderWorkerSet, owned by it."""
    meta, spec = lws["metadata"], lws["spec"]
    templates = spec["leaderWorkerTemplate"]
    name, revision = meta["name"], revision_of(lws)
    labels = {**leader_selector(name), REVISION: revision}
    template = templates.get("leaderTemplate") or templates["workerTemplate"]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": {NAME: name, REVISION: revision},
            "annotations": {REPLICAS: str(spec.get("replicas", 1))},
            "ownerReferences": [owner_reference(lws)],
        },
        "spec": {
            "replicas": spec.get("replicas", 1),
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": leader_selector(name)},
            "template": _template(template, labels, {SIZE: str(group_size(lws))}),
        },
    }


def worker_statefulset(lws: dict, leader: dict) -> dict:
    """The worker StatefulSet of the group `leader` leads, owned by the leader pod."""
    name = lws["metadata"]["name"]
    leader_meta = leader["metadata"]
    group = {
        NAME: name,
        GROUP_INDEX: leader_meta["labels"][GROUP_INDEX],
        GROUP_KEY: leader_meta["labels"][GROUP_KEY],
    }
    labels = {**group, REVISION: leader_meta["labels"].get(REVISION, "")}
    annotations = {SIZE: str(group_size(lws)), LEADER_NAME: leader_meta["name"]}
    template = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": leader_meta["name"],
            "namespace": leader_meta["namespace"],
            "labels": labels,
            "ownerReferences": [owner_reference(leader)],
        },
        "spec": {
            "replicas": group_size(lws) - 1,
            "ordinals": {"start": 1},
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": group},
            "template": _template(template, labels, annotations),
        },
    }


def admit_pod(pod: dict) -> None:
    """The LWS pod webhook on a pod of a LeaderWorkerSet's StatefulSets (mutates in place)."""
    meta = pod["metadata"]
    labels = meta.setdefault("labels", {})
    lws = labels.get(NAME)
    if not lws:
        return
    annotations = meta.setdefault("annotations", {})
    name, namespace = meta["name"], meta["namespace"]
    if labels.get(WORKER_INDEX) == "0":  # the leader StatefulSet's template says so
        leader, index = name, "0"
        labels[GROUP_INDEX] = name.rsplit("-", 1)[1]
        labels[GROUP_KEY] = group_key(namespace, name)
    else:
        leader, index = name.rsplit("-", 1)
        labels[WORKER_INDEX] = index
        annotations[LEADER_NAME] = leader
    spec = pod["spec"]
    spec["hostname"], spec["subdomain"] = name, lws
    env = [
        {"name": LEADER_ADDRESS_ENV, "value": f"{leader}.{lws}.{namespace}"},
        {"name": GROUP_SIZE_ENV, "value": annotations.get(SIZE, "1")},
        {"name": WORKER_INDEX_ENV, "value": index},
    ]
    for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        own = container.get("env") or []
        taken = {var["name"] for var in own}
        container["env"] = [var for var in env if var["name"] not in taken] + own


def restarted(pod: dict) -> bool:
    status = pod.get("status") or {}
    containers = [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]
    return any(c.get("restartCount", 0) > 0 for c in containers)


def group_status(lws: dict, leaders: list[dict], workers: dict[str, dict | None]) -> dict:
    """The LeaderWorkerSet's status from its leader pods and each one's worker StatefulSet."""
    size = group_size(lws)
    ready = sum(
        1
        for leader in leaders
        if is_ready(leader)
        and (
            size == 1
            or ((workers.get(leader["metadata"]["name"]) or {}).get("status") or {}).get(
                "readyReplicas", 0
            )
            == size - 1
        )
    )
    wanted = lws["spec"].get("replicas", 1)
    name = lws["metadata"]["name"]
    available = ready == wanted
    return {
        "replicas": len(leaders),
        "readyReplicas": ready,
        "updatedReplicas": len(leaders),
        "hpaPodSelector": ",".join(f"{k}={v}" for k, v in leader_selector(name).items()),
        "conditions": [
            {
                "type": "Available",
                "status": "True" if available else "False",
                "reason": "AllGroupsReady" if available else "GroupsNotReady",
                "message": f"{ready} of {wanted} groups ready",
            }
        ],
    }


# --- the controller ------------------------------------------------------------------------


class LeaderWorkerSetController:
    """Installed with the lab's controller-manager; idle until the CRD is there."""

    def __init__(self, api: LabApi) -> None:
        self.api = api

    @property
    def installed(self) -> bool:
        return LEADER_WORKER_SETS in self.api.resources

    def webhook(self, pod: dict) -> None:
        if self.installed:
            admit_pod(pod)

    async def sync(self) -> None:
        if not self.installed:
            return
        for lws in self.api.list(LEADER_WORKER_SETS):
            if not lws["metadata"].get("deletionTimestamp"):
                await self.sync_one(lws)

    async def sync_one(self, lws: dict) -> None:
        meta = lws["metadata"]
        ns, name = meta["namespace"], meta["name"]
        leaders_set = await self._leader_statefulset(lws)
        if leaders_set is None:
            return
        pods = [
            p
            for p in self.api.list(PODS, ns)
            if (p["metadata"].get("labels") or {}).get(NAME) == name
        ]
        if (
            lws["spec"]["leaderWorkerTemplate"].get("restartPolicy", RECREATE_GROUP)
            == RECREATE_GROUP
        ):
            for pod in pods:
                await self._recreate_group_of(pod, leaders_set)
        leaders = [
            p for p in self.api.list(PODS, ns) if controller_of(p) == leaders_set["metadata"]["uid"]
        ]
        workers = {}
        for leader in leaders:
            workers[leader["metadata"]["name"]] = await self._worker_statefulset(lws, leader)
        live = [p for p in leaders if is_active(p)]
        await write_status(self.api, LEADER_WORKER_SETS, lws, group_status(lws, live, workers))

    async def _leader_statefulset(self, lws: dict) -> dict | None:
        """Create or update the leader StatefulSet; None when another owner holds the name."""
        meta = lws["metadata"]
        wanted = leader_statefulset(lws)
        current = self.api.get(STATEFULSETS, meta["namespace"], meta["name"])
        if current is None:
            return await self.api.create(STATEFULSETS, meta["namespace"], wanted)
        if controller_of(current) != meta["uid"]:
            return None

        def update(old: dict) -> dict:
            old["metadata"]["labels"] = wanted["metadata"]["labels"]
            old["metadata"]["annotations"] = wanted["metadata"]["annotations"]
            old["spec"].update(
                {k: wanted["spec"][k] for k in ("replicas", "template", "serviceName")}
            )
            return old

        return await self.api.update(STATEFULSETS, meta["namespace"], meta["name"], update)

    async def _worker_statefulset(self, lws: dict, leader: dict) -> dict | None:
        meta = leader["metadata"]
        if group_size(lws) == 1 or not is_active(leader):
            return None
        found = self.api.get(STATEFULSETS, meta["namespace"], meta["name"])
        if found is not None:
            return found
        if lws["spec"].get("startupPolicy") == "LeaderReady" and not is_ready(leader):
            return None
        return await self.api.create(
            STATEFULSETS, meta["namespace"], worker_statefulset(lws, leader)
        )

    async def _recreate_group_of(self, pod: dict, leaders_set: dict) -> None:
        """RecreateGroupOnPodRestart: delete the group's leader when one of its pods restarted
        or is going. A worker counts only while its StatefulSet is the current leader's: the
        lab's API removes a running pod without waiting for its dependents (no foreground
        deletion of pods), so the workers of a group just torn down outlive their leader and
        must not tear down the new one."""
        meta = pod["metadata"]
        if not restarted(pod) and not meta.get("deletionTimestamp"):
            return
        ns = meta["namespace"]
        if meta["labels"].get(WORKER_INDEX) == "0":
            leader = pod
        else:
            leader = self.api.get(PODS, ns, meta["annotations"].get(LEADER_NAME, ""))
            owner = next(
                (
                    s
                    for s in self.api.list(STATEFULSETS, ns)
                    if s["metadata"]["uid"] == controller_of(pod)
                ),
                None,
            )
            if leader is None or owner is None or controller_of(owner) != leader["metadata"]["uid"]:
                return
        if controller_of(leader) != leaders_set["metadata"]["uid"]:
            return
        if leader["metadata"].get("deletionTimestamp"):
            return
        await self.api.delete(PODS, ns, leader["metadata"]["name"], "Foreground")
