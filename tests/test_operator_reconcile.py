"""Pure reconcile and the CRD: golden manifests, strict kubernetes-validate for 1.30 and 1.35,
example CRs against the CRD's own schema, the chart's CRD file equal to operator/crd.py."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from lws_schema import validate_leader_worker_set

from pagefleet.common.cli import main
from pagefleet.common.serve_command import engine_flags
from pagefleet.operator.crd import crd, render_crd
from pagefleet.operator.reconcile import EngineImages, RenderOptions, desired_objects
from pagefleet.operator.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "modeldeployments"
GOLDEN = Path(__file__).resolve().parent / "golden" / "operator"
CRD_FILE = ROOT / "deploy" / "helm" / "pagefleet" / "crds" / "modeldeployments.pagefleet.io.yaml"
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
# Which example renders into which golden file.
GOLDEN_CASES = {
    "colocated": "colocated.yaml",
    "disaggregated": "disaggregated.yaml",
    "keda": "keda.yaml",
    "multinode": "multinode.yaml",
}


def load_example(name: str) -> dict:
    md = yaml.safe_load((EXAMPLES / name).read_text())
    md["metadata"].setdefault("uid", f"00000000-0000-0000-0000-{len(name):012d}")
    return md


def render(name: str) -> list[dict]:
    options = RenderOptions(
        images=EngineImages(
            "ghcr.io/pagefleet/pagefleet:test", "ghcr.io/pagefleet/pagefleet:test-cuda"
        ),
        prometheus_url=PROMETHEUS,
    )
    return desired_objects(load_example(name), options)


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_manifests(case):
    """Rendered objects equal the reviewed golden file (PAGEFLEET_UPDATE_GOLDEN=1 rewrites)."""
    rendered = yaml.safe_dump_all(render(GOLDEN_CASES[case]), sort_keys=True)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("PAGEFLEET_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered)
    assert rendered == path.read_text(), f"{path} differs; review, then regenerate"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_rendered_objects_validate_strictly(case, version):
    objects = render(GOLDEN_CASES[case])
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "Role", "RoleBinding"} <= kinds
    for obj in objects:
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's CRD schemas are not bundled with kubernetes-validate
        if obj["kind"] == "LeaderWorkerSet":
            validate_leader_worker_set(obj, (version,))  # tests/lws_schema.py
            continue
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_crd_validates_strictly(version):
    kubernetes_validate.validate(crd(), version, strict=True)


def test_strict_validation_catches_a_broken_manifest():
    """The validator above is not a rubber stamp: a typo'd field fails it."""
    deployment = copy.deepcopy(
        next(o for o in render("colocated.yaml") if o["kind"] == "Deployment")
    )
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30.0", strict=True)


def test_engine_pods_follow_the_shared_contract():
    objects = render("disaggregated.yaml")
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    prefill = deployments["llama-pd-prefill"]
    decode = deployments["llama-pd-decode"]
    router = deployments["llama-pd-router"]
    pod = prefill["spec"]["template"]
    assert pod["metadata"]["labels"]["pagefleet.io/model"] == "llama-3-8b"
    assert pod["metadata"]["labels"]["pagefleet.io/role"] == "prefill"
    assert decode["spec"]["template"]["metadata"]["labels"]["pagefleet.io/role"] == "decode"
    command = pod["spec"]["containers"][0]["command"]
    assert command[:3] == ["pagefleet", "serve", "/models/llama-3-8b"]
    assert command[command.index("--served-model-name") + 1] == "llama-3-8b"
    # Deployment-wide args, then the pool's; bools as --x / --no-x.
    assert command[command.index("--max-model-len") + 1] == "8192"
    assert "--no-enable-chunked-prefill" in command
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer == {
        "kv_connector": "nixl",
        "kv_role": "kv_producer",
        "kv_ip": "$(POD_IP)",
        "kv_port": 14579,
    }
    decode_cmd = decode["spec"]["template"]["spec"]["containers"][0]["command"]
    assert json.loads(decode_cmd[decode_cmd.index("--kv-transfer-config") + 1])["kv_role"] == (
        "kv_consumer"
    )
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://$(POD_IP):5557" and events["enable_kv_cache_events"]
    assert events["replay_endpoint"] == "tcp://$(POD_IP):5558"
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558, "kv-transfer": 14579}
    # builtin autoscaling starts at spec replicas, clamped into [min, max].
    assert decode["spec"]["replicas"] == 2
    router_cmd = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert router_cmd[router_cmd.index("--selector") + 1] == (
        "pagefleet.io/deployment=llama-pd,pagefleet.io/model=llama-3-8b"
    )
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    config = yaml.safe_load(config_map["data"]["router.yaml"])
    assert config["pd_threshold_tokens"] == 512 and config["scorers"]["prefix"] == 3
    for obj in objects:
        assert obj["metadata"]["ownerReferences"][0]["kind"] == "ModelDeployment"


