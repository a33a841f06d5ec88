"""A pool's parallelism (issue 18): tensorParallelSize and nodes decide the engine flags, the
pod's GPUs (checked, never invented), /dev/shm, and whether the pool is a Deployment or a
LeaderWorkerSet of Ray groups; what they refuse; what retires when a pool changes kind; and
every object of the multi-node variants valid (kubernetes-validate, the closed LWS schema)."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from lws_schema import validate_leader_worker_set

from pagefleet.operator.reconcile import (
    EngineImages,
    RenderOptions,
    desired_objects,
    retired_objects,
)
from pagefleet.operator.spec import SpecError, parse_spec
from pagefleet.operator.status import Observed, PoolObserved, build_status

KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
PROMETHEUS = "http://prometheus.monitoring.svc:9090"
IMAGES = EngineImages("registry.test/engine:cpu", "registry.test/engine:cuda")
PVC_MODEL = {"name": "m", "pvc": {"claimName": "models", "path": "m"}}
LWS = "LeaderWorkerSet"


def gpus(count: int) -> dict:
    return {"limits": {"nvidia.com/gpu": count}, "requests": {"nvidia.com/gpu": count}}


def md(pool: dict | None = None, name: str = "md", **spec: Any) -> dict:
    pools = spec.pop("pools", {"colocated": pool or {}})
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": "serving", "uid": "uid-1"},
        "spec": {"model": PVC_MODEL, "pools": pools, **spec},
    }


def render(model_deployment: dict) -> list[dict]:
    return desired_objects(
        model_deployment, RenderOptions(images=IMAGES, prometheus_url=PROMETHEUS)
    )


def find(objects: list[dict], kind: str, name: str = "md-colocated") -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def group_pods(objects: list[dict], name: str = "md-colocated") -> tuple[dict, dict]:
    """(leader, worker) pod specs of a multi-node pool's LeaderWorkerSet."""
    template = find(objects, LWS, name)["spec"]["leaderWorkerTemplate"]
    return template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]


def command_of(pod_spec: dict) -> list[str]:
    return pod_spec["containers"][0]["command"]


