"""Kubernetes discovery of engine pods against kmock's KubernetesEmulator (a real HTTP API
server emulation, driven through the official kubernetes client)."""

from __future__ import annotations

import httpx
import pytest

from kube_emulator import kubernetes_emulator
from pagefleet.router.discovery import KubernetesDiscovery, parse_selector
from server_utils import running_router, running_server, wait_until


def pods_emulator():
    return kubernetes_emulator(
        {"v1/pods": ("Pod", True, ()), "v1/namespaces": ("Namespace", False, ())}
    )


def core_api(url: str):
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = url
    return client.CoreV1Api(client.ApiClient(configuration))


POOL_ROLES = {"colocated": "both", "prefill": "prefill", "decode": "decode"}


def pod(name: str, ready: bool = True, ip: str = "127.0.0.1", pool: str = "colocated") -> dict:
    """A pod as the operator's Deployment `md-<pool>` makes it (through its ReplicaSet)."""
    template_hash = "5d8f7c9b4"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "serving",
            "labels": {
                "pagefleet.io/model": "m",
                "pagefleet.io/deployment": "md",
                "pagefleet.io/pool": pool,
                "pagefleet.io/role": POOL_ROLES[pool],
                "pod-template-hash": template_hash,
            },
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": f"md-{pool}-{template_hash}",
                    "uid": "0b6a1a9e-3c1e-4c55-9d4e-4a4c3f0e0001",
                    "controller": True,
                }
            ],
        },
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_selector_parsing():
    assert parse_selector("pagefleet.io/model=m, pagefleet.io/role") == {
        "pagefleet.io/model": "m",
        "pagefleet.io/role": None,
    }
    with pytest.raises(ValueError):
        parse_selector("=x")


def test_ready_matching_pods_are_discovered_and_removed():
    with pods_emulator() as url:
        api = core_api(url)
        api.create_namespaced_pod("serving", pod("engine-a", pool="decode"))
        seen: list = []
        discovery = KubernetesDiscovery(
            api, "serving", "pagefleet.io/model=m", 8000, seen.append
        ).start()
        try:
            wait_until(lambda: seen and [p.name for p in seen[-1]] == ["engine-a"])
            assert seen[-1][0].url == "http://127.0.0.1:8000" and seen[-1][0].role == "decode"
            api.create_namespaced_pod("serving", pod("engine-b", ip="10.1.2.3"))
            api.create_namespaced_pod("serving", pod("starting", ready=False))
            other = pod("other-model")
            other["metadata"]["labels"]["pagefleet.io/model"] = "x"
            api.create_namespaced_pod("serving", other)
            wait_until(lambda: [p.name for p in seen[-1]] == ["engine-a", "engine-b"])
            api.delete_namespaced_pod("engine-a", "serving")
            wait_until(lambda: [p.name for p in seen[-1]] == ["engine-b"])
        finally:
            discovery.stop()


def group_pod(name: str, worker_index: str, owner: str) -> dict:
    """A pod of the operator's LeaderWorkerSet `md-colocated` (a multi-node pool): leaders are
    controlled by the leader StatefulSet `md-colocated`, the workers of group 0 by
    `md-colocated-0`."""
    made = pod(name)
    labels = made["metadata"]["labels"]
    del labels["pod-template-hash"]
    labels["leaderworkerset.sigs.k8s.io/worker-index"] = worker_index
    made["metadata"]["ownerReferences"][0].update(kind="StatefulSet", name=owner)
    return made


def test_only_the_leaders_of_a_multi_node_pool_are_routed_to():
    """A group's worker pods carry the pool's labels but run Ray only: routing to one fails
    every request sent there. A pod claiming to be a leader (worker index 0) counts only when
    the leader StatefulSet of the pool's LeaderWorkerSet controls it."""
    with pods_emulator() as url:
        api = core_api(url)
        api.create_namespaced_pod("serving", group_pod("md-colocated-0", "0", "md-colocated"))
        api.create_namespaced_pod("serving", group_pod("md-colocated-0-1", "1", "md-colocated-0"))
        # A worker that relabels itself a leader is still not the leader StatefulSet's.
        api.create_namespaced_pod("serving", group_pod("liar", "0", "md-colocated-0"))
        # A Deployment's pod never passes as a group leader by its StatefulSet name alone.
        api.create_namespaced_pod("serving", group_pod("no-index", "", "md-colocated"))
        seen: list = []
        discovery = KubernetesDiscovery(
            api, "serving", "pagefleet.io/model=m", 8000, seen.append, deployment="md"
        ).start()
        try:
            wait_until(lambda: seen and "md-colocated-0" in [p.name for p in seen[-1]])
            assert [(p.name, p.role) for p in seen[-1]] == [("md-colocated-0", "both")]
        finally:
            discovery.stop()


def rogue(name: str, change) -> dict:
    made = pod(name, pool="decode")
    change(made["metadata"])
    return made


ROGUES = {
    # A pod someone made by hand with our labels.
    "bare": lambda m: m.pop("ownerReferences"),
    # Owned by a ReplicaSet of another Deployment, or not by a ReplicaSet at all.
    "other-rs": lambda m: m["ownerReferences"][0].update(name="evil-5d8f7c9b4"),
    "job": lambda m: m["ownerReferences"][0].update(kind="Job", apiVersion="batch/v1"),
    "not-controller": lambda m: m["ownerReferences"][0].update(controller=False),
    # A decode pod whose role label claims prefill (it would be sent prompts to hold).
    "role-lies": lambda m: m["labels"].update({"pagefleet.io/role": "prefill"}),
    # Another ModelDeployment serving the same model name.
    "other-md": lambda m: m["labels"].update({"pagefleet.io/deployment": "md2"}),
}


def test_pods_not_made_by_our_deployments_are_ignored():
    """Before: any Ready pod with the model label was routed to, in whatever role its own
    label claimed."""
    with pods_emulator() as url:
        api = core_api(url)
        for name, change in ROGUES.items():
            api.create_namespaced_pod("serving", rogue(name, change))
        api.create_namespaced_pod("serving", pod("engine-ok", pool="prefill"))
        seen: list = []
        discovery = KubernetesDiscovery(
            api, "serving", "pagefleet.io/model=m", 8000, seen.append, deployment="md"
        ).start()
        try:
            wait_until(lambda: seen and "engine-ok" in [p.name for p in seen[-1]])
            assert [(p.name, p.role) for p in seen[-1]] == [("engine-ok", "prefill")]
        finally:
            discovery.stop()


def test_router_finds_its_engine_through_kubernetes(tiny_checkpoints):
    with running_server(tiny_checkpoints["llama"]) as (engine, _), pods_emulator() as url:
        port = engine.rsplit(":", 1)[1]
        core_api(url).create_namespaced_pod("serving", pod("engine-0"))
        flags = (
            "--kubernetes-namespace",
            "serving",
            "--kubernetes-api",
            url,
            "--selector",
            "pagefleet.io/model=m",
            "--engine-port",
            port,
        )
        with running_router(*flags) as (router, _):
            wait_until(
                lambda: (
                    httpx.post(
                        f"{router}/v1/completions",
                        timeout=30,
                        json={"prompt": "hello", "max_tokens": 2},
                    ).status_code
                    == 200
                )
            )
