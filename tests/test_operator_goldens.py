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
    "multinode.yaml": ("llama-70b", "00000000-0000-0000-0000-000000000014", "llama-3-70b"),
}
# The goldens whose engines are Deployments (multinode.yaml's are a LeaderWorkerSet).
SINGLE_NODE = sorted(set(CASES) - {"multinode.yaml"})
MODEL_PATHS = {
    "colocated.yaml": "/models/llama-3-8b",
    "disaggregated.yaml": "/models/llama-3-8b",
    "keda.yaml": "/models",
    "multinode.yaml": "/models/llama-3-70b",
}
# The operator's flags: before every engineArgs flag (argparse keeps the last value, so a user
# can override any of them).
OPERATOR_FLAGS = (
    "--host",
    "--port",
    "--served-model-name",
    "--device",
    "--fleet-secret-file",
    "--kv-events-config",
)
# Each engine Deployment's engineArgs (deployment-wide, then the pool's), as the example says.
USER_FLAGS = {
    "llama-colocated": ["--max-model-len", "--max-num-seqs", "--enable-prefix-caching"],
    "llama-pd-prefill": [
        "--max-model-len",
        "--max-num-batched-tokens",
        "--no-enable-chunked-prefill",
    ],
    "llama-pd-decode": ["--max-model-len", "--max-num-seqs"],
    "qwen-colocated": ["--max-model-len"],
}
# Bound to the pod's own IP (the kubelet expands $(POD_IP)), not to every interface.
KV_EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://$(POD_IP):5557",
    "replay_endpoint": "tcp://$(POD_IP):5558",  # the router replays from port + 1
}
FLEET_SECRET_FILE = "/var/run/secrets/pagefleet.io/fleet/secret"
ENGINE_PORTS = {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
GPU = "nvidia.com/gpu"
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


@pytest.mark.parametrize("name", SINGLE_NODE)
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
    # Its own deployment's engines only: two ModelDeployments may serve one model name, and a
    # pod with copied labels is not one of its Deployments' pods.
    assert flag(command, "--selector") == f"pagefleet.io/deployment={md},pagefleet.io/model={model}"
    assert flag(command, "--deployment") == md
    assert flag(command, "--kubernetes-namespace") == "serving"
    assert flag(command, "--engine-port") == "8000"
    # Precise index from the engines' KV events (replayed from 5558 after a restart), hashed
    # with the engines' own tokenizer.
    assert flag(command, "--prefix-index") == "precise"
    assert flag(command, "--kv-events-port") == "5557"
    assert flag(command, "--tokenizer") == MODEL_PATHS[name]
    # spec.router.queue at its defaults (the router's own): no flow-control flag.
    assert not [f for f in command if f.startswith(("--queue-", "--saturation-"))]
    # Alive while it serves; ready while an engine is healthy (no pool here scales to 0).
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
    server = "http://prometheus-operated.monitoring.svc:9090"
    waiting, queued, running = scaled["spec"]["triggers"]
    # The engines' queue sizes the pool: ceil(sum / 8) replicas (targetWaitingPerReplica 8).
    assert waiting == {
        "type": "prometheus",
        "name": "engines-waiting",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": server,
            "query": 'sum(vllm:num_requests_waiting{namespace="serving",'
            'pod=~"qwen-colocated-.*",model_name="qwen2-7b"})',
            "threshold": "8",
        },
    }
    # The router's queue for the model: the demand Prometheus sees at zero pods. Active
    # (wakes a pool at 0) above 0, and sized like waiting requests after that.
    assert queued == {
        "type": "prometheus",
        "name": "router-queued",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": server,
            "query": 'sum(pagefleet_router:queued_requests{namespace="serving",'
            'pod=~"qwen-router-.*",model="qwen2-7b"})',
            "threshold": "8",
            "activationThreshold": "0",
        },
    }
    # Running requests keep the trigger active (KEDA never scales to 0 under them) but, at
    # a threshold no pool reaches, never ask for more than one pod.
    assert running == {
        "type": "prometheus",
        "name": "engines-running",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": server,
            "query": 'sum(vllm:num_requests_running{namespace="serving",'
            'pod=~"qwen-colocated-.*",model_name="qwen2-7b"})',
            "threshold": "1000000",
            "activationThreshold": "0",
        },
    }
    # minReplicas 1 here: KEDA's cooldownPeriod (which only acts at 0) follows the
    # scale-down window, 600 s.
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["cooldownPeriod"]) == (1, 600)


