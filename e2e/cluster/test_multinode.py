"""Scenarios of a multi-node pool (`nodes: 2`): the operator's LeaderWorkerSet runs as two pods
with their own IPs, the worker joins the Ray head its group's leader started, and the pods'
NetworkPolicies let through what Ray uses between them."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from pagefleet.operator.reconcile import (
    ENGINE_API_KEY,
    FLEET_SECRET_KEY,
    RAY_GCS_PORT,
    desired_objects,
)

from .conftest import open_lab
from .fleet import (
    CPU_ENGINE_ARGS,
    assert_serves_as_offline,
    crash_loop,
    in_pod,
    md_pods,
    policy_check,
    prepare_namespace,
    ready,
    router_pods,
    router_url,
    simulated_deployment,
    start_operator,
)
from .lws import CRD as LWS_CRD
from .net import running

NAMESPACE, NAME, POOL = "serving", "big", "colocated"
GROUP = f"{NAME}-{POOL}"  # the LeaderWorkerSet, its leader StatefulSet and headless Service
LEADER, WORKER = f"{GROUP}-0", f"{GROUP}-0-1"
# Inside the leader pod, with its environment (RAY_ADDRESS: its own head): the Ray nodes that
# are alive, by address, as a driver of the cluster sees them.
RAY_NODES = (
    "import json, ray; ray.init(logging_level='ERROR'); "
    "print('NODES', json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
)


def multi_node_deployment() -> dict:
    """A CPU ModelDeployment whose one engine spans two pods (tensor parallel 2 over Ray)."""
    pool = {"replicas": 1, "nodes": 2, "tensorParallelSize": 2}
    md = simulated_deployment(NAME, NAMESPACE, pool)
    md["spec"]["engineArgs"] = dict(CPU_ENGINE_ARGS)  # a real forward pass, on CPU
    md["spec"]["pools"] = {POOL: md["spec"]["pools"].pop("colocated")}
    return md


def rendered_without_engine(md: dict) -> list[dict]:
    """What the operator renders for `md` (its pure reconcile) but the router, standing alone
    (no owner), the fleet Secret filled as the operator fills it, and the leader holding its Ray
    head under `sleep` where it would exec the engine."""
    objects = desired_objects({**md, "metadata": {**md["metadata"], "uid": "none"}})
    objects = [o for o in objects if o["kind"] != "Deployment"]  # the router's
    for obj in objects:
        obj["metadata"].pop("ownerReferences", None)
        if obj["kind"] == "Secret":
            obj["stringData"] = {FLEET_SECRET_KEY: "fleet", ENGINE_API_KEY: "engine"}
        if obj["kind"] == "LeaderWorkerSet":
            leader = obj["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
            shell = leader["containers"][0]["command"]
            head, _, _serve = shell[2].partition(" && exec ")
            shell[2] = f"{head} && exec sleep 100000"
    return objects


def ray_nodes(lab, leader: dict) -> list[str]:
    code, out = lab.exec(leader, ["python", "-c", RAY_NODES], timeout=90)
    lines = [line for line in out.splitlines() if line.startswith("NODES ")]
    assert code == 0 and lines, out[-2000:]
    return json.loads(lines[-1].removeprefix("NODES "))


def pids_in(netns: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if running(pid)}


def group_pods(lab) -> dict[str, dict]:
    pods = lab.kube.pods(NAMESPACE, f"leaderworkerset.sigs.k8s.io/name={GROUP}")
    return {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


def test_the_leader_and_worker_commands_form_one_ray_cluster_across_two_pods(tmp_path, model_store):
    """The operator's LeaderWorkerSet for `nodes: 2` (its Ray commands, env, ports, sysctls
    and headless Service as rendered): the leader pod starts the Ray head on its pod IP, the
    worker pod waits for it through LWS_LEADER_ADDRESS (cluster DNS) and joins; a driver in
    the leader pod sees two Ray nodes, the two pod IPs. The connections Ray holds between the
    pods are ones the operator's NetworkPolicies allow. Every Ray process goes with its pod."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NAMESPACE)
        lab.kube.create(LWS_CRD)
        for obj in rendered_without_engine(multi_node_deployment()):
            lab.kube.create(obj)

        def joined():
            pods = group_pods(lab)
            for pod in pods.values():
                crash_loop(lab, pod, restarts=1)
            running = {n: p for n, p in pods.items() if p["status"].get("phase") == "Running"}
            return set(running) == {LEADER, WORKER} and running

        pods = lab.wait_for(joined, 90, "the leader and worker pods running")
        leader, worker = pods[LEADER], pods[WORKER]
        ips = sorted([leader["status"]["podIP"], worker["status"]["podIP"]])
        assert ips[0] != ips[1]
        address = f"{LEADER}.{GROUP}.{NAMESPACE}"
        env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
        assert env["LWS_LEADER_ADDRESS"] == address
        joins = f"--address=$(LWS_LEADER_ADDRESS):{RAY_GCS_PORT}"
        assert joins in worker["spec"]["containers"][0]["command"][2]
        lab.wait_for(lambda: ray_nodes(lab, leader) == ips, 120, "two Ray nodes: the pod IPs")
        # The port range the policies open for torch.distributed is the one the kernel uses.
        port_range = Path("/proc/sys/net/ipv4/ip_local_port_range")
        assert in_pod(lab, worker, port_range.read_text).split() == ["32768", "60999"]
        connections, dropped = policy_check(lab, NAMESPACE)
        assert not dropped, (dropped, connections)
        to_head = {c.port for c in connections if (c.client, c.server) == (WORKER, LEADER)}
        assert RAY_GCS_PORT in to_head, connections
        netns = [lab.network.pod_netns[p["metadata"]["uid"]] for p in (leader, worker)]
        ray_processes = set().union(*(pids_in(n) for n in netns))
        assert len(ray_processes) > 4, ray_processes  # the heads, raylets, agents, sleep
    assert not lab.leftovers(), lab.leftovers()
    assert not alive(ray_processes), alive(ray_processes)


