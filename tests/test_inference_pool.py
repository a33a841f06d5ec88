"""spec.inferencePool rendered by the operator (operator/reconcile.py): an InferencePool
(inference.networking.k8s.io/v1) over the serving pods naming `pagefleet epp` as its Endpoint
Picker, the picker's Deployment, Service and read-only RBAC, and NetworkPolicies that let only a
Gateway's proxies call the picker and reach the pool's engines; and the Gateway + HTTPRoute
example. Validated against the upstream CRDs' schemas (tests/gateway_schemas.py) and, for
built-in kinds, kubernetes-validate."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from gateway_schemas import validate_gateway, validate_http_route, validate_inference_pool
from lws_schema import validate_builtin

from pagefleet.common.cli import build_parser
from pagefleet.operator.network_policy import DEFAULT_GATEWAY_PEER, PolicyPeers
from pagefleet.operator.reconcile import RenderOptions, desired_objects, retired_objects

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gateway" / "inference-gateway.yaml"
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
GATEWAY = {"podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "gw"}}}


def example() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(EXAMPLE.read_text())}


def model_deployment(**spec) -> dict:
    md = copy.deepcopy(example()["ModelDeployment"])
    md["metadata"]["uid"] = "uid-llama"
    md["spec"].update(spec)
    return md


def render(md: dict, peers: PolicyPeers | None = None) -> dict[tuple[str, str], dict]:
    options = RenderOptions(network_policy=peers or PolicyPeers())
    return {(o["kind"], o["metadata"]["name"]): o for o in desired_objects(md, options)}


def test_the_pool_selects_the_serving_pods_and_names_the_pickers_grpc_port():
    objects = render(model_deployment())
    pool = objects[("InferencePool", "llama")]
    validate_inference_pool(pool)
    engines = objects[("Deployment", "llama-colocated")]["spec"]["template"]["metadata"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= engines["labels"].items()
    for other in ("llama-router", "llama-epp"):
        pod = objects[("Deployment", other)]["spec"]["template"]["metadata"]["labels"]
        assert not selector.items() <= pod.items(), f"the pool selects {other}'s pods"
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    service = objects[("Service", ref["name"])]
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["appProtocol"] == "kubernetes.io/h2c" and ref["failureMode"] == "FailClose"
    picker = objects[("Deployment", "llama-epp")]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= picker.items()
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    failing_open = render(
        model_deployment(inferencePool={"enabled": True, "failureMode": "FailOpen"})
    )
    assert failing_open[("InferencePool", "llama")]["spec"]["endpointPickerRef"]["failureMode"] == (
        "FailOpen"
    )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_pickers_objects_validate_strictly(version):
    for (kind, _), obj in render(model_deployment()).items():
        if kind != "InferencePool":
            validate_builtin(obj, (version,))


def test_the_picker_runs_the_routers_core_with_the_routers_flags_and_reads_pods_only():
    """One core: `pagefleet epp` gets the router's picking flags (discovery, config, fleet
    secret, tokenizer, prefix index, KV events, flow control) and parses them; its Role
    reads pods and nothing else."""
    objects = render(model_deployment())

    def command(name):
        (container,) = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
        return container["command"]

    epp, router = command("llama-epp"), command("llama-router")
    shared = router[router.index("--kubernetes-namespace") :]
    assert epp[:2] == ["pagefleet", "epp"]
    assert epp[epp.index("--kubernetes-namespace") : -2] == shared
    args = build_parser().parse_args(epp[1:])
    assert (args.port, args.metrics_port, args.fallback_endpoints) == (9002, 9090, 0)
    assert args.fleet_secret_file and args.tokenizer and args.prefix_index == "precise"
    assert objects[("Role", "llama-epp")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    spec = objects[("Deployment", "llama-epp")]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "llama-epp"


def flows(policy: dict, direction: str) -> set[tuple[int, str]]:
    """(port, peer as JSON) for every port x peer of a policy's rules; "any" for no peers."""
    side = "from" if direction == "ingress" else "to"
    out = set()
    for rule in policy["spec"][direction]:
        for port in rule["ports"]:
            for peer in rule.get(side) or ["any"]:
                out.add((port["port"], json.dumps(peer, sort_keys=True)))
    return out


def peer(selector: dict) -> str:
    return json.dumps({"podSelector": {"matchLabels": selector}}, sort_keys=True)


