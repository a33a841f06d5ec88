"""Scenarios: what the chart and the examples deploy serves, through the operator's router, the
same greedy text as the offline engine; and disaggregated serving moves KV between pod IPs."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from pagefleet.operator.reconcile import KV_TRANSFER_PORT, UCX_PORTS

from .conftest import open_lab
from .fleet import (
    ENGINE_PORT,
    ENVOY_REPOSITORY,
    EPP_PORT,
    EXAMPLES,
    GATEWAY_PORT,
    INFERENCE_POOL_CRD,
    assert_serves_as_offline,
    complete,
    envoy_image,
    example,
    for_cpu,
    helm_template,
    images_tcp_only,
    md_pods,
    metrics,
    operator_ready,
    pod_url,
    policy_check,
    prepare_namespace,
    ready,
    router_url,
    start_gateway,
    start_operator,
    wait_serving,
    would_drop,
)
from .flows import Connection
from .images import files_image

VALUES = Path(__file__).with_name("chart-cpu-values.yaml")
LONG = " ".join(f"history{i % 29} of the chat so far" for i in range(45))  # ~650 tokens
KEDA_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {
        "group": "keda.sh",
        "scope": "Namespaced",
        "names": {"kind": "ScaledObject", "plural": "scaledobjects", "singular": "scaledobject"},
        "versions": [{"name": "v1alpha1", "served": True, "storage": True, "schema": {}}],
    },
}


def test_the_charts_default_model_deployment_serves_on_cpu(tmp_path, model_store, offline):
    """`helm template` of the chart (CPU values, with its InferencePool on) applied as is: the
    operator pod (in-cluster login with its service-account token), the engine, the router and
    the Endpoint Picker all get Ready, and the openai SDK gets the offline engine's greedy text
    through the router and through a Gateway's Envoy pod that asks the picker (gRPC, pod to
    pod) where to send each request. Every connection is one the policies allow, and no pod
    but the Gateway's may call the picker."""
    values = yaml.safe_load(VALUES.read_text())
    values["modelDeployment"]["inferencePool"] = {"enabled": True}
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    objects = helm_template("pf", "serving", values_file)
    claim = next(o for o in objects if o["kind"] == "PersistentVolumeClaim")["metadata"]["name"]
    with open_lab(
        tmp_path / "lab", claims={claim: str(model_store)}, images={ENVOY_REPOSITORY: envoy_image()}
    ) as lab:
        lab.kube.create_namespace("serving")
        lab.kube.create(INFERENCE_POOL_CRD)  # the Inference Extension's, installed beforehand
        for obj in sorted(objects, key=lambda o: o["kind"] != "CustomResourceDefinition"):
            lab.kube.create(obj)
        operator = operator_ready(lab, "serving")
        assert operator[0]["spec"]["serviceAccountName"] == "pf-pagefleet-operator"
        wait_serving(lab, "serving", "llama-3-8b", engines=1)
        url = router_url(lab, "serving", "llama-3-8b")
        assert_serves_as_offline(lab, url, "llama-3-8b", offline)
        # Its root read-only, the engine loaded the kernels compiled beside its source (what
        # an image built with Dockerfile.cpu carries) instead of compiling them again.
        (engine,) = md_pods(lab, "serving", "llama-3-8b")
        engine_log = lab.pod_log(engine)
        for kernel in ("numba_ops._gemv", "numba_ops._rms_norm", "numba_paged."):
            assert f"numba kernel {kernel}" in engine_log, engine_log[-3000:]
        restarts = [
            c["restartCount"]
            for p in lab.kube.pods("serving")
            for c in p["status"]["containerStatuses"]
        ]
        assert restarts == [0] * len(restarts), lab.describe()
        (pool,) = lab.kube.list("inference.networking.k8s.io/v1", "InferencePool", "serving")
        picker = lab.wait_for(
            lambda: ready(md_pods(lab, "serving", "llama-3-8b", "epp")), 60, "the picker Ready"
        )[0]
        assert pool["spec"]["endpointPickerRef"]["name"] == "llama-3-8b-epp"
        gateway = start_gateway(lab, "serving", "inference-gateway", picker["status"]["podIP"])
        assert_serves_as_offline(lab, pod_url(gateway, GATEWAY_PORT), "llama-3-8b", offline)
        # The chart's policy (the operator) and the operator's (router, picker, engines) let
        # through what runs: the operator, router and picker watch the API, the router and
        # the picker follow the engine, the Gateway calls the picker and the engine.
        connections, dropped = policy_check(lab, "serving")
        assert not dropped, (dropped, connections)
        opened = {(c.client.rsplit("-", 2)[0], c.port) for c in connections}  # by Deployment
        assert {("pf-pagefleet-operator", 6443), ("llama-3-8b-router", 8000)} <= opened
        assert ("llama-3-8b-router", 5557) in opened, connections
        assert {("llama-3-8b-epp", 8000), ("llama-3-8b-epp", 5557)} <= opened, connections
        gateway_name, picker_name = gateway["metadata"]["name"], picker["metadata"]["name"]
        assert EPP_PORT in {c.port for c in connections if c.client == gateway_name}
        # The Gateway's requests to the engine (a keep-alive connection the engine may have
        # closed by now) are allowed; another pod (the router's) calling the picker's port is
        # dropped by the picker's policy.
        (engine,) = md_pods(lab, "serving", "llama-3-8b")
        engine_name, engine_ip = engine["metadata"]["name"], engine["status"]["podIP"]
        request = Connection(gateway_name, engine_name, engine_ip, ENGINE_PORT)
        assert would_drop(lab, "serving", [request]) == []
        router_pod = md_pods(lab, "serving", "llama-3-8b", "router")[0]["metadata"]["name"]
        probe = Connection(router_pod, picker_name, picker["status"]["podIP"], EPP_PORT)
        dropped = would_drop(lab, "serving", [probe])
        assert f"ingress {router_pod} -> {picker_name}:{EPP_PORT}" in dropped


