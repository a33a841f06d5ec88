"""Scenarios of issue 14 on the operator's objects: API keys from a Secret enforced through the
router (and the engines' own key), and a pod that copies a decode pod's labels but has no fleet
secret: it gets no KV from the prefill pod and no request from the router. Plus the check of
observed connections against NetworkPolicies (flows.py), shown to refuse what it must."""

from __future__ import annotations

import base64
import os
import secrets

import grpc
import httpx
import pytest
import yaml

from pagefleet.common.fleet_auth import FleetSecret
from pagefleet.common.kv_errors import AuthenticationFailed
from pagefleet.engine.kv_transfer.layout import CompatRecord
from pagefleet.engine.kv_transfer.service import KVTransferClient
from pagefleet.operator.reconcile import KV_TRANSFER_PORT, RenderOptions, desired_objects
from pagefleet.proto import kv_transfer_pb2 as pb
from pagefleet.proto import kv_transfer_pb2_grpc as pb_grpc

from .conftest import open_lab
from .fleet import (
    EXAMPLES,
    complete,
    example,
    for_cpu,
    images_tcp_only,
    in_pod,
    md_pods,
    metrics,
    pod_url,
    prepare_namespace,
    ready,
    router_pods,
    router_url,
    simulated_deployment,
    start_operator,
    wait_serving,
)
from .flows import Connection, violations
from .test_serving import LONG

NS = "serving"
BODY = {"model": "tiny", "prompt": "keys from a Secret", "max_tokens": 4}