@pytest.mark.parametrize("gateway_from", [None, [GATEWAY]])
def test_only_a_gateway_calls_the_picker_and_reaches_the_pools_engines(gateway_from):
    """The picker's gRPC port takes the Gateway's proxies only (by default any Gateway's pods:
    those labelled with their Gateway's name, never "anyone"); its /metrics the operator;
    the serving engines take the Gateway's requests and the picker's scrapes and KV-event
    subscriptions."""
    peers = (
        PolicyPeers()
        if gateway_from is None
        else PolicyPeers.from_json(json.dumps({"gatewayFrom": gateway_from}))
    )
    gateway = json.dumps(gateway_from[0] if gateway_from else DEFAULT_GATEWAY_PEER, sort_keys=True)
    objects = render(model_deployment(), peers)
    epp = objects[("NetworkPolicy", "llama-epp")]
    ingress = flows(epp, "ingress")
    assert {p for p, source in ingress if source == gateway} == {9002}
    assert {source for p, source in ingress if p == 9002} == {gateway}
    assert {p for p, _ in ingress} == {9002, 9090}
    epp_pods = peer({"pagefleet.io/deployment": "llama", "app.kubernetes.io/component": "epp"})
    engines = flows(objects[("NetworkPolicy", "llama-colocated")], "ingress")
    assert {(8000, gateway), (8000, epp_pods), (5557, epp_pods), (5558, epp_pods)} <= engines
    assert (5557, gateway) not in engines
    egress = flows(epp, "egress")
    assert (
        8000,
        peer({"pagefleet.io/deployment": "llama", "app.kubernetes.io/component": "engine"}),
    ) in egress


def test_disaggregated_the_gateway_reaches_decode_pods_and_the_picker_releases_prefills():
    md = model_deployment()
    md["spec"]["mode"] = "disaggregated"
    md["spec"]["pools"] = {"prefill": {}, "decode": {}}
    objects = render(md)
    selector = objects[("InferencePool", "llama")]["spec"]["selector"]["matchLabels"]
    assert selector == {"pagefleet.io/deployment": "llama", "pagefleet.io/pool": "decode"}
    gateway = json.dumps(DEFAULT_GATEWAY_PEER, sort_keys=True)
    epp_pods = peer({"pagefleet.io/deployment": "llama", "app.kubernetes.io/component": "epp"})
    prefill = flows(objects[("NetworkPolicy", "llama-prefill")], "ingress")
    decode = flows(objects[("NetworkPolicy", "llama-decode")], "ingress")
    assert (8000, gateway) in decode and (8000, gateway) not in prefill
    assert {(8000, epp_pods), (14579, epp_pods)} <= prefill


def test_without_the_pool_no_picker_and_a_dropped_one_is_retired():
    md = model_deployment(inferencePool={"enabled": False})
    kinds = {kind for kind, _ in render(md)}
    assert "InferencePool" not in kinds and ("Deployment", "llama-epp") not in render(md)
    retire = [p for p in retired_objects(md) if p["metadata"]["name"] == "llama-epp"]
    assert retire == [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "llama-epp", "namespace": "serving"},
            "spec": {"replicas": 0},
        }
    ]
    assert not [p for p in retired_objects(model_deployment()) if "epp" in p["metadata"]["name"]]


def test_the_example_gateway_routes_to_the_pool_the_model_deployment_makes():
    docs = example()
    validate_gateway(docs["Gateway"])
    route = docs["HTTPRoute"]
    validate_http_route(route)
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    pools = [o for (kind, _), o in render(model_deployment()).items() if kind == "InferencePool"]
    (pool,) = pools
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert backend["name"] == pool["metadata"]["name"]
    assert route["metadata"]["namespace"] == pool["metadata"]["namespace"]
    assert route["spec"]["parentRefs"][0]["name"] == docs["Gateway"]["metadata"]["name"]


@pytest.mark.parametrize(
    "broken",
    [
        lambda p: p["spec"].pop("targetPorts"),
        lambda p: p["spec"]["endpointPickerRef"].pop("port"),
        lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
        lambda p: p["spec"]["targetPorts"].append({"number": 8000}),
        lambda p: p["spec"].update(selectorr={}),
    ],
)
def test_the_schema_refuses_what_the_api_server_would(broken):
    """The validators are not rubber stamps: each breakage the CRD forbids fails them."""
    pool = copy.deepcopy(render(model_deployment())[("InferencePool", "llama")])
    broken(pool)
    with pytest.raises((AssertionError, jsonschema.ValidationError)):
        validate_inference_pool(pool)


def test_the_model_deployment_is_ready_only_once_its_picker_is():
    """With an InferencePool, a Gateway's requests need the picker: Ready waits for its pods
    as for the router's (and says which)."""
    from pagefleet.operator.status import Observed, PoolObserved, build_status

    pools = (PoolObserved("colocated", 2, 2, 2, "spec"),)
    waiting = build_status("m", 1, Observed(pools, 1, 1, picker_replicas=1), {}, "T1")
    ready = {c["type"]: c for c in waiting["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PickerNotReady")
    serving = build_status("m", 1, Observed(pools, 1, 1, None, None, None, 1, 1), {}, "T2")
    assert {c["type"]: c for c in serving["conditions"]}["Ready"]["status"] == "True"