def refused(model_deployment: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        render(model_deployment)


# The engine flags


def test_tensor_parallel_size_sets_the_engines_flags_and_one_node_uses_processes():
    one = command_of(
        find(render(md({"resources": gpus(2), "tensorParallelSize": 2})), "Deployment")["spec"][
            "template"
        ]["spec"]
    )
    assert one[one.index("--tensor-parallel-size") + 1] == "2"
    assert one[one.index("--distributed-executor-backend") + 1] == "mp"
    plain = command_of(
        find(render(md({"resources": gpus(1)})), "Deployment")["spec"]["template"]["spec"]
    )
    assert "--tensor-parallel-size" not in plain and "--distributed-executor-backend" not in plain


@pytest.mark.parametrize(
    ("where", "flag", "match"),
    [
        (
            "spec",
            "tensor-parallel-size",
            r"^spec\.engineArgs\.tensor-parallel-size: set the pool's tensorParallelSize",
        ),
        (
            "pool",
            "tensor-parallel-size",
            r"^spec\.pools\.colocated\.engineArgs\.tensor-parallel-size: set",
        ),
        ("pool", "pipeline-parallel-size", "pipeline parallelism is not offered"),
        ("spec", "distributed-executor-backend", "mp for the ranks of one pod, ray when"),
    ],
)
def test_parallelism_in_engine_args_is_refused_with_the_field_to_use(where, flag, match):
    """One place decides each flag: an engineArgs copy could disagree with the pod's GPUs."""
    if where == "spec":
        refused(md(engineArgs={flag: 2}), match)
    else:
        refused(md({"engineArgs": {flag: 2}}), match)


# GPUs per pod: GPU pools are those that request nvidia.com/gpu


@pytest.mark.parametrize(
    ("pool", "match"),
    [
        ({"resources": gpus(1), "tensorParallelSize": 2}, "1 nvidia.com/gpu per pod x 1 node"),
        (
            {"resources": gpus(4), "tensorParallelSize": 4, "nodes": 2},
            "4 nvidia.com/gpu per pod x 2 node",
        ),
        ({"tensorParallelSize": 3, "nodes": 2}, "tensorParallelSize must be a multiple of nodes"),
        ({"nodes": 0}, "nodes must be an integer >= 1"),
        (
            {
                "resources": {"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 1}},
                "tensorParallelSize": 2,
            },
            "limits and requests must be equal",
        ),
    ],
)
def test_gpus_disagreeing_with_the_ranks_are_refused(pool, match):
    refused(md(pool), match)


def test_a_pool_without_gpus_runs_its_ranks_on_cpu_and_gets_no_gpus_added():
    """The rule: a pool is a GPU pool when it requests nvidia.com/gpu; the operator never
    adds GPUs from tensorParallelSize (a CPU pool with TP runs gloo ranks)."""
    objects = render(md({"tensorParallelSize": 2, "nodes": 2}))
    leader, worker = group_pods(objects)
    for pod in (leader, worker):
        container = pod["containers"][0]
        assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {}))
        assert container["image"] == IMAGES.cpu
        assert "--num-gpus=0" in container["command"][2]
    assert "--device cpu" in command_of(leader)[2]
    single = find(render(md({"tensorParallelSize": 2})), "Deployment")
    assert "resources" not in single["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("pool", "shm"),
    [
        ({}, "2Gi"),
        ({"tensorParallelSize": 2}, "2Gi"),  # CPU ranks: no NCCL buffers
        ({"resources": gpus(1)}, "2Gi"),
        ({"resources": gpus(4), "tensorParallelSize": 4}, "8Gi"),
        ({"tensorParallelSize": 2, "nodes": 2}, "3Gi"),  # + Ray's object store
        ({"resources": gpus(8), "tensorParallelSize": 16, "nodes": 2}, "17Gi"),
        ({"resources": gpus(4), "tensorParallelSize": 4, "shmSize": "1Gi"}, "1Gi"),
    ],
)
def test_shm_grows_with_the_pods_gpus_and_ray_unless_the_pool_sets_it(pool, shm):
    (spec,) = parse_spec(md(pool)["spec"]).pools
    assert spec.shm_size == shm
    objects = render(md(pool))
    pods = (
        group_pods(objects)
        if spec.multi_node
        else (find(objects, "Deployment")["spec"]["template"]["spec"],)
    )
    for pod in pods:
        (volume,) = [v for v in pod["volumes"] if v["name"] == "shm"]
        assert volume["emptyDir"]["sizeLimit"] == shm


# Multi-node pools: a LeaderWorkerSet


def test_a_multi_node_pool_is_a_leader_worker_set_and_no_deployment():
    objects = render(md({"resources": gpus(2), "tensorParallelSize": 4, "nodes": 2, "replicas": 3}))
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"] == ["md-router"]
    lws = find(objects, LWS)
    assert lws["spec"]["replicas"] == 3
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader, worker = group_pods(objects)
    assert "--tensor-parallel-size 4 --distributed-executor-backend ray" in command_of(leader)[2]
    assert "ray start --head" in command_of(leader)[2]
    assert "pagefleet serve" not in command_of(worker)[2]


def test_a_multi_node_pools_rollout_and_refusals():
    rolling = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2}}
    pool = {"resources": gpus(1), "tensorParallelSize": 2, "nodes": 2, "strategy": rolling}
    lws = find(render(md(pool)), LWS)
    assert lws["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 2},
    }
    refused(md({**pool, "strategy": {"type": "Recreate"}}), "strategy.type must be RollingUpdate")
    # The LeaderWorkerSet's StatefulSets are named after it, plus a group index and a hash.
    refused(md({**pool, "strategy": None}, name="m" * 39), "at most 48")
    render(md({**pool, "strategy": None}, name="m" * 38))
    # And the single-node pool with that name is fine: a Deployment has no such limit.
    render(md({"resources": gpus(1)}, name="m" * 53))


def test_keda_scales_the_leader_worker_set_through_its_scale_subresource():
    pool = {
        "resources": gpus(1),
        "tensorParallelSize": 2,
        "nodes": 2,
        "autoscaling": {"mode": "keda", "minReplicas": 0, "maxReplicas": 4},
    }
    objects = render(md(pool))
    assert "replicas" not in find(objects, LWS)["spec"]  # KEDA's HPA owns it
    scaled = find(objects, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "md-colocated",
    }