def secret_ref(env: list[dict], name: str) -> dict | None:
    found = [e for e in env if e["name"] == name]
    assert len(found) <= 1, name
    return found[0]["valueFrom"]["secretKeyRef"] if found else None


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_fleet_secret_reaches_the_router_and_every_engine_read_only(name):
    """The Secret the operator fills once, mounted read-only at the file each process is given
    with --fleet-secret-file; its second key is the API key engines require and the router
    sends them. Engines get no service-account token; the router keeps its own (discovery)."""
    md, _, _ = CASES[name]
    objects = golden(name)
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == f"{md}-fleet-secret"
    assert secret["type"] == "Opaque"
    assert "data" not in secret and "stringData" not in secret  # random, made at creation
    engine_key = {"name": f"{md}-fleet-secret", "key": "engine-api-key"}
    for deployment in deployments(objects).values():
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        assert flag(c["command"], "--fleet-secret-file") == FLEET_SECRET_FILE
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "fleet-secret"]
        assert mount == {
            "name": "fleet-secret",
            "mountPath": "/var/run/secrets/pagefleet.io/fleet",
            "readOnly": True,
        }
        (volume,) = [v for v in pod["volumes"] if v["name"] == "fleet-secret"]
        assert volume["secret"]["secretName"] == f"{md}-fleet-secret"
        assert volume["secret"]["items"] == [{"key": "secret", "path": "secret"}]
        assert volume["secret"]["defaultMode"] == 0o440  # the pod's fsGroup reads it
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        if component == "engine":
            assert pod["automountServiceAccountToken"] is False
            assert "serviceAccountName" not in pod
            assert secret_ref(c["env"], "PAGEFLEET_API_KEY") == engine_key
            assert secret_ref(c["env"], "PAGEFLEET_UPSTREAM_API_KEY") is None
        else:
            assert component == "router"
            assert pod["automountServiceAccountToken"] is True
            assert secret_ref(c["env"], "PAGEFLEET_UPSTREAM_API_KEY") == engine_key
            # The examples set no spec.apiKeySecret: clients need no key.
            assert secret_ref(c["env"], "PAGEFLEET_API_KEY") is None


def test_only_pd_pods_pin_nixls_ucx_ports():
    """NetworkPolicies open exactly UCX_TCP_PORT_RANGE between decode and prefill pods."""
    for name in sorted(CASES):
        for deployment in deployments(golden(name)).values():
            env = {e["name"]: e.get("value") for e in container(deployment)["env"]}
            role = deployment["spec"]["template"]["metadata"]["labels"].get("pagefleet.io/role")
            expected = "14580-14609" if role in ("prefill", "decode") else None
            assert env.get("UCX_TCP_PORT_RANGE") == expected, deployment["metadata"]["name"]


# The peers the policies name, by hand (NetworkPolicyPeer objects), for ModelDeployment `md`.
def pods_labelled(**labels: str) -> dict:
    return {"podSelector": {"matchLabels": labels}}


def peers_of(md: str) -> dict[str, dict]:
    return {
        "router": pods_labelled(
            **{"app.kubernetes.io/component": "router", "pagefleet.io/deployment": md}
        ),
        "engines": pods_labelled(
            **{"app.kubernetes.io/component": "engine", "pagefleet.io/deployment": md}
        ),
        "prefill": pods_labelled(**{"pagefleet.io/deployment": md, "pagefleet.io/pool": "prefill"}),
        "decode": pods_labelled(**{"pagefleet.io/deployment": md, "pagefleet.io/pool": "decode"}),
        "colocated": pods_labelled(
            **{"pagefleet.io/deployment": md, "pagefleet.io/pool": "colocated"}
        ),
        # The chart's operator pods, in any namespace (an operator started without
        # --network-policy-peers; the chart passes its own release's).
        "operator": {
            "namespaceSelector": {},
            **pods_labelled(
                **{"app.kubernetes.io/name": "pagefleet", "app.kubernetes.io/component": "operator"}
            ),
        },
    }


def network_policies(name: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in golden(name) if p["kind"] == "NetworkPolicy"}


def flows(policy: dict, direction: str, md: str) -> set[tuple[str, str, int, int | None]]:
    """(peer, protocol, port, endPort) for every peer x port a policy's rules allow in one
    direction; peer "any" where a rule names none (a peer not named above fails)."""
    names = {json.dumps(p, sort_keys=True): n for n, p in peers_of(md).items()}
    key = "from" if direction == "ingress" else "to"
    out = set()
    for rule in policy["spec"].get(direction, []):
        peers = [names[json.dumps(p, sort_keys=True)] for p in rule.get(key, [])] or ["any"]
        for peer in peers:
            for port in rule["ports"]:
                out.add((peer, port["protocol"], port["port"], port.get("endPort")))
    return out