def post(lab, base: str, key: str | None, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return lab.in_lab(
        httpx.post, f"{base}/v1/completions", json=body or BODY, headers=headers, timeout=60
    )


def secret_value(lab, name: str, key: str) -> str:
    return base64.b64decode(lab.kube.get("v1", "Secret", NS, name)["data"][key]).decode()


def test_api_keys_from_a_secret_are_enforced_through_the_router(tmp_path, model_store):
    """spec.apiKeySecret: clients need the Secret's key at the router (401 without it or with
    another); the engines need the fleet Secret's engine key, which the router sends and a
    client's key is not; /metrics stays open for Prometheus and the autoscaler."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NS)
        start_operator(lab, "--autoscale-interval", "1")
        client_key = secrets.token_urlsafe(24)
        lab.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "keyed-api-key", "namespace": NS},
                "data": {"api-key": base64.b64encode(client_key.encode()).decode()},
            }
        )
        md = simulated_deployment("keyed", NS, {"replicas": 1})
        md["spec"]["apiKeySecret"] = {"name": "keyed-api-key", "key": "api-key"}
        lab.kube.create(md)
        (engine,) = wait_serving(lab, NS, "keyed", engines=1)
        url = router_url(lab, NS, "keyed")

        assert post(lab, url, None).status_code == 401
        assert post(lab, url, "not-the-key").status_code == 401
        ok = post(lab, url, client_key)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4

        engine_url = pod_url(engine)
        assert post(lab, engine_url, None).status_code == 401
        assert post(lab, engine_url, client_key).status_code == 401
        engine_key = secret_value(lab, "keyed-fleet-secret", "engine-api-key")
        assert engine_key != client_key
        assert post(lab, engine_url, engine_key).status_code == 200
        assert lab.in_lab(httpx.get, f"{engine_url}/metrics", timeout=10).status_code == 200


def rogue_pod(decode: dict) -> dict:
    """A pod someone creates by hand from a decode pod: every label copied (the role, the pool,
    the pod-template-hash), the same engine and model, but no fleet secret (it cannot read the
    Secret), hence no KV-transfer config either (an engine refuses that without the secret)."""
    spec = yaml.safe_load(yaml.safe_dump(decode["spec"]))
    (container,) = spec["containers"]
    command, kept = container["command"], []
    skip = {"--fleet-secret-file", "--kv-transfer-config"}
    i = 0
    while i < len(command):
        if command[i] in skip:
            i += 2
            continue
        kept.append(command[i])
        i += 1
    container["command"] = kept
    container["env"] = [e for e in container["env"] if "secretKeyRef" not in e.get("valueFrom", {})]
    container["volumeMounts"] = [
        m for m in container["volumeMounts"] if m["name"] != "fleet-secret"
    ]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "fleet-secret"]
    spec.pop("nodeName", None)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "rogue-decode",
            "namespace": NS,
            "labels": dict(decode["metadata"]["labels"]),
        },
        "spec": spec,
    }


def code_of(call) -> str:
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def steal_kv(prefill_ip: str) -> dict[str, str]:
    """What a process without the fleet secret tries against a prefill pod's KV service and
    HTTP API (run inside the rogue pod's network namespace)."""
    outcome: dict[str, str] = {}
    guess = FleetSecret(os.urandom(32))
    record = CompatRecord("llama-3-8b", "float32", "float32", 2, 2, 16, 16)
    with KVTransferClient(prefill_ip, KV_TRANSFER_PORT, 10, secret=guess) as client:
        try:
            client.handshake(record, "rogue")
            outcome["handshake"] = "accepted"
        except AuthenticationFailed as e:
            outcome["handshake"] = f"refused: {e}"
    channel = grpc.insecure_channel(f"{prefill_ip}:{KV_TRANSFER_PORT}")
    stub = pb_grpc.KVTransferStub(channel)
    unproven = pb.HandshakeRequest(compat=pb.CompatRecord(model="llama-3-8b"), engine_id="rogue")
    outcome["bare handshake"] = code_of(lambda: stub.Handshake(unproven, timeout=10))
    read = pb.ReadBlocksRequest(request_id="guess", block_ids=[0, 1, 2])
    outcome["read"] = code_of(lambda: list(stub.ReadBlocks(read, timeout=10)))
    release = pb.ReleaseRequest(request_id="guess")
    outcome["release"] = code_of(lambda: stub.Release(release, timeout=10))
    channel.close()
    # Ask the prefill engine to hold a prompt's blocks for us, as the router would.
    hold = {
        "model": "llama-3-8b",
        "prompt": LONG,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    r = httpx.post(f"http://{prefill_ip}:8000/v1/completions", json=hold, timeout=60)
    outcome["hold"] = str(r.status_code)
    return outcome


def test_a_pod_without_the_fleet_secret_gets_no_kv_and_no_requests(tmp_path, model_store, offline):
    """A rogue pod with the decode pod's labels, on the pod network: the prefill pod's KV
    service refuses it (its proof fails, unproven calls are UNAUTHENTICATED), the prefill
    engine will not hold blocks for it (401: no engine key), and the router never routes to it
    (not a pod of the ModelDeployment's Deployments) while it does route to a decode pod that
    starts after it. P/D between the real pods goes on, and nothing stays held.

    Not modelled: a real ReplicaSet controller adopts an orphan whose labels match its selector
    (pod-template-hash included), then deletes its excess pods; until then discovery would
    take the adopted pod for one of ours (the lab's ReplicaSets adopt nothing). The fleet
    secret still keeps KV from it."""
    with open_lab(
        tmp_path / "lab", claims={"models": str(model_store)}, images=images_tcp_only()
    ) as lab:
        prepare_namespace(lab, NS)
        start_operator(lab, "--autoscale-interval", "1")
        md = for_cpu(example("disaggregated.yaml"))
        md["spec"]["pools"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
        lab.kube.create(md)
        # The rogue is made from the decode pod as the API server holds it (spec and labels
        # are set at creation) and starts beside the real pods rather than after them: one
        # round of engine starts fewer, and the router's discovery sees it from the start.
        decode = lab.wait_for(
            lambda: [
                p
                for p in md_pods(lab, NS, "llama-pd")
                if p["metadata"]["labels"]["pagefleet.io/role"] == "decode"
            ],
            60,
            "the decode pod",
        )[0]
        lab.kube.create(rogue_pod(decode))
        wait_serving(lab, NS, "llama-pd", engines=3)  # the rogue has the labels md_pods selects
        pods = {
            p["metadata"]["labels"]["pagefleet.io/role"]: p
            for p in md_pods(lab, NS, "llama-pd")
            if p["metadata"].get("ownerReferences")
        }
        prefill, decode = pods["prefill"], pods["decode"]
        url = router_url(lab, NS, "llama-pd")
        rogue = lab.wait_for(
            lambda: ready([lab.kube.get("v1", "Pod", NS, "rogue-decode")]), 180, "the rogue Ready"
        )[0]
        assert rogue["metadata"]["labels"] == decode["metadata"]["labels"]

        # A decode pod that starts after the rogue (Ready): once the router knows it, it has
        # seen the rogue's events too (one watch, in order), and routes to the real pods only.
        # It starts while the rogue tries the prefill pod (which it does not touch).
        lab.kube.patch(md, {"spec": {"pools": {"decode": {"replicas": 2}}}})

        outcome = in_pod(lab, rogue, steal_kv, prefill["status"]["podIP"])
        assert outcome["handshake"].startswith("refused"), outcome
        assert "fleet secret" in outcome["handshake"], outcome
        assert outcome["bare handshake"] == "UNAUTHENTICATED", outcome
        assert outcome["read"] == "UNAUTHENTICATED", outcome
        assert outcome["release"] == "UNAUTHENTICATED", outcome
        assert outcome["hold"] == "401", outcome

        wait_serving(lab, NS, "llama-pd", engines=4)  # the rogue has the labels md_pods selects
        real = [p for p in md_pods(lab, NS, "llama-pd") if p["metadata"].get("ownerReferences")]
        assert len(real) == 3 and decode["metadata"]["name"] in {
            p["metadata"]["name"] for p in real
        }
        names = {p["metadata"]["name"] for p in real}
        lab.wait_for(lambda: router_pods(lab, url) == names, 60, f"the router to know {names}")
        decoders = [p for p in real if p["metadata"]["labels"]["pagefleet.io/role"] == "decode"]
        before = sum(
            metrics(lab, p).get("pagefleet:kv_transfer_transfers_total", 0) for p in decoders
        )
        for prompt in [LONG, "a short one", "another short one"]:
            assert complete(lab, url, "llama-3-8b", prompt) == offline.complete(prompt)
        after = sum(
            metrics(lab, p).get("pagefleet:kv_transfer_transfers_total", 0) for p in decoders
        )
        assert after > before  # the long prompt went prefill -> decode between the real pods
        assert "rogue-decode" not in router_pods(lab, url)
        assert metrics(lab, rogue).get("vllm:request_success_total", 0) == 0
        lab.wait_for(
            lambda: metrics(lab, prefill)["pagefleet:kv_transfer_held_blocks"] == 0,
            10,
            "no block held on the prefill pod",
        )


# -- the policy check itself (no lab): it must refuse what an enforcing cluster would drop


def _pods_of(objects: list[dict]) -> list[dict]:
    pods = []
    for n, d in enumerate(o for o in objects if o["kind"] == "Deployment"):
        name = d["metadata"]["name"]
        meta = {
            "name": f"{name}-x",
            "namespace": NS,
            "labels": d["spec"]["template"]["metadata"]["labels"],
        }
        pods.append({"metadata": meta, "status": {"podIP": f"10.88.1.{n + 2}"}})
    return pods


@pytest.fixture(scope="module")
def pd_objects() -> list[dict]:
    md = yaml.safe_load((EXAMPLES / "disaggregated.yaml").read_text())
    md["metadata"]["uid"] = "uid"
    return desired_objects(md, RenderOptions())


def test_the_policy_check_refuses_what_the_policies_do_not_allow(pd_objects):
    stranger = {
        "metadata": {"name": "stranger", "namespace": NS, "labels": {"app": "other"}},
        "status": {"podIP": "10.88.1.99"},
    }
    pods = [*_pods_of(pd_objects), stranger]
    policies = [o for o in pd_objects if o["kind"] == "NetworkPolicy"]
    namespaces = {NS: {"kubernetes.io/metadata.name": NS}}
    ip = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}

    def conn(client: str, server: str, port: int) -> Connection:
        return Connection(client, server, ip.get(server, server), port)

    fine = [
        conn("llama-pd-decode-x", "llama-pd-prefill-x", 14579),
        conn("llama-pd-decode-x", "llama-pd-prefill-x", 14600),  # UCX
        conn("llama-pd-router-x", "llama-pd-prefill-x", 14579),  # releases
        conn("llama-pd-router-x", "llama-pd-decode-x", 5558),  # replay
        conn("llama-pd-router-x", "10.88.0.1", 6443),  # the API server
    ]
    assert violations(fine, pods, policies, namespaces) == []
    dropped = [
        conn("stranger", "llama-pd-prefill-x", 14579),
        conn("llama-pd-prefill-x", "llama-pd-decode-x", 14600),  # never the prefill side
        conn("llama-pd-decode-x", "llama-pd-prefill-x", 14610),  # outside the UCX range
        conn("llama-pd-decode-x", "10.88.0.1", 6443),  # engines have no API access
        conn("llama-pd-router-x", "llama-pd-decode-x", 14579),  # decode pods serve no KV
    ]
    found = violations(dropped, pods, policies, namespaces)
    assert found == [
        "ingress stranger -> llama-pd-prefill-x:14579",
        "egress llama-pd-prefill-x -> llama-pd-decode-x:14600",
        "ingress llama-pd-prefill-x -> llama-pd-decode-x:14600",
        "egress llama-pd-decode-x -> llama-pd-prefill-x:14610",
        "ingress llama-pd-decode-x -> llama-pd-prefill-x:14610",
        "egress llama-pd-decode-x -> 10.88.0.1:6443",
        "egress llama-pd-router-x -> llama-pd-decode-x:14579",
        "ingress llama-pd-router-x -> llama-pd-decode-x:14579",
    ]
