"""Scenarios: what issue 17 added, run the way users run it. A pool's and the router's pod
overrides (env from a literal, a Secret and a ConfigMap, an extra Secret volume, pod labels and
annotations) reach the processes the kubelet started; an `hf://` model is downloaded by the
init containers from a gated Hugging Face endpoint inside the lab, once for replicas sharing a
cache claim, through the egress rule the operator emits for it, and a wrong token ends in a
one-line message in the pod's status; a pool without autoscaling keeps a `kubectl scale` of its
Deployment until its spec replicas change."""

from __future__ import annotations

import base64
import os
from pathlib import Path

from hf_stand_in import HfStandIn
from pagefleet.common.model_download import TOKENIZER_PATTERNS, select_files

from .conftest import open_lab
from .fleet import (
    CPU_ENGINE_ARGS,
    assert_serves_as_offline,
    md_pods,
    policy_check,
    prepare_namespace,
    router_pods,
    router_url,
    simulated_deployment,
    start_operator,
    wait_serving,
)
from .flows import Connection, namespace_labels, violations

NAMESPACE = "serving"


def secret(name: str, data: dict[str, str]) -> dict:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "data": encoded,
    }


def config_map(name: str, data: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "data": data,
    }


def claim(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }


def model_deployment(name: str, model: dict, pool: dict, router: dict | None = None) -> dict:
    spec = {"model": model, "engineArgs": dict(CPU_ENGINE_ARGS), "pools": {"colocated": pool}}
    if router:
        spec["router"] = router
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def container_pid(pod: dict, container: str) -> int:
    """The process the lab's kubelet started for the container (its containerID)."""
    (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == container]
    return int(status["containerID"].removeprefix("lab://"))


def process_env(pid: int) -> dict[str, str]:
    """The environment the process was started with, as /proc shows it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = [item.partition(b"=") for item in raw.split(b"\0") if item]
    return {k.decode(): v.decode() for k, _, v in pairs}


def in_process_view(pid: int, path: str) -> Path:
    """`path` as the process sees it (its own mount namespace, through /proc/PID/root)."""
    return Path(f"/proc/{pid}/root") / path.lstrip("/")


def readable_by(path: Path, pid: int) -> bool:
    """Whether the process' user (uid and groups, from /proc) may read the file."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    uid = int(status["Uid"].split()[1])
    groups = {int(g) for g in status["Groups"].split()} | {int(status["Gid"].split()[1])}
    st = path.stat()
    if uid == 0 or (st.st_uid == uid and st.st_mode & 0o400):
        return True
    return bool((st.st_gid in groups and st.st_mode & 0o040) or st.st_mode & 0o004)


