"""The lab's LeaderWorkerSet and StatefulSet controllers: what the LWS release and
kube-controller-manager do for a multi-node pool (names, labels, env, DNS between the group's
pods, ownership, scaling, group recreation, garbage collection)."""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import textwrap

from .dns import answer, hosts_file, records, resolv_conf
from .lws import CRD, admit_pod

IMAGE = "ghcr.io/pagefleet/pagefleet:test"
LWS = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
STS = ("apps/v1", "StatefulSet")
# Every pod of a group resolves its leader's address (as a worker joining the leader's Ray head
# must), prints what it learnt, then stays.
GROUP_MEMBER = textwrap.dedent(
    """
    import os, socket, time
    leader = os.environ["LWS_LEADER_ADDRESS"]
    while True:
        try:
            ip = socket.gethostbyname(leader)
            break
        except OSError:
            time.sleep(0.2)
    print("member", leader, ip, os.environ["LWS_GROUP_SIZE"], os.environ["LWS_WORKER_INDEX"],
          socket.gethostname(), os.environ["MINE"], os.environ["POD_UID"], flush=True)
    time.sleep(100000)
    """
)


def template(role: str) -> dict:
    return {
        "metadata": {"labels": {"app": "grp", "role": role}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "command": ["python", "-c", GROUP_MEMBER],
                    # The pod's own variables come after LWS's, so they may use them.
                    "env": [
                        {"name": "MINE", "value": "$(LWS_WORKER_INDEX)-of-$(LWS_GROUP_SIZE)"},
                        {
                            "name": "POD_UID",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}},
                        },
                    ],
                }
            ],
        },
    }


def leader_worker_set(replicas: int, size: int, **template_fields) -> dict:
    return {
        "apiVersion": LWS[0],
        "kind": LWS[1],
        "metadata": {"name": "grp", "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template("leader"),
                "workerTemplate": template("worker"),
                **template_fields,
            },
        },
    }