def test_disaggregated_network_policies_allow_exactly_the_fleets_flows():
    """Read by hand: every pod denies what is not listed (both directions); nothing but the
    decode pods and the router reaches a prefill pod's KV-transfer port, nothing but the router
    the KV-event ports; the engines may call nothing but DNS (and decode pods their prefill
    pods); the router reaches the API server (discovery) and its own engines only."""
    md = "llama-pd"
    policies = network_policies("disaggregated.yaml")
    assert sorted(policies) == ["llama-pd-decode", "llama-pd-prefill", "llama-pd-router"]
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    dns = {("any", "TCP", 53, None), ("any", "UDP", 53, None)}
    api_server = {("any", "TCP", 443, None), ("any", "TCP", 6443, None)}
    http_in = {("router", "TCP", 8000, None), ("operator", "TCP", 8000, None)}
    events_in = {("router", "TCP", 5557, None), ("router", "TCP", 5558, None)}

    peers = peers_of(md)
    router = policies["llama-pd-router"]
    assert router["spec"]["podSelector"] == peers["router"]["podSelector"]
    assert flows(router, "ingress", md) == {("any", "TCP", 8080, None)}  # clients
    assert flows(router, "egress", md) == {
        ("engines", "TCP", 8000, None),
        ("engines", "TCP", 5557, None),
        ("engines", "TCP", 5558, None),
        ("prefill", "TCP", 14579, None),  # releases of blocks no decode pod took
        *api_server,
        *dns,
    }
    prefill = policies["llama-pd-prefill"]
    assert prefill["spec"]["podSelector"] == peers["prefill"]["podSelector"]
    assert flows(prefill, "ingress", md) == {
        *http_in,
        *events_in,
        ("decode", "TCP", 14579, None),
        ("router", "TCP", 14579, None),
        ("decode", "TCP", 14580, 14609),  # UCX (UCX_TCP_PORT_RANGE)
    }
    assert flows(prefill, "egress", md) == dns
    decode = policies["llama-pd-decode"]
    assert decode["spec"]["podSelector"] == peers["decode"]["podSelector"]
    assert flows(decode, "ingress", md) == {*http_in, *events_in}
    assert flows(decode, "egress", md) == {
        *dns,
        ("prefill", "TCP", 14579, None),
        ("prefill", "TCP", 14580, 14609),
    }
    # Each selector picks the pods it names, and no other pod of the deployment.
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in deployments(golden("disaggregated.yaml")).values()
    }

    def picks(peer: dict) -> set[str]:
        wanted = peer["podSelector"]["matchLabels"].items()
        return {name for name, labels in pods.items() if wanted <= labels.items()}

    assert picks(peers["router"]) == {"llama-pd-router"}
    assert picks(peers["engines"]) == {"llama-pd-prefill", "llama-pd-decode"}
    assert picks(peers["prefill"]) == {"llama-pd-prefill"}
    assert picks(peers["decode"]) == {"llama-pd-decode"}


def test_colocated_network_policies_open_no_kv_transfer_port():
    md = "llama"
    policies = network_policies("colocated.yaml")
    assert sorted(policies) == ["llama-colocated", "llama-router"]
    engines = policies["llama-colocated"]
    assert engines["spec"]["podSelector"] == peers_of(md)["colocated"]["podSelector"]
    assert flows(engines, "ingress", md) == {
        ("router", "TCP", 8000, None),
        ("operator", "TCP", 8000, None),
        ("router", "TCP", 5557, None),
        ("router", "TCP", 5558, None),
    }
    assert flows(engines, "egress", md) == {("any", "TCP", 53, None), ("any", "UDP", 53, None)}
    router = flows(policies["llama-router"], "egress", md)
    assert {port for _, _, port, _ in router} == {8000, 5557, 5558, 443, 6443, 53}


# multinode.yaml: tensorParallelSize 8 over nodes 2 (4 GPUs per pod), as a LeaderWorkerSet.
RAY_PORTS = {
    "--node-manager-port": "6380",
    "--object-manager-port": "6381",
    "--min-worker-port": "10002",
    "--max-worker-port": "19999",
}


def ray_flags(script: str) -> dict[str, str]:
    """`--flag=value` arguments of a shell command line (valueless flags left out)."""
    words = (w.strip("'") for w in script.split())
    return dict(w.split("=", 1) for w in words if w.startswith("--") and "=" in w)


