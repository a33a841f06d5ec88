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


def pod(name: str, ready: bool = True, ip: str = "127.0.0.1", **labels) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "serving",
            "labels": {"pagefleet.io/model": "m", **labels},
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
        api.create_namespaced_pod("serving", pod("engine-a", **{"pagefleet.io/role": "decode"}))
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