def test_an_rdma_host_network_group_sets_no_sysctl_and_keeps_its_capability():
    """Namespaced sysctls are refused on host-network pods; the NIC's own ports apply."""
    pool = {"resources": gpus(1), "tensorParallelSize": 2, "nodes": 2}
    rdma = {"connector": "nixl", "rdma": {"enabled": True, "hostNetwork": True}}
    objects = render(
        md(mode="disaggregated", pools={"prefill": pool, "decode": pool}, kvTransfer=rdma)
    )
    for name in ("md-prefill", "md-decode"):
        for pod in group_pods(objects, name):
            assert pod["hostNetwork"] is True
            assert "sysctls" not in pod["securityContext"]
            assert pod["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_ray_and_lws_variables_are_the_operators():
    refused(
        md({"env": [{"name": "RAY_ADDRESS", "value": "elsewhere:6379"}]}),
        "RAY_ADDRESS is set by the operator",
    )
    refused(md({"env": [{"name": "LWS_LEADER_ADDRESS", "value": "x"}]}), "LWS_LEADER_ADDRESS")


# Switching kinds


def patches(model_deployment: dict) -> set[tuple[str, str, int | None]]:
    return {
        (p["kind"], p["metadata"]["name"], p.get("spec", {}).get("replicas"))
        for p in retired_objects(model_deployment)
        if p["kind"] != "ScaledObject"
    }


def test_the_kind_a_pool_no_longer_uses_is_retired_to_zero():
    multi = md({"resources": gpus(1), "tensorParallelSize": 2, "nodes": 2})
    assert patches(multi) >= {("Deployment", "md-colocated", 0)}
    assert (LWS, "md-colocated", 0) not in patches(multi)
    single = md({"resources": gpus(1)})
    assert (LWS, "md-colocated", 0) in patches(single)
    assert ("Deployment", "md-colocated", 0) not in patches(single)
    # Pools of the other mode: both kinds retired.
    assert {("Deployment", "md-prefill", 0), (LWS, "md-prefill", 0)} <= patches(single)


def test_the_scale_selector_picks_group_leaders():
    pools = (PoolObserved("colocated", 1, 1, 1, "r", workload=LWS, leaders_only=True),)
    status = build_status("md", 1, Observed(pools, 1, 1), {}, "2026-01-01T00:00:00Z")
    assert status["selector"] == (
        "pagefleet.io/deployment=md,pagefleet.io/pool=colocated,"
        "leaderworkerset.sigs.k8s.io/worker-index=0"
    )
    assert status["pools"]["colocated"]["workload"] == LWS


# Every object valid


VARIANTS = {
    "gpu-multinode-builtin": md(
        {
            "resources": gpus(4),
            "tensorParallelSize": 8,
            "nodes": 2,
            "autoscaling": {"mode": "builtin"},
        }
    ),
    "cpu-multinode": md(
        {"tensorParallelSize": 4, "nodes": 4}, model={"name": "m", "uri": "hf://org/m"}
    ),
    "pd-multinode-rdma": md(
        mode="disaggregated",
        pools={
            "prefill": {"resources": gpus(2), "tensorParallelSize": 4, "nodes": 2},
            "decode": {"resources": gpus(2), "tensorParallelSize": 2},
        },
        kvTransfer={"connector": "nixl", "rdma": {"enabled": True, "networks": "rdma-net"}},
    ),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_object_of_the_multi_node_variants_is_valid(name):
    objects = render(VARIANTS[name])
    assert LWS in {o["kind"] for o in objects}
    for obj in objects:
        if obj["kind"] == LWS:
            validate_leader_worker_set(obj, KUBERNETES_VERSIONS)
        elif not obj["apiVersion"].startswith("keda.sh/"):
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def test_the_lws_validator_refuses_what_the_lws_api_would():
    lws = find(render(VARIANTS["gpu-multinode-builtin"]), LWS)
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    with pytest.raises(Exception, match="groupSize"):
        validate_leader_worker_set(bad, KUBERNETES_VERSIONS)
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["comand"] = []
    with pytest.raises(AssertionError, match="comand"):
        validate_leader_worker_set(bad, KUBERNETES_VERSIONS)
    bad = json.loads(json.dumps(lws))
    bad["spec"]["startupPolicy"] = "WorkersFirst"
    with pytest.raises(Exception, match="WorkersFirst"):
        validate_leader_worker_set(bad, KUBERNETES_VERSIONS)