def test_every_valid_example_serves_on_cpu(tmp_path, model_store, offline):
    """`kubectl apply -f examples/modeldeployments/` (the valid ones, with CPU engine args):
    PVC, hostPath and weights-image models, colocated, disaggregated and KEDA pools."""
    every = sorted(p.name for p in EXAMPLES.glob("*.yaml") if not p.name.startswith("invalid-"))
    # Not here: one needs GPUs and RDMA devices (its objects are validated strictly in
    # tests/test_operator_pods.py); one downloads from huggingface.co (the same hf:// path runs
    # against a stand-in Hub in test_overrides.py); one runs tensor parallel 8 over two pods of
    # GPUs (a CPU multi-node pool, TP 2 over two pods, serves in test_multinode.py); one
    # downloads an embedding model (its --runner pooling reaching the engines is
    # test_operator_reconcile.py's; a pooling engine serves in test_server_embeddings.py).
    elsewhere = [
        "embeddings.yaml",
        "gpu-disaggregated-rdma.yaml",
        "hf-colocated.yaml",
        "multinode.yaml",
    ]
    valid = [name for name in every if name not in elsewhere]
    assert set(elsewhere) <= set(every)
    assert valid == ["colocated.yaml", "disaggregated.yaml", "hostpath-minimal.yaml", "keda.yaml"]
    weights = files_image({"/model": str(model_store / "qwen2-7b")})
    with open_lab(
        tmp_path / "lab",
        claims={"models": str(model_store)},
        host_paths={"/srv/models/tiny": str(model_store / "tiny")},
        images={"registry.example.com/weights/qwen2-7b": weights},
    ) as lab:
        prepare_namespace(lab, "serving")
        lab.kube.create(KEDA_CRD)  # the keda example needs KEDA's CRD (not its controller)
        # keda pools need a Prometheus URL; nothing answers there, so builtin pools hold.
        start_operator(
            lab,
            *("--autoscale-interval", "1"),
            *("--prometheus-url", "http://prometheus.invalid:9090"),
            *("--allowed-host-paths", "/srv/models"),
        )
        deployments = {name: for_cpu(example(name)) for name in valid}
        for md in deployments.values():
            lab.kube.create(md)
        engines = {
            "colocated.yaml": 2,
            "disaggregated.yaml": 3,
            "hostpath-minimal.yaml": 1,
            "keda.yaml": 1,
        }
        for name, md in deployments.items():  # each one fully, so a failure names its example
            meta = md["metadata"]
            wait_serving(lab, meta["namespace"], meta["name"], engines[name], timeout=300)
            url = router_url(lab, meta["namespace"], meta["name"])
            assert_serves_as_offline(lab, url, md["spec"]["model"]["name"], offline)
        # The weights image's files are copied as the pods' non-root user, the weights into
        # the engine's volume and the tokenizer's into the router's.
        for qwen in [*md_pods(lab, "serving", "qwen"), *md_pods(lab, "serving", "qwen", "router")]:
            (init,) = qwen["status"]["initContainerStatuses"]
            assert init["state"]["terminated"]["exitCode"] == 0, init