def test_multinode_pool_is_one_leader_worker_set_with_a_ray_head_and_a_ray_worker():
    """The leader starts the group's Ray head and then execs the engine with TP 8 over Ray
    (RAY_ADDRESS: its own head); the worker waits for that head and joins it with every port
    pinned; each pod requests TP / nodes = 4 GPUs and tells Ray so; only the leader serves
    (probes, fleet secret, API key)."""
    objects = golden("multinode.yaml")
    assert not [o for o in objects if o["kind"] == "Deployment" and "colocated" in str(o)]
    (lws,) = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "llama-70b-colocated"
    assert lws["spec"]["replicas"] == 1  # builtin autoscaling starts at spec.replicas
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = (template[k]["spec"] for k in ("leaderTemplate", "workerTemplate"))
    (lead,) = leader["containers"]
    (work,) = worker["containers"]
    assert lead["command"][:2] == work["command"][:2] == ["sh", "-c"]
    head, _, serve = lead["command"][2].partition(" && exec ")
    assert head.startswith("ray start --head --port=6379 --include-dashboard=false")
    assert {k: ray_flags(head)[k] for k in RAY_PORTS} == RAY_PORTS
    assert ray_flags(head)["--node-ip-address"] == "$(POD_IP)"
    assert ray_flags(head)["--num-gpus"] == "4"
    assert serve.startswith("pagefleet serve /models/llama-3-70b ")
    assert " --tensor-parallel-size 8 --distributed-executor-backend ray " in serve
    assert "--device cuda" in serve
    assert {"name": "RAY_ADDRESS", "value": "$(POD_IP):6379"} in lead["env"]
    wait, _, join = work["command"][2].partition("; exec ")
    assert wait == (
        "until ray health-check '--address=$(LWS_LEADER_ADDRESS):6379' >/dev/null 2>&1; "
        "do sleep 2; done"
    )
    assert join.startswith("ray start '--address=$(LWS_LEADER_ADDRESS):6379' --block ")
    assert {k: ray_flags(join)[k] for k in RAY_PORTS} == RAY_PORTS
    assert ray_flags(join)["--num-gpus"] == "4"
    for c in (lead, work):
        assert c["resources"]["limits"][GPU] == c["resources"]["requests"][GPU] == 4
        assert POD_IP_ENV in c["env"]
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in c["env"]  # overrides reach both
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert probe_path(lead, probe) == ("/health", "http")
        assert probe not in work
    assert "fleet-secret" in {v["name"] for v in leader["volumes"]}
    assert "fleet-secret" not in {v["name"] for v in worker["volumes"]}
    assert secret_ref(work["env"], "PAGEFLEET_API_KEY") is None
    for pod in (leader, worker):
        (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"]["sizeLimit"] == "9Gi"  # 2Gi x 4 GPUs + 1Gi Ray object store
        assert {"name": "net.ipv4.ip_local_port_range", "value": "32768 60999"} in pod[
            "securityContext"
        ]["sysctls"]
        assert pod["automountServiceAccountToken"] is False


def test_multinode_service_targets_leaders_and_publishes_them_before_ready():
    """The Service named like the LeaderWorkerSet is the group's DNS subdomain (so the LWS
    controller makes none of its own) and the pool's headless Service: leaders only, listed
    while not ready so that workers resolve LWS_LEADER_ADDRESS before the engine serves."""
    (service,) = [
        o
        for o in golden("multinode.yaml")
        if o["kind"] == "Service" and o["metadata"]["name"] == "llama-70b-colocated"
    ]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {
        "pagefleet.io/deployment": "llama-70b",
        "pagefleet.io/pool": "colocated",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }
    (budget,) = [o for o in golden("multinode.yaml") if o["kind"] == "PodDisruptionBudget"]
    # The whole group: evicting any pod restarts its group, so every pod counts.
    assert budget["spec"]["selector"]["matchLabels"] == {
        "pagefleet.io/deployment": "llama-70b",
        "pagefleet.io/pool": "colocated",
    }


def test_multinode_pods_reach_each_other_on_rays_ports_and_the_ephemeral_range_only():
    md = "llama-70b"
    policies = network_policies("multinode.yaml")
    engines = policies["llama-70b-colocated"]
    group = {
        ("colocated", "TCP", 6379, None),  # Ray GCS (the leader's head)
        ("colocated", "TCP", 6380, None),  # raylets
        ("colocated", "TCP", 6381, None),  # object managers
        ("colocated", "TCP", 10002, 19999),  # Ray worker processes (the rank actors)
        ("colocated", "TCP", 32768, 60999),  # torch.distributed store, gloo, NCCL
    }
    assert flows(engines, "ingress", md) == {
        ("router", "TCP", 8000, None),
        ("operator", "TCP", 8000, None),
        ("router", "TCP", 5557, None),
        ("router", "TCP", 5558, None),
        *group,
    }
    assert flows(engines, "egress", md) == {
        ("any", "TCP", 53, None),
        ("any", "UDP", 53, None),
        *group,
    }