def test_pod_overrides_reach_the_engine_and_router_processes(tmp_path, model_store, offline):
    """A pool sets env (a literal and a Secret key), envFrom a ConfigMap, a Secret volume
    mounted read-only, pod labels and annotations; the router sets env. The processes the
    kubelet runs see exactly those values and that file, the pods carry the labels and
    annotations, and the fleet still serves the offline engine's greedy text."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NAMESPACE)
        lab.kube.create(secret("search-credentials", {"api-token": "tok-3f9a", "unused": "x"}))
        lab.kube.create(config_map("engine-tuning", {"TUNING_PROFILE": "lab", "TUNING_LEVEL": "2"}))
        lab.kube.create(secret("engine-files", {"settings.toml": "mode = 'lab'\nlevel = 2\n"}))
        start_operator(lab, "--autoscale-interval", "1")
        pool = {
            "replicas": 1,
            "env": [
                {"name": "TEAM_NAME", "value": "search"},
                {
                    "name": "SEARCH_API_TOKEN",
                    "valueFrom": {
                        "secretKeyRef": {"name": "search-credentials", "key": "api-token"}
                    },
                },
            ],
            "envFrom": [{"configMapRef": {"name": "engine-tuning"}}],
            "volumes": [
                {"name": "settings", "secret": {"secretName": "engine-files", "defaultMode": 0o440}}
            ],
            "volumeMounts": [
                {"name": "settings", "mountPath": "/etc/engine-settings", "readOnly": True}
            ],
            "podLabels": {"team": "search"},
            "podAnnotations": {"example.com/owner": "search-team"},
        }
        router = {"env": [{"name": "ROUTER_REGION", "value": "lab-east"}]}
        model = {"name": "tiny", "pvc": {"claimName": "models", "path": "tiny"}}
        lab.kube.create(model_deployment("tuned", model, pool, router))
        (engine,) = wait_serving(lab, NAMESPACE, "tuned", engines=1)
        (router_pod,) = md_pods(lab, NAMESPACE, "tuned", "router")

        engine_pid = container_pid(engine, "engine")
        seen = process_env(engine_pid)
        wanted = {
            "TEAM_NAME": "search",
            "SEARCH_API_TOKEN": "tok-3f9a",
            "TUNING_PROFILE": "lab",
            "TUNING_LEVEL": "2",
        }
        assert {k: seen.get(k) for k in wanted} == wanted
        assert "unused" not in seen  # only the key named, not the whole Secret
        settings = in_process_view(engine_pid, "/etc/engine-settings/settings.toml")
        assert settings.read_text() == "mode = 'lab'\nlevel = 2\n"
        assert readable_by(settings, engine_pid), oct(settings.stat().st_mode)
        with open(f"/proc/{engine_pid}/mountinfo") as mounts:  # read-only, as mounted
            (line,) = [m for m in mounts if " /etc/engine-settings " in m]
        assert "ro" in line.split()[5].split(","), line

        router_env = process_env(container_pid(router_pod, "router"))
        assert router_env.get("ROUTER_REGION") == "lab-east"
        assert "TEAM_NAME" not in router_env  # the pool's overrides stay on the pool's pods

        assert engine["metadata"]["labels"]["team"] == "search"
        assert engine["metadata"]["annotations"]["example.com/owner"] == "search-team"
        assert engine["metadata"]["labels"]["pagefleet.io/deployment"] == "tuned"
        assert_serves_as_offline(lab, router_url(lab, NAMESPACE, "tuned"), "tiny", offline)


HF_REPO = "lab-org/tiny"
GRANTED_TOKEN = "hf_lab_granted_0123456789"
WRONG_TOKEN = "hf_lab_not_granted_9876543210"


def hf_model(endpoint: str, token_secret: str, cache_claim: str | None) -> dict:
    model = {
        "name": "tiny",
        "uri": f"hf://{HF_REPO}@main",
        "hf": {"endpoint": endpoint, "tokenSecret": {"name": token_secret, "key": "token"}},
    }
    if cache_claim:
        model["cache"] = {"claimName": cache_claim}
    return model


def endpoint_port(hub: HfStandIn) -> int:
    return int(hub.endpoint.rsplit(":", 1)[1])


def download_connections(lab, hub: HfStandIn) -> list[Connection]:
    """Connections the namespace's pods hold to the stand-in endpoint now."""
    connections, _ = policy_check(lab, NAMESPACE)
    return [c for c in connections if (c.server_ip, c.port) == (lab.node_ip, endpoint_port(hub))]


def without_download_rules(policies: list[dict], port: int) -> list[dict]:
    """The policies with their egress rule for the download port taken out."""
    out = []
    for policy in policies:
        spec = policy["spec"]
        egress = [
            r
            for r in spec.get("egress", [])
            if r.get("ports") != [{"port": port, "protocol": "TCP"}]
        ]
        out.append({**policy, "spec": {**spec, "egress": egress}})
    return out