def test_disaggregated_prefill_hands_kv_to_decode_between_pod_ips(tmp_path, model_store, offline):
    """A long prompt is prefilled on the prefill pod and pulled over NIXL (UCX over TCP, as
    between nodes) by the decode pod from the prefill pod's IP, both holding the fleet secret
    the operator made: the decode pod computes at most the uncached tail, the text equals the
    offline engine's, and the prefill pod lets its held blocks go right after the hand-off.
    Every connection the pods hold then is one their NetworkPolicies allow, UCX's included."""
    with open_lab(
        tmp_path / "lab", claims={"models": str(model_store)}, images=images_tcp_only()
    ) as lab:
        prepare_namespace(lab, "serving")
        start_operator(lab, "--autoscale-interval", "1")
        md = for_cpu(example("disaggregated.yaml"))
        md["spec"]["pools"] = {
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
        }
        lab.kube.create(md)
        wait_serving(lab, "serving", "llama-pd", engines=2)
        pods = {
            p["metadata"]["labels"]["pagefleet.io/role"]: p
            for p in md_pods(lab, "serving", "llama-pd")
        }
        prefill, decode = pods["prefill"], pods["decode"]
        prefill_name, decode_name = prefill["metadata"]["name"], decode["metadata"]["name"]
        url = router_url(lab, "serving", "llama-pd")
        before = metrics(lab, decode)
        text = complete(lab, url, "llama-3-8b", LONG)
        handed_off = time.monotonic()
        after = metrics(lab, decode)
        assert text == offline.complete(LONG)
        moved = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in after
            if k.startswith("pagefleet:kv_transfer_")
        }
        assert moved["pagefleet:kv_transfer_transfers_total"] >= 1, moved
        assert moved["pagefleet:kv_transfer_bytes_total"] > 0, moved
        assert moved["pagefleet:kv_transfer_failures_total"] == 0, moved
        assert moved["pagefleet:kv_transfer_fallbacks_total"] == 0, moved
        computed = after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0)
        assert computed <= 16, f"the decode pod computed {computed} prompt tokens"
        # Released by the decode pod's hand-off, not by the 120 s hold timeout.
        lab.wait_for(
            lambda: (
                metrics(lab, prefill)["vllm:kv_cache_usage_perc"] == 0
                and metrics(lab, prefill)["pagefleet:kv_transfer_held_blocks"] == 0
            ),
            10,
            "the prefill pod to release its blocks",
        )
        print(f"prefill blocks released {time.monotonic() - handed_off:.2f} s after the answer")
        assert prefill["status"]["podIP"] != decode["status"]["podIP"]
        connections, dropped = policy_check(lab, "serving")
        assert not dropped, (dropped, connections)
        to_prefill = {
            c.port for c in connections if (c.client, c.server) == (decode_name, prefill_name)
        }
        # The KV-transfer handshake and UCX's own connection, inside the pinned range.
        assert KV_TRANSFER_PORT in to_prefill, connections
        assert any(UCX_PORTS[0] <= p <= UCX_PORTS[1] for p in to_prefill), connections
        assert not [c for c in connections if c.client == prefill_name], connections