def test_autoscaler_replicas_and_keda_ownership():
    md = load_example("disaggregated.yaml")
    objects = desired_objects(md, RenderOptions(replicas={"decode": 6, "prefill": 9}))
    by_name = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    assert by_name["llama-pd-decode"]["spec"]["replicas"] == 6
    # autoscaling none: the handler's choice (the Deployment's own between spec changes)...
    assert by_name["llama-pd-prefill"]["spec"]["replicas"] == 9
    unchosen = desired_objects(md, RenderOptions(replicas={"decode": 6}))
    prefill = next(o for o in unchosen if o["metadata"]["name"] == "llama-pd-prefill")
    assert prefill["spec"]["replicas"] == 1  # ...else spec.pools.prefill.replicas
    too_many = desired_objects(md, RenderOptions(replicas={"decode": 50}))
    assert (
        next(o for o in too_many if o["metadata"]["name"] == "llama-pd-decode")["spec"]["replicas"]
        == 8
    )  # clamped to maxReplicas
    keda = render("keda.yaml")
    scaled = next(o for o in keda if o["kind"] == "ScaledObject")
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "8"
    assert trigger["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 10)
    assert scaled["spec"]["cooldownPeriod"] == 600
    deployment = next(o for o in keda if o["kind"] == "Deployment")
    assert "replicas" not in deployment["spec"]  # KEDA's HPA owns it
    with pytest.raises(SpecError, match="prometheus-url"):
        desired_objects(load_example("keda.yaml"))


def test_engine_flags_shape():
    assert engine_flags({"max-num-seqs": 8, "enforce-eager": True, "x": False, "d": 0.5}) == [
        "--max-num-seqs",
        "8",
        "--enforce-eager",
        "--no-x",
        "--d",
        "0.5",
    ]


def strict_fields(schema: dict) -> dict:
    """The API server's strict field validation (kubectl's default) as JSON Schema: objects
    with declared properties accept nothing else, unless they preserve unknown fields."""
    schema = copy.deepcopy(schema)

    def visit(node: dict) -> None:
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for child in node.get("properties", {}).values():
            visit(child)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                visit(node[key])

    visit(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def schema_errors(md: dict) -> list[str]:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    validator = jsonschema.Draft4Validator(strict_fields(schema))
    return [e.message for e in validator.iter_errors(md)]


def examples(prefix: str = "") -> list[str]:
    return sorted(p.name for p in EXAMPLES.glob(f"{prefix}*.yaml"))


@pytest.mark.parametrize("name", [n for n in examples() if not n.startswith("invalid-")])
def test_valid_examples_pass_the_crd_schema_and_the_operator(name):
    md = load_example(name)
    assert schema_errors(md) == []
    parse_spec(md["spec"])


@pytest.mark.parametrize("name", examples("invalid-"))
def test_invalid_examples_are_rejected(name):
    """Each invalid example names the error it must get: `expect:` from the schema itself,
    `expect-cel:` from one of the CRD's x-kubernetes-validations rules (which jsonschema
    cannot run; the operator enforces the same rule and says the same), `expect-operator:`
    from the operator alone (the API server admits it; the ModelDeployment goes Degraded)."""
    text = (EXAMPLES / name).read_text()
    header = text.splitlines()[0]
    kind, _, expected = header.lstrip("# ").partition(": ")
    md = yaml.safe_load(text)
    if kind == "expect":
        errors = schema_errors(md)
        assert any(expected in e for e in errors), errors
    else:
        assert kind in ("expect-cel", "expect-operator")
        rules = json.dumps(crd())
        if kind == "expect-cel":
            assert expected in rules, "the CRD has no CEL rule with this message"
        assert schema_errors(md) == []  # only the CEL rule or the operator catches it
    md["metadata"]["uid"] = "uid"
    with pytest.raises(SpecError) as caught:
        desired_objects(md, RenderOptions(prometheus_url=PROMETHEUS))
    if kind != "expect":
        assert expected in str(caught.value)


def test_there_are_invalid_examples_of_each_kind():
    heads = {(EXAMPLES / n).read_text().split(":")[0] for n in examples("invalid-")}
    assert heads == {"# expect", "# expect-cel", "# expect-operator"}


def test_chart_crd_file_is_the_rendered_crd():
    assert CRD_FILE.read_text() == render_crd(), "regenerate: pagefleet operator crd > " + str(
        CRD_FILE.relative_to(ROOT)
    )


def test_operator_crd_subcommand_prints_it(capsys):
    assert main(["operator", "crd"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == crd()
    assert printed["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == (
        ".spec.pools.colocated.replicas"
    )


def _deployment_named(objects: list[dict], name: str) -> dict:
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name)


def _container(objects: list[dict], name: str) -> dict:
    return _deployment_named(objects, name)["spec"]["template"]["spec"]["containers"][0]


def expand(command: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's command from its environment."""
    out = []
    for arg in command:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        out.append(arg)
    return out


def test_pd_pods_advertise_and_bind_their_own_pod_ip():
    """Catches prefill/decode pods binding and advertising 127.0.0.1 for KV transfer (a decode
    pod then dials its own loopback and every prefill pod holds its blocks for 120 s)."""
    from pagefleet.common.kv_peer import peer_target
    from pagefleet.engine.kv_transfer.connector import KVTransferConfig

    objects = render("disaggregated.yaml")
    for name, role in (("llama-pd-prefill", "kv_producer"), ("llama-pd-decode", "kv_consumer")):
        container = _container(objects, name)
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        command = expand(container["command"], {"POD_IP": "10.42.0.7"})
        config = KVTransferConfig.parse(command[command.index("--kv-transfer-config") + 1])
        assert (config.kv_ip, config.kv_role) == ("10.42.0.7", role)
        # It listens where it advertises, on the port its container declares.
        assert (config.kv_bind_host or config.kv_ip) == "10.42.0.7"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert config.kv_port == ports["kv-transfer"]
        assert peer_target(config.kv_bind_host or config.kv_ip, config.kv_port) == "10.42.0.7:14579"


def test_engine_args_override_the_operators_flags_and_merge_into_its_json_configs():
    """Catches the operator's flags coming after engineArgs (argparse keeps the last, so a user
    could not override them) and a user's kv-transfer-config replacing the operator's whole
    JSON (dropping kv_ip, back to 127.0.0.1)."""
    from pagefleet.common.cli import build_parser

    md = load_example("disaggregated.yaml")
    md["spec"]["engineArgs"]["host"] = "::"
    md["spec"]["engineArgs"]["kv-transfer-config"] = '{"transfer_timeout": 60}'
    md["spec"]["pools"]["decode"]["engineArgs"]["kv-transfer-config"] = '{"kv_connector": "tcp"}'
    md["spec"]["pools"]["decode"]["engineArgs"]["kv-events-config"] = '{"buffer_steps": 500}'
    objects = desired_objects(md)
    decode = expand(_container(objects, "llama-pd-decode")["command"], {"POD_IP": "10.42.0.8"})
    args = build_parser().parse_args(decode[1:])
    assert args.host == "::"
    transfer = json.loads(args.kv_transfer_config)
    assert transfer == {
        "kv_connector": "tcp",
        "kv_role": "kv_consumer",
        "kv_ip": "10.42.0.8",
        "kv_port": 14579,
        "transfer_timeout": 60,
    }
    events = json.loads(args.kv_events_config)
    assert events["buffer_steps"] == 500 and events["replay_endpoint"] == "tcp://10.42.0.8:5558"
    assert decode.count("--kv-transfer-config") == 1 and decode.count("--kv-events-config") == 1
    prefill = _container(objects, "llama-pd-prefill")["command"]
    assert json.loads(prefill[prefill.index("--kv-transfer-config") + 1])["kv_connector"] == "nixl"


def test_a_pooling_deployment_starts_its_engines_with_the_pooling_runner():
    """spec.runner pooling reaches every engine as --runner pooling, and a pool's pooler-config
    keys merge over the deployment's, as `pagefleet serve` parses them (issue 36)."""
    from pagefleet.common.cli import build_parser
    from pagefleet.engine.server.serve import engine_args_from

    md = load_example("embeddings.yaml")
    md["spec"]["pools"]["colocated"]["engineArgs"] = {"pooler-config": '{"dimensions": 256}'}
    command = _container(desired_objects(md), "embed-colocated")["command"]
    args = engine_args_from(build_parser().parse_args(command[1:]))
    assert args.runner == "pooling"
    pooler = {"pooling_type": "LAST", "normalize": True, "dimensions": 256}
    assert json.loads(args.pooler_config) == pooler
    assert "--runner" not in _container(render("colocated.yaml"), "llama-colocated")["command"]


@pytest.mark.parametrize("value", ["not json", "[1, 2]", 7])
def test_a_kv_config_engine_arg_must_be_a_json_object(value):
    md = load_example("disaggregated.yaml")
    md["spec"]["pools"]["prefill"]["engineArgs"]["kv-transfer-config"] = value
    with pytest.raises(SpecError, match=r"spec\.pools\.prefill\.engineArgs\.kv-transfer-config"):
        parse_spec(md["spec"])


def test_engines_publish_events_on_their_pod_ip_with_a_replay_endpoint_the_router_dials():
    """Catches KV events without a replay endpoint (a restarted router dials port + 1 to catch
    up and nothing answers) and events bound to every interface (`tcp://*`) instead of the one
    address the router dials."""
    from pagefleet.engine.kv_event_publisher import KVEventsConfig

    pods = [
        _container(render("colocated.yaml"), "llama-colocated"),
        _container(render("disaggregated.yaml"), "llama-pd-prefill"),
    ]
    for container in pods:
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        command = expand(container["command"], {"POD_IP": "10.42.0.7"})
        config = KVEventsConfig.from_json(command[command.index("--kv-events-config") + 1])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert config.endpoint == f"tcp://10.42.0.7:{ports['kv-events']}"
        assert config.replay_endpoint == f"tcp://10.42.0.7:{ports['kv-events'] + 1}"
        assert ports["kv-replay"] == ports["kv-events"] + 1


def test_an_approximate_index_means_no_kv_events_anywhere():
    """Catches engines publishing KV events (every prompt's block hashes) that no router reads:
    with `router.prefixIndex: approximate` there is no publisher, no event port on the pods,
    their Service or their NetworkPolicy, and the router subscribes to nothing."""
    from pagefleet.common.cli import build_parser

    md = load_example("disaggregated.yaml")
    md["spec"]["router"]["prefixIndex"] = "approximate"
    objects = desired_objects(md)
    router = build_parser().parse_args(_container(objects, "llama-pd-router")["command"][1:])
    assert router.prefix_index == "approximate"
    text = json.dumps(objects)
    assert "kv-events" not in text and "5557" not in text and "5558" not in text


@pytest.mark.parametrize("example", ["colocated.yaml", "keda.yaml", "hostpath-minimal.yaml"])
def test_router_lives_on_livez_and_follows_engine_kv_events_with_the_models_tokenizer(example):
    """Catches a router liveness probe on /health (503 while no engine is healthy: restarts
    while engines load) and a router without the precise index (a restarted router could not
    rebuild it by replay) or without the tokenizer that makes its hashes match the engines'."""
    from pagefleet.common.cli import build_parser

    objects = render(example)
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    router = next(d for d in deployments if d["metadata"]["name"].endswith("-router"))
    engine = next(d for d in deployments if d is not router)
    pod, engine_pod = router["spec"]["template"]["spec"], engine["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    args = build_parser().parse_args(container["command"][1:])
    assert args.prefix_index == "precise"
    engine_ports = {p["name"]: p["containerPort"] for p in engine_pod["containers"][0]["ports"]}
    assert args.kv_events_port == engine_ports["kv-events"]
    assert engine_ports["kv-replay"] == args.kv_events_port + 1
    # The tokenizer is the engines' checkpoint, read from the same source.
    assert args.tokenizer == engine_pod["containers"][0]["command"][2]
    mount = next(m for m in container["volumeMounts"] if args.tokenizer.startswith(m["mountPath"]))
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    engine_volume = next(v for v in engine_pod["volumes"] if v["name"] == "model")
    if "emptyDir" in engine_volume:  # source image: its init container copies the files
        (init,) = pod["initContainers"]
        assert "emptyDir" in volume and init["image"] == engine_pod["initContainers"][0]["image"]
        assert init["volumeMounts"] == [{"name": mount["name"], "mountPath": mount["mountPath"]}]
    else:
        assert volume == engine_volume


def test_the_routers_copy_from_a_weights_image_is_a_loadable_tokenizer_without_weights(
    tiny_checkpoints, tmp_path
):
    """Runs the router's init container script on a real checkpoint: the tokenizer loads from
    the copy (as `pagefleet router --tokenizer` loads it), and no weights were copied."""
    import subprocess

    from pagefleet.common.tokenizer import load_tokenizer

    objects = render("keda.yaml")
    router = _deployment_named(objects, "qwen-router")
    (init,) = router["spec"]["template"]["spec"]["initContainers"]
    (env,) = init["env"]
    assert env["name"] == "SOURCE"
    script = init["command"][-1].replace("/models/", f"{tmp_path}/")
    source = tiny_checkpoints["llama"]
    done = subprocess.run(["sh", "-c", script], env={"SOURCE": source}, capture_output=True)
    assert done.returncode == 0, done.stderr
    copied = {p.name for p in tmp_path.iterdir()}
    assert not any(name.endswith((".safetensors", ".bin", ".pt")) for name in copied), copied
    assert any(p.suffix == ".safetensors" for p in Path(source).iterdir())
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer("a cache block").input_ids == load_tokenizer(source)("a cache block").input_ids


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/srv/models/tiny", True),
        ("/srv/models", True),
        ("/srv/models/", True),
        ("/srv/models/../../etc", False),  # normalised before comparing
        ("/srv/models-evil/tiny", False),  # a prefix of the text, not of the path
        ("/etc", False),
        ("srv/models/tiny", False),  # relative: the kubelet's working directory
        ("/data/llama", True),
    ],
)
def test_host_path_model_sources_only_inside_the_allowlist(path, allowed):
    """Catches a hostPath model source reading any folder of the node (/etc, the kubelet's
    credentials) into engine pods: the operator renders it only under --allowed-host-paths."""
    from pagefleet.operator.spec import HostPathNotAllowed

    md = load_example("hostpath-minimal.yaml")
    md["spec"]["model"]["path"] = path
    options = RenderOptions(allowed_host_paths=("/srv/models", "/data/"))
    if allowed:
        objects = desired_objects(md, options)
        volume = _deployment_named(objects, "tiny-colocated")["spec"]["template"]["spec"]
        assert {"name": "model", "hostPath": {"path": path, "type": "Directory"}} in (
            volume["volumes"]
        )
    else:
        with pytest.raises(HostPathNotAllowed, match="--allowed-host-paths") as refused:
            desired_objects(md, options)
        assert refused.value.reason == "HostPathNotAllowed"
    # No allowlist (the operator's default) refuses every hostPath source.
    with pytest.raises(HostPathNotAllowed, match="none"):
        desired_objects(md, RenderOptions(allowed_host_paths=()))


def test_api_key_secret_reaches_the_router_and_never_the_engines():
    """spec.apiKeySecret: the key clients must send the router, from the Secret (never in the
    pod spec as text); engines keep their own key from the fleet Secret, so a client's key does
    not open an engine."""
    md = load_example("colocated.yaml")
    md["spec"]["apiKeySecret"] = {"name": "llama-api-key", "key": "api-key"}
    assert schema_errors(md) == []
    objects = desired_objects(md)
    router_env = {e["name"]: e for e in _container(objects, "llama-router")["env"]}
    assert router_env["PAGEFLEET_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "llama-api-key", "key": "api-key"}
    }
    assert router_env["PAGEFLEET_UPSTREAM_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "llama-fleet-secret", "key": "engine-api-key"}
    }
    engine_env = {e["name"]: e for e in _container(objects, "llama-colocated")["env"]}
    assert engine_env["PAGEFLEET_API_KEY"] == router_env["PAGEFLEET_UPSTREAM_API_KEY"] | {
        "name": "PAGEFLEET_API_KEY"
    }
    assert "llama-api-key" not in json.dumps(_deployment_named(objects, "llama-colocated"))
    for bad, needle in [
        ({"name": "Llama_Key", "key": "k"}, "must name a Secret"),
        ({"name": "llama-api-key", "key": "a/b"}, "must be a Secret key"),
        ({"name": "llama-api-key"}, "must be a Secret key"),
        ({"name": "llama-api-key", "key": "k", "value": "hunter2"}, "unknown field"),
    ]:
        md["spec"]["apiKeySecret"] = bad
        with pytest.raises(SpecError, match=needle):
            parse_spec(md["spec"])
        assert schema_errors(md), bad  # the CRD's schema refuses it too


def test_network_policy_peers_from_the_operators_flag():
    from pagefleet.operator.network_policy import DEFAULT_OPERATOR_PEER, PeersError, PolicyPeers

    assert PolicyPeers.from_json("{}") == PolicyPeers()
    assert PolicyPeers().operator_from == (DEFAULT_OPERATOR_PEER,)
    prometheus = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    api = {"ipBlock": {"cidr": "10.0.0.1/32"}}
    peers = PolicyPeers.from_json(
        json.dumps({"metricsFrom": [prometheus], "apiServer": {"to": [api], "ports": [443]}})
    )
    assert peers.metrics_from == (prometheus,) and peers.api_server_to == (api,)
    assert peers.api_server_ports == (443,)
    md = load_example("colocated.yaml")
    objects = desired_objects(md, RenderOptions(network_policy=peers))
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    engines, router = policies["llama-colocated"], policies["llama-router"]
    (metrics_rule,) = [r for r in engines["spec"]["ingress"] if r["ports"][0]["port"] == 8000]
    assert prometheus in metrics_rule["from"]
    assert {"ports": [{"port": 443, "protocol": "TCP"}], "to": [api]} in router["spec"]["egress"]
    for bad in [
        '{"metricFrom": []}',
        "[]",
        '{"apiServer": {"ports": [0]}}',
        '{"dns": {"to": [{}]}}',
    ]:
        with pytest.raises(PeersError):
            PolicyPeers.from_json(bad)
    # Off: no policy at all.
    off = desired_objects(md, RenderOptions(network_policy=None))
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]


def test_operator_flags_for_host_paths_and_network_policies():
    from pagefleet.common.cli import build_parser
    from pagefleet.operator.main import allowed_host_paths, network_policy_peers

    parser = build_parser()
    args = parser.parse_args(
        ["operator", "--allowed-host-paths", "/srv/models,/data", "--allowed-host-paths", "/x"]
    )
    assert allowed_host_paths(args.allowed_host_paths) == ("/srv/models", "/data", "/x")
    assert network_policy_peers(args) is not None  # on by default
    assert allowed_host_paths(parser.parse_args(["operator"]).allowed_host_paths) == ()
    with pytest.raises(ValueError, match="absolute"):
        allowed_host_paths(["models"])
    assert network_policy_peers(parser.parse_args(["operator", "--no-network-policies"])) is None