def assert_download_egress_is_the_rule(lab, hub: HfStandIn) -> list[Connection]:
    """While file GETs are held, the init containers' connections to the endpoint are allowed
    by the namespace's policies, and only because of the download egress rule. The first held
    connection is checked at once and then released: huggingface_hub gives up on a read after
    10 s, and a retried download would count its files twice."""
    held = lab.wait_for(lambda: download_connections(lab, hub), 90, "an init container downloading")
    connections, dropped = policy_check(lab, NAMESPACE)
    assert not dropped, (dropped, connections)
    pods = [p for p in lab.kube.pods(NAMESPACE) if p["status"].get("podIP")]
    policies = lab.kube.list("networking.k8s.io/v1", "NetworkPolicy", NAMESPACE)
    namespaces = {
        n["metadata"]["name"]: namespace_labels(n) for n in lab.kube.list("v1", "Namespace")
    }
    blocked = violations(
        held, pods, without_download_rules(policies, endpoint_port(hub)), namespaces
    )
    assert len(blocked) == len(held), (blocked, held)
    return held


def test_a_gated_hf_model_is_downloaded_once_and_served(tmp_path, tiny_checkpoint, offline):
    """`model.uri: hf://lab-org/tiny@main` from a gated stand-in endpoint on the lab's node
    address, with the token from a Secret and a shared cache claim: 2 engines and the router
    get Ready and serve the offline engine's text; each weight file was sent once (the second
    replica waits on the lock, then reuses the copy), the router's init container fetched the
    tokenizer only; the init containers reach the endpoint through the download egress rule.
    Then a ModelDeployment whose token has no access: its engine's init container fails with
    a one-line message in the pod's status (the termination-log file, not the log's tail)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    cache.chmod(0o777)  # an RWX share the pods' user may write (the lab applies no fsGroup)
    with open_lab(tmp_path / "lab", claims={"hf-cache": str(cache)}) as lab:
        hub = lab.in_lab(HfStandIn, lab.node_ip, 0)  # bound inside the lab namespace
        with hub:
            sha = hub.add_repo(HF_REPO, tiny_checkpoint, gated_tokens={GRANTED_TOKEN})
            prepare_namespace(lab, NAMESPACE)
            lab.kube.create(claim("hf-cache"))
            lab.kube.create(secret("hf-token", {"token": GRANTED_TOKEN}))
            start_operator(lab, "--autoscale-interval", "1")
            hub.hold_files()
            model = hf_model(hub.endpoint, "hf-token", "hf-cache")
            lab.kube.create(model_deployment("tiny-hf", model, {"replicas": 2}))
            try:
                held = assert_download_egress_is_the_rule(lab, hub)
            finally:
                hub.release_files()
            assert {c.client.rsplit("-", 2)[0] for c in held} <= {
                "tiny-hf-colocated",
                "tiny-hf-router",
            }, held
            engines = wait_serving(lab, NAMESPACE, "tiny-hf", engines=2, timeout=240)
            assert_serves_as_offline(lab, router_url(lab, NAMESPACE, "tiny-hf"), "tiny", offline)

            files = sorted(hub.repos[HF_REPO].commits[sha])
            tokenizer = set(select_files(files, TOKENIZER_PATTERNS))
            weights = [f for f in files if f.endswith(".safetensors")]
            assert weights and not set(weights) & tokenizer
            # Every file once for the engines (one download into the shared claim), the
            # tokenizer's once more for the router's own volume, no weights for the router.
            assert hub.file_gets(HF_REPO) == {f: 1 + (f in tokenizer) for f in files}
            states = [lab.pod_log(p, "download-model").splitlines()[-2:] for p in engines]
            assert sum("downloaded in" in " ".join(s) for s in states) == 1, states
            assert sum("already complete" in " ".join(s) for s in states) == 1, states
            (router_pod,) = md_pods(lab, NAMESPACE, "tiny-hf", "router")
            router_pid = container_pid(router_pod, "router")
            listed = set(os.listdir(in_process_view(router_pid, f"/models/hf/{HF_REPO}/main")))
            assert tokenizer <= listed and not listed & set(weights), listed

            lab.kube.create(secret("hf-wrong-token", {"token": WRONG_TOKEN}))
            denied = hf_model(hub.endpoint, "hf-wrong-token", None)
            lab.kube.create(model_deployment("tiny-denied", denied, {"replicas": 1}))
            init = lab.wait_for(
                lambda: failed_init(md_pods(lab, NAMESPACE, "tiny-denied")),
                120,
                "the denied engine's init container to fail",
            )
            terminated = init["state"].get("terminated") or init["lastState"]["terminated"]
            assert terminated["exitCode"] == 2, terminated
            message = terminated.get("message")
            assert message == (
                f"the Hugging Face token (HF_TOKEN) has no access to model {HF_REPO}: accept "
                "the model's conditions on its page with the token's account, or set another "
                "token in the ModelDeployment's model.hf.tokenSecret\n"
            ), message
            assert WRONG_TOKEN not in message
            (pod,) = md_pods(lab, NAMESPACE, "tiny-denied")
            initialized = [c for c in pod["status"]["conditions"] if c["type"] == "Initialized"]
            assert initialized[0]["status"] == "False", pod["status"]


def failed_init(pods: list[dict]) -> dict | None:
    """The first engine pod's init container status once it has ended in failure."""
    for pod in pods:
        for status in pod["status"].get("initContainerStatuses", []):
            ended = status["state"].get("terminated") or status["lastState"].get("terminated")
            if ended and ended["exitCode"] != 0:
                return status
    return None