def leaders_service() -> dict:
    """What the operator makes beside its LeaderWorkerSet: a headless Service named like it,
    selecting the leaders, published before they are ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "grp", "namespace": "default"},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {
                "leaderworkerset.sigs.k8s.io/name": "grp",
                "leaderworkerset.sigs.k8s.io/worker-index": "0",
            },
            "ports": [{"name": "http", "port": 8000}],
        },
    }


def group_pods(lab) -> dict[str, dict]:
    return {
        p["metadata"]["name"]: p
        for p in lab.kube.pods("default", "leaderworkerset.sigs.k8s.io/name=grp")
        if not p["metadata"].get("deletionTimestamp")
    }


def members(lab) -> dict[str, list[str]]:
    """What each pod of the LWS printed (its `member` line; a pod's log file outlives it, and
    the pod that replaces it has its name: the line must carry this pod's uid), by pod name."""
    out = {}
    for name, pod in group_pods(lab).items():
        lines = [line.split()[1:] for line in lab.pod_log(pod).splitlines() if "member " in line]
        mine = [w[:-1] for w in lines if len(w) == 7 and w[-1] == pod["metadata"]["uid"]]
        if mine:
            out[name] = mine[-1]
    return out


def wait_groups(lab, names: set[str]) -> dict[str, list[str]]:
    return lab.wait_for(
        lambda: (m := members(lab)) and set(m) == names and set(group_pods(lab)) == names and m,
        60,
        f"pods {sorted(names)} resolving their leader",
    )


def uids(lab) -> dict[str, str]:
    return {n: p["metadata"]["uid"] for n, p in group_pods(lab).items()}


def controller(obj: dict) -> tuple[str, str]:
    (ref,) = [r for r in obj["metadata"]["ownerReferences"] if r.get("controller")]
    return ref["kind"], ref["name"]


# --- pure parts ----------------------------------------------------------------------------


def test_the_webhook_names_a_group_as_the_lws_webhook_does():
    """Labels, hostname/subdomain and the three variables (first, the pod's own after them,
    never overriding one the pod sets) of a leader and a worker; LWS's own test values."""
    leader = {
        "metadata": {
            "name": "test-sample-1",
            "namespace": "default",
            "labels": {
                "leaderworkerset.sigs.k8s.io/name": "test-sample",
                "leaderworkerset.sigs.k8s.io/worker-index": "0",
            },
            "annotations": {"leaderworkerset.sigs.k8s.io/size": "4"},
        },
        "spec": {"containers": [{"name": "c", "env": [{"name": "A", "value": "1"}]}]},
    }
    admit_pod(leader)
    labels = leader["metadata"]["labels"]
    assert labels["leaderworkerset.sigs.k8s.io/group-index"] == "1"
    key = hashlib.sha1(b"default/test-sample-1").hexdigest()
    assert labels["leaderworkerset.sigs.k8s.io/group-key"] == key
    assert (leader["spec"]["hostname"], leader["spec"]["subdomain"]) == (
        "test-sample-1",
        "test-sample",
    )
    assert leader["spec"]["containers"][0]["env"] == [
        {"name": "LWS_LEADER_ADDRESS", "value": "test-sample-1.test-sample.default"},
        {"name": "LWS_GROUP_SIZE", "value": "4"},
        {"name": "LWS_WORKER_INDEX", "value": "0"},
        {"name": "A", "value": "1"},
    ]
    worker = {
        "metadata": {
            "name": "test-sample-1-3",
            "namespace": "default",
            "labels": {"leaderworkerset.sigs.k8s.io/name": "test-sample"},
            "annotations": {"leaderworkerset.sigs.k8s.io/size": "4"},
        },
        "spec": {
            "initContainers": [{"name": "i"}],
            "containers": [{"name": "c", "env": [{"name": "LWS_GROUP_SIZE", "value": "9"}]}],
        },
    }
    admit_pod(worker)
    assert worker["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "3"
    assert worker["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/leader-name"] == (
        "test-sample-1"
    )
    assert worker["spec"]["hostname"] == "test-sample-1-3"
    assert worker["spec"]["initContainers"][0]["env"][0]["value"] == (
        "test-sample-1.test-sample.default"
    )
    assert [v["name"] for v in worker["spec"]["containers"][0]["env"]] == [
        "LWS_LEADER_ADDRESS",
        "LWS_WORKER_INDEX",
        "LWS_GROUP_SIZE",  # the pod's own value stays
    ]
    assert worker["spec"]["containers"][0]["env"][2]["value"] == "9"
    untouched = {"metadata": {"name": "x", "namespace": "d"}, "spec": {"containers": [{}]}}
    admit_pod(untouched)
    assert untouched["spec"] == {"containers": [{}]}


def test_cluster_dns_answers_headless_service_pods_and_nothing_else():
    """The kubelet's hosts file and resolv.conf of a pod with a subdomain, and the DNS
    server's answers: A records of headless Services' pods and ready addresses, NXDOMAIN for
    other names, FORMERR for what is not one question, no answer to responses or junk."""
    pod = {
        "metadata": {"name": "grp-0-1", "namespace": "ns"},
        "spec": {"hostname": "grp-0-1", "subdomain": "grp"},
    }
    assert hosts_file(pod, "10.88.0.6").endswith(
        "10.88.0.6\tgrp-0-1.grp.ns.svc.cluster.local grp-0-1\n"
    )
    assert resolv_conf("ns", "10.88.0.1") == (
        "nameserver 10.88.0.1\nsearch ns.svc.cluster.local svc.cluster.local cluster.local\n"
        "options ndots:5\n"
    )
    endpoints = [
        {
            "metadata": {"name": "grp", "namespace": "ns"},
            "subsets": [
                {"addresses": [{"ip": "10.88.0.5", "hostname": "grp-0"}, {"ip": "10.88.0.7"}]}
            ],
        },
        {
            "metadata": {"name": "web", "namespace": "ns"},
            "subsets": [{"addresses": [{"ip": "1.2.3.4"}]}],
        },
    ]
    table = records(endpoints, {("ns", "grp")})  # web has a ClusterIP: not named here
    assert table == {
        "grp.ns.svc.cluster.local": ["10.88.0.5", "10.88.0.7"],
        "grp-0.grp.ns.svc.cluster.local": ["10.88.0.5"],
    }

    def query(name: str, qtype: int = 1, ident: int = 7, flags: int = 0x0100) -> bytes:
        labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
        return (
            struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0)
            + labels
            + b"\0"
            + struct.pack("!HH", qtype, 1)
        )

    found = answer(query("GRP-0.grp.ns.svc.cluster.local"), table.get)
    ident, flags, _, count = struct.unpack("!HHHH", found[:8])
    assert (ident, flags & 0xF, count) == (7, 0, 1)
    assert found.endswith(bytes([10, 88, 0, 5]))
    aaaa = answer(query("grp-0.grp.ns.svc.cluster.local", qtype=28), table.get)
    assert struct.unpack("!HH", aaaa[2:4] + aaaa[6:8]) == (0x8580, 0)  # name exists, no AAAA
    missing = answer(query("grp-0.grp.ns.ns.svc.cluster.local"), table.get)
    assert struct.unpack("!H", missing[2:4])[0] & 0xF == 3  # the search path tries on
    assert struct.unpack("!H", answer(b"\0\1\1\0\0\2" + bytes(6), table.get)[2:4])[0] & 0xF == 1
    assert answer(query("x", flags=0x8000), table.get) is None
    assert answer(b"short", table.get) is None
    bad_label = query("a")[:12] + b"\xc0\x0c" + bytes(4)
    assert struct.unpack("!H", answer(bad_label, table.get)[2:4])[0] & 0xF == 1


# --- in the lab ----------------------------------------------------------------------------


def test_leader_worker_set_forms_groups_that_find_their_leader(lab):
    """Two groups of three: the leader StatefulSet and one worker StatefulSet per group with
    LWS's names, labels and owners; every pod resolves LWS_LEADER_ADDRESS to its own group's
    leader (cluster DNS through the headless Service) and sees its index and the group size;
    the status counts ready groups; the scale subresource moves groups."""
    lab.kube.create(CRD)
    lab.kube.create(leaders_service())
    lab.kube.create(leader_worker_set(replicas=2, size=3))
    names = {"grp-0", "grp-0-1", "grp-0-2", "grp-1", "grp-1-1", "grp-1-2"}
    seen = wait_groups(lab, names)
    pods = group_pods(lab)
    for name, (address, ip, size, index, hostname, mine) in seen.items():
        leader = name if name.count("-") == 1 else name.rsplit("-", 1)[0]
        assert address == f"{leader}.grp.default"
        assert ip == pods[leader]["status"]["podIP"]
        assert (size, hostname) == ("3", name)
        assert index == ("0" if leader == name else name.rsplit("-", 1)[1])
        assert mine == f"{index}-of-3"
        labels = pods[name]["metadata"]["labels"]
        assert labels["leaderworkerset.sigs.k8s.io/group-index"] == leader.split("-")[1]
        assert labels["leaderworkerset.sigs.k8s.io/worker-index"] == index
        assert labels["leaderworkerset.sigs.k8s.io/group-key"] == (
            hashlib.sha1(f"default/{leader}".encode()).hexdigest()
        )
        assert labels["role"] == ("leader" if leader == name else "worker")
        assert controller(pods[name]) == ("StatefulSet", leader if leader != name else "grp")
    assert controller(lab.kube.get(*STS, "default", "grp")) == ("LeaderWorkerSet", "grp")
    for group in ("grp-0", "grp-1"):
        workers = lab.kube.get(*STS, "default", group)
        assert controller(workers) == ("Pod", group)
        assert workers["spec"]["replicas"] == 2
    status = lab.wait_for(
        lambda: (
            (s := lab.kube.get(*LWS, "default", "grp").get("status"))
            and s.get("readyReplicas") == 2
            and s
        ),
        30,
        "two ready groups",
    )
    assert status["hpaPodSelector"] == (
        "leaderworkerset.sigs.k8s.io/name=grp,leaderworkerset.sigs.k8s.io/worker-index=0"
    )
    lws = lab.kube.get(*LWS, "default", "grp")
    lab.kube.patch(lws, {"spec": {"replicas": 1}}, "scale")
    lab.wait_for(lambda: set(group_pods(lab)) == {"grp-0", "grp-0-1", "grp-0-2"}, 30, "one group")
    lab.wait_for(lambda: lab.kube.get(*STS, "default", "grp-1") is None, 30, "grp-1's workers gone")
    lab.kube.patch(lws, {"spec": {"replicas": 2}}, "scale")
    wait_groups(lab, names)


def test_a_restarted_or_deleted_pod_recreates_its_whole_group_only(lab):
    """RecreateGroupOnPodRestart: a worker whose process dies (a container restart) takes its
    leader and the other worker down and the group comes back as new pods under the same names;
    so does a deleted worker; the other group is untouched. Deleting the LeaderWorkerSet
    removes its StatefulSets and pods."""
    lab.kube.create(CRD)
    lab.kube.create(leaders_service())
    lab.kube.create(leader_worker_set(replicas=2, size=3))
    names = {"grp-0", "grp-0-1", "grp-0-2", "grp-1", "grp-1-1", "grp-1-2"}
    wait_groups(lab, names)
    before = uids(lab)
    worker = group_pods(lab)["grp-1-2"]
    pid = int(worker["status"]["containerStatuses"][0]["containerID"].removeprefix("lab://"))
    os.kill(pid, signal.SIGKILL)

    def group_1_renewed():
        now = uids(lab)
        renewed = {n for n in now if now[n] != before.get(n)}
        return set(now) == names and renewed == {"grp-1", "grp-1-1", "grp-1-2"} and now

    after = lab.wait_for(group_1_renewed, 60, "group 1 recreated")
    wait_groups(lab, names)
    assert {n: after[n] for n in ("grp-0", "grp-0-1", "grp-0-2")} == {
        n: before[n] for n in ("grp-0", "grp-0-1", "grp-0-2")
    }
    lab.kube.delete("v1", "Pod", "default", "grp-0-1")
    lab.wait_for(
        lambda: (
            all(uids(lab).get(n) not in {before[n], None} for n in ("grp-0", "grp-0-2"))
            and set(uids(lab)) == names
        ),
        60,
        "group 0 recreated",
    )
    wait_groups(lab, names)
    assert {n: u for n, u in uids(lab).items() if n.startswith("grp-1")} == {
        n: after[n] for n in ("grp-1", "grp-1-1", "grp-1-2")
    }
    lab.kube.delete(*LWS, "default", "grp")
    lab.wait_for(
        lambda: (
            not lab.kube.pods("default", "leaderworkerset.sigs.k8s.io/name=grp")
            and not lab.kube.list(*STS, "default")
        ),
        60,
        "the LeaderWorkerSet's StatefulSets and pods gone",
    )


def test_statefulset_names_pods_by_ordinal_and_replaces_them(lab):
    """OrderedReady: `<set>-0` then `<set>-1`, each with its hostname and the set's Service as
    subdomain; a deleted pod comes back under its name; scaling down removes the highest."""
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "serviceName": "web",
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": IMAGE,
                            "command": ["python", "-c", "import time; time.sleep(100000)"],
                        }
                    ],
                },
            },
        },
    }
    lab.kube.create(sts)

    def running(expected: set[str]):
        pods = {
            p["metadata"]["name"]: p
            for p in lab.kube.ready_pods("default", "app=web")
            if p["status"].get("phase") == "Running"
        }
        every = {p["metadata"]["name"] for p in lab.kube.pods("default", "app=web")}
        return set(pods) == every == expected and pods

    pods = lab.wait_for(lambda: running({"web-0", "web-1"}), 30, "web-0 and web-1")
    first = pods["web-0"]
    assert (first["spec"]["hostname"], first["spec"]["subdomain"]) == ("web-0", "web")
    assert first["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "0"
    # OrderedReady: web-1 was made only once web-0 was Ready.
    assert (
        pods["web-1"]["metadata"]["creationTimestamp"]
        >= (first["status"]["conditions"][-1]["lastTransitionTime"])
    )
    lab.kube.delete("v1", "Pod", "default", "web-1")
    again = lab.wait_for(
        lambda: (
            (p := running({"web-0", "web-1"}))
            and p["web-1"]["metadata"]["uid"] != pods["web-1"]["metadata"]["uid"]
            and p
        ),
        30,
        "web-1 back",
    )
    assert again["web-0"]["metadata"]["uid"] == first["metadata"]["uid"]
    lab.kube.patch(lab.kube.get(*STS, "default", "web"), {"spec": {"replicas": 1}}, "scale")
    lab.wait_for(lambda: running({"web-0"}), 30, "web-1 removed")
    status = lab.wait_for(
        lambda: (s := lab.kube.get(*STS, "default", "web")["status"]).get("replicas") == 1 and s,
        30,
        "status",
    )
    assert status["readyReplicas"] == 1
