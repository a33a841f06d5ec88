"""What matters in each golden of tests/golden/operator/, stated by hand and checked against the
golden file itself: `PAGEFLEET_UPDATE_GOLDEN=1` rewrites the goldens from the code, so a wrong
command would be blessed by an update; these assertions are not rewritten and fail instead.

Each golden is read as stored (test_operator_reconcile.py checks that the code renders exactly
it). Values are literals on purpose: they are the contract with the engine, the router, the
kubelet and the garbage collector, not whatever the code emits today."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

GOLDEN = Path(__file__).resolve().parent / "golden" / "operator"

# golden -> (ModelDeployment name, its uid in the test render, served model).
CASES = {
    "colocated.yaml": ("llama", "00000000-0000-0000-0000-000000000014", "llama-3-8b"),
    "disaggregated.yaml": ("llama-pd", "00000000-0000-0000-0000-000000000018", "llama-3-8b"),
    "keda.yaml": ("qwen", "00000000-0000-0000-0000-000000000009", "qwen2-7b"),
}
MODEL_PATHS = {
    "colocated.yaml": "/models/llama-3-8b",
    "disaggregated.yaml": "/models/llama-3-8b",
    "keda.yaml": "/models",
}
# The operator's flags: before every engineArgs flag (argparse keeps the last value, so a user
# can override any of them).
OPERATOR_FLAGS = ("--host", "--port", "--served-model-name", "--kv-events-config")
# Each engine Deployment's engineArgs (deployment-wide, then the pool's), as the example says.
USER_FLAGS = {
    "llama-colocated": ["--max-model-len", "--max-num-seqs", "--enable-prefix-caching"],
    "llama-pd-prefill": [
        "--max-model-len",
        "--max-num-batched-tokens",
        "--no-enable-chunked-prefill",
    ],
    "llama-pd-decode": ["--max-model-len", "--max-num-seqs"],
    "qwen-colocated": [],
}
KV_EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558",  # the router replays from port + 1
}
ENGINE_PORTS = {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def golden(name: str) -> list[dict]:
    return list(yaml.safe_load_all((GOLDEN / name).read_text()))


def deployments(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(command: list[str], name: str) -> str:
    assert command.count(name) == 1, f"{name} given {command.count(name)} times"
    return command[command.index(name) + 1]


def probe_path(c: dict, probe: str) -> tuple[str, str]:
    get = c[probe]["httpGet"]
    return get["path"], get["port"]


def test_the_cases_are_every_golden():
    assert sorted(p.name for p in GOLDEN.glob("*.yaml")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_object_is_controlled_by_its_model_deployment(name):
    """The garbage collector deletes exactly these with the ModelDeployment, and the operator
    patches only objects it controls (uid + controller)."""
    md, uid, _ = CASES[name]
    for obj in golden(name):
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "pagefleet.io/v1alpha1",
            "kind": "ModelDeployment",
            "name": md,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }, obj["metadata"]["name"]
        assert obj["metadata"]["namespace"] == "serving"


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_pods_flags_order_events_probes_and_pod_ip(name):
    _, _, model = CASES[name]
    engines = {
        n: d
        for n, d in deployments(golden(name)).items()
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    }
    assert engines
    for deployment in engines.values():
        c = container(deployment)
        command = c["command"]
        assert command[:3] == ["pagefleet", "serve", MODEL_PATHS[name]]
        assert flag(command, "--served-model-name") == model
        assert (flag(command, "--host"), flag(command, "--port")) == ("0.0.0.0", "8000")
        assert json.loads(flag(command, "--kv-events-config")) == KV_EVENTS
        # Operator flags (and its JSON configs) first, the user's engineArgs after them.
        flags = [a for a in command if a.startswith("--")]
        user = USER_FLAGS[deployment["metadata"]["name"]]
        assert flags[len(flags) - len(user) :] == user
        assert set(flags[: len(flags) - len(user)]) <= {*OPERATOR_FLAGS, "--kv-transfer-config"}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert {k: ports[k] for k in ENGINE_PORTS} == ENGINE_PORTS
        assert POD_IP_ENV in c["env"]
        # Engines: readiness and liveness on /health, a startup budget for loading weights.
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert probe_path(c, probe) == ("/health", "http")
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] == 1800
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60


def test_disaggregated_pods_advertise_their_own_pod_ip_for_kv_transfer():
    """The P/D address: each prefill and decode pod advertises and binds $(POD_IP) (expanded
    by the kubelet from POD_IP) on the port its container declares; never 127.0.0.1."""
    objects = golden("disaggregated.yaml")
    assert "127.0.0.1" not in (GOLDEN / "disaggregated.yaml").read_text()
    pods = deployments(objects)
    for name, role in (("llama-pd-prefill", "kv_producer"), ("llama-pd-decode", "kv_consumer")):
        c = container(pods[name])
        transfer = json.loads(flag(c["command"], "--kv-transfer-config"))
        assert transfer == {
            "kv_connector": "nixl",
            "kv_role": role,
            "kv_ip": "$(POD_IP)",
            "kv_port": 14579,
        }
        assert {"name": "kv-transfer", "containerPort": 14579, "protocol": "TCP"} in c["ports"]
        # The user's engineArgs come after the operator's flags, the pool's included.
        command = c["command"]
        assert command.index("--kv-transfer-config") < command.index("--max-model-len")
    assert flag(container(pods["llama-pd-prefill"])["command"], "--max-num-batched-tokens")
    assert "--no-enable-chunked-prefill" in container(pods["llama-pd-prefill"])["command"]
    assert flag(container(pods["llama-pd-decode"])["command"], "--max-num-seqs") == "512"
    # builtin autoscaling starts from spec.replicas inside [min, max].
    assert pods["llama-pd-decode"]["spec"]["replicas"] == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_router_probes_discovery_and_precise_index(name):
    md, _, model = CASES[name]
    router = deployments(golden(name))[f"{md}-router"]
    c = container(router)
    command = c["command"]
    assert command[:2] == ["pagefleet", "router"]
    # Its own deployment's engines only: two ModelDeployments may serve one model name.
    assert flag(command, "--selector") == f"pagefleet.io/deployment={md},pagefleet.io/model={model}"
    assert flag(command, "--kubernetes-namespace") == "serving"
    assert flag(command, "--engine-port") == "8000"
    # Precise index from the engines' KV events (replayed from 5558 after a restart), hashed
    # with the engines' own tokenizer.
    assert flag(command, "--prefix-index") == "precise"
    assert flag(command, "--kv-events-port") == "5557"
    assert flag(command, "--tokenizer") == MODEL_PATHS[name]
    # Alive while it serves; ready while an engine is healthy.
    assert probe_path(c, "livenessProbe") == ("/livez", "http")
    assert probe_path(c, "readinessProbe") == ("/health", "http")
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == f"{md}-router"


def test_keda_leaves_replicas_to_the_scaled_object():
    objects = golden("keda.yaml")
    engine = deployments(objects)["qwen-colocated"]
    assert "replicas" not in engine["spec"]
    (scaled,) = [o for o in objects if o["kind"] == "ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "qwen-colocated",
    }
    assert scaled["metadata"]["annotations"] == {"autoscaling.keda.sh/paused": "false"}
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"]["query"] == (
        'sum(vllm:num_requests_waiting{namespace="serving",pod=~"qwen-colocated-.*",'
        'model_name="qwen2-7b"})'
    )