def test_a_hand_scaled_pool_keeps_its_pods_until_its_spec_replicas_change(tmp_path, model_store):
    """`kubectl scale deployment` of a pool without autoscaling: the second pod comes up and
    stays (no pass of the operator writes the Deployment's replicas back), the router routes
    to both; then an edit of the pool's replicas in the ModelDeployment is applied."""
    with open_lab(tmp_path / "lab", claims={"models": str(model_store)}) as lab:
        prepare_namespace(lab, NAMESPACE)
        start_operator(lab, "--autoscale-interval", "1")
        md = lab.kube.create(simulated_deployment("manual", NAMESPACE, {"replicas": 1}))
        wait_serving(lab, NAMESPACE, "manual", engines=1)
        url = router_url(lab, NAMESPACE, "manual")
        deployment = lab.kube.get("apps/v1", "Deployment", NAMESPACE, "manual-colocated")
        lab.kube.patch(deployment, {"spec": {"replicas": 2}}, "scale")  # kubectl scale
        scaled_at = len(lab.kube.history("apps/v1", "Deployment", NAMESPACE, "manual-colocated"))
        # Simulated engines are Ready in seconds: an operator that reverts the scale fails here.
        scaled = wait_serving(lab, NAMESPACE, "manual", engines=2, timeout=90)
        engines = {p["metadata"]["name"] for p in scaled}
        lab.wait_for(lambda: router_pods(lab, url) == engines, 30, "the router to use both")
        # The operator saw both pods ready (its status says so) and left the scale alone.
        lab.wait_for(
            lambda: pool_status(lab, "manual") == {"replicas": 2, "readyReplicas": 2},
            30,
            "the operator to report the hand-scaled pool",
        )
        since = lab.kube.history("apps/v1", "Deployment", NAMESPACE, "manual-colocated")
        assert {v["spec"]["replicas"] for v in since[scaled_at - 1 :] if v} == {2}
        assert {p["metadata"]["name"] for p in md_pods(lab, NAMESPACE, "manual")} == engines

        lab.kube.patch(md, {"spec": {"pools": {"colocated": {"replicas": 3}}}})
        three = {p["metadata"]["name"] for p in wait_serving(lab, NAMESPACE, "manual", 3)}
        assert engines < three
        lab.wait_for(lambda: router_pods(lab, url) == three, 30, "the router to use all three")


def pool_status(lab, name: str) -> dict:
    md = lab.kube.get("pagefleet.io/v1alpha1", "ModelDeployment", NAMESPACE, name)
    pool = ((md.get("status") or {}).get("pools") or {}).get("colocated") or {}
    return {k: pool.get(k) for k in ("replicas", "readyReplicas")}