def test_one_engine_across_two_pods_serves_through_the_router(tmp_path, model_store, offline):
    """The operator's multi-node pool as a user runs it: the LeaderWorkerSet's leader starts
    the Ray head and `pagefleet serve --tensor-parallel-size 2 --distributed-executor-backend
    ray`, whose rank 1 runs as a Ray actor on the worker pod (another pod IP); the router knows
    the leader only and answers the offline engine's greedy text; every connection between the
    pods (Ray, torch.distributed's store, gloo) is one the operator's policies allow."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NAMESPACE)
        lab.kube.create(LWS_CRD)
        start_operator(lab)
        md = multi_node_deployment()
        md["spec"]["model"] = {"name": "tiny", "pvc": {"claimName": "models", "path": "tiny"}}
        lab.kube.create(md)

        def leader_ready():
            pods = group_pods(lab)
            for pod in pods.values():
                crash_loop(lab, pod)
            leader = pods.get(LEADER)
            return leader if leader and ready([leader]) and WORKER in pods else None

        leader = lab.wait_for(leader_ready, 300, "the multi-node engine ready")
        worker = group_pods(lab)[WORKER]
        log = lab.pod_log(leader)
        worker_ip = worker["status"]["podIP"]
        assert "tensor-parallel rank 1 runs on Ray node" in log, log[-3000:]
        (placed,) = re.findall(r"tensor-parallel rank 1 runs on Ray node \w+ \(([\d.]+),", log)
        assert placed == worker_ip != leader["status"]["podIP"]
        # Both pods of the group are engine pods (component engine); one engine serves.
        lab.wait_for(
            lambda: ready(md_pods(lab, NAMESPACE, NAME, "router")), 120, "the router ready"
        )
        url = router_url(lab, NAMESPACE, NAME)
        lab.wait_for(lambda: router_pods(lab, url) == {LEADER}, 60, "the router to know the leader")
        assert_serves_as_offline(lab, url, "tiny", offline)
        assert router_pods(lab, url) == {LEADER}  # never the worker pod
        connections, dropped = policy_check(lab, NAMESPACE)
        assert not dropped, (dropped, connections)
        between = {c.port for c in connections if {c.client, c.server} == {WORKER, LEADER}}
        assert RAY_GCS_PORT in between, connections
    assert not lab.leftovers(), lab.leftovers()
