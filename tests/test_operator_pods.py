"""Pure rendering of the pod-level ModelDeployment fields (issue 17): engine images by device,
--device, rollout strategies, GPU counts, hf:// and pvc:// model URIs, pod overrides and what
they may not touch, placement, RDMA, KEDA options, PodDisruptionBudgets and name checks; and
every object of two ModelDeployments that use all of them valid for Kubernetes 1.30 and 1.35."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pagefleet.common.cli import build_parser
from pagefleet.operator.pod_overrides import RESERVED_ENV, RESERVED_MOUNTS, RESERVED_VOLUMES
from pagefleet.operator.reconcile import EngineImages, RenderOptions, desired_objects
from pagefleet.operator.spec import SpecError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "modeldeployments"
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
PROMETHEUS = "http://prometheus.monitoring.svc:9090"
IMAGES = EngineImages("registry.test/engine:cpu", "registry.test/engine:cuda")
ROUTER_IMAGE = "registry.test/router:1"
GPU = {"limits": {"nvidia.com/gpu": 1}}
PVC_MODEL = {"name": "m", "pvc": {"claimName": "models", "path": "m"}}
HF_MODEL = {
    "name": "m",
    "uri": "hf://org/tiny@v2",
    "hf": {"tokenSecret": {"name": "hf", "key": "t"}},
}


def md(name: str = "md", **spec: Any) -> dict:
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": "serving", "uid": "uid-1"},
        "spec": {"model": PVC_MODEL, **spec},
    }


def pd(prefill: dict | None = None, decode: dict | None = None, **spec: Any) -> dict:
    gpu_pool = {"resources": GPU}
    pools = {
        "prefill": gpu_pool if prefill is None else prefill,
        "decode": gpu_pool if decode is None else decode,
    }
    return md(mode="disaggregated", pools=pools, **spec)


def render(model_deployment: dict, **options: Any) -> list[dict]:
    options = {"images": IMAGES, "router_image": ROUTER_IMAGE, **options}
    return desired_objects(model_deployment, RenderOptions(**options))


def obj(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def pod(objects: list[dict], name: str) -> dict:
    """A Deployment's pod template."""
    return obj(objects, "Deployment", name)["spec"]["template"]


def main_container(objects: list[dict], name: str) -> dict:
    return pod(objects, name)["spec"]["containers"][0]


def env(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def refused(model_deployment: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        render(model_deployment, prometheus_url=PROMETHEUS)


# Images and --device


def test_engine_images_follow_the_device_unless_the_spec_or_the_pool_names_one():
    """Fails for: a GPU pool on the CPU image (the issue's first finding), an override that
    does not win, or the router taking an engine image."""
    objects = render(pd(decode={}))
    assert main_container(objects, "md-prefill")["image"] == IMAGES.cuda
    assert main_container(objects, "md-decode")["image"] == IMAGES.cpu
    assert main_container(objects, "md-router")["image"] == ROUTER_IMAGE
    spec_wide = render(pd(decode={}, image="registry.test/mine:1"))
    assert main_container(spec_wide, "md-prefill")["image"] == "registry.test/mine:1"
    assert main_container(spec_wide, "md-decode")["image"] == "registry.test/mine:1"
    per_pool = render(pd(prefill={"resources": GPU, "image": "p:1"}, image="s:1"))
    assert main_container(per_pool, "md-prefill")["image"] == "p:1"
    assert main_container(per_pool, "md-decode")["image"] == "s:1"
    assert main_container(per_pool, "md-router")["image"] == ROUTER_IMAGE
    refused(pd(prefill={"resources": GPU, "image": ""}), "spec.pools.prefill.image")


def serve_args(container: dict) -> dict[str, Any]:
    """The engine's command as `pagefleet serve`'s own parser reads it."""
    command = container["command"]
    assert command[:2] == ["pagefleet", "serve"]
    return vars(build_parser().parse_args(command[1:]))


def test_device_is_explicit_and_a_users_engine_arg_comes_after_and_wins():
    """Fails for: --device missing (the engine would guess), or placed after the user's flags
    (the user could not force a device)."""
    objects = render(pd(decode={}))
    assert serve_args(main_container(objects, "md-prefill"))["device"] == "cuda"
    assert serve_args(main_container(objects, "md-decode"))["device"] == "cpu"
    forced = render(pd(prefill={"resources": GPU, "engineArgs": {"device": "cpu"}}))
    assert serve_args(main_container(forced, "md-prefill"))["device"] == "cpu"
    assert serve_args(main_container(forced, "md-decode"))["device"] == "cuda"
    spec_wide = render(md(pools={"colocated": {"resources": GPU}}, engineArgs={"device": "cpu"}))
    parsed = serve_args(main_container(spec_wide, "md-colocated"))
    assert parsed["device"] == "cpu" and parsed["model"] == "/models/m"


def test_gpu_pools_roll_without_a_surge_pod_and_a_users_strategy_wins():
    objects = render(pd(decode={}))
    assert obj(objects, "Deployment", "md-prefill")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert "strategy" not in obj(objects, "Deployment", "md-decode")["spec"]
    recreate = render(pd(prefill={"resources": GPU, "strategy": {"type": "Recreate"}}))
    assert obj(recreate, "Deployment", "md-prefill")["spec"]["strategy"] == {"type": "Recreate"}
    surge = {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}}
    rolled = render(pd(prefill={"resources": GPU, "strategy": surge}))
    assert obj(rolled, "Deployment", "md-prefill")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        **surge,
    }
    both = {"type": "Recreate", "rollingUpdate": {"maxSurge": 1}}
    refused(pd(prefill={"strategy": both}), "rollingUpdate goes with type RollingUpdate only")
    refused(pd(prefill={"strategy": {"rollingUpdate": {"maxSurge": "lots"}}}), "percentage")
    refused(pd(prefill={"strategy": {"type": "BlueGreen"}}), "strategy.type")


@pytest.mark.parametrize(
    ("pool", "match"),
    [
        (
            {"resources": {"limits": {"nvidia.com/gpu": 2}}},
            r"spec.pools.colocated: 2 nvidia.com/gpu per pod x 1 node\(s\), but "
            "tensorParallelSize is 1",
        ),
        (
            {"resources": {"requests": {"nvidia.com/gpu": "4"}}, "tensorParallelSize": 2},
            "4 nvidia.com/gpu per pod x 1 node",
        ),
        ({"resources": {"limits": {"nvidia.com/gpu": "500m"}}}, "must be a whole number"),
        ({"resources": GPU, "tensorParallelSize": 0}, "tensorParallelSize must be"),
    ],
)
def test_gpu_count_must_be_what_one_engine_uses(pool, match):
    refused(md(pools={"colocated": pool}), match)


def test_gpu_count_equal_to_the_engines_parallelism_is_accepted():
    two = {"resources": {"limits": {"nvidia.com/gpu": 2}}, "tensorParallelSize": 2}
    objects = render(md(pools={"colocated": two}))
    container = main_container(objects, "md-colocated")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["image"] == IMAGES.cuda
    # A CPU pool has no GPU count to check.
    render(md(pools={"colocated": {"tensorParallelSize": 2}}))


# Model URIs


def hf_objects(**model: Any) -> list[dict]:
    return render(md(model={**HF_MODEL, **model}, pools={"colocated": {"resources": GPU}}))


def test_hf_models_are_downloaded_by_an_init_container_that_alone_holds_the_token():
    """Fails for: the token in an engine's or the router's main container (both serve
    clients), HF_ENDPOINT ignored, the engine reading another path than the download's."""
    endpoint = "https://hf-mirror.example.com"
    objects = hf_objects(hf={"tokenSecret": {"name": "hf", "key": "t"}, "endpoint": endpoint})
    engine_pod = pod(objects, "md-colocated")["spec"]
    (init,) = engine_pod["initContainers"]
    assert init["name"] == "download-model" and init["image"] == IMAGES.cuda
    assert init["command"] == [
        "pagefleet",
        "download",
        "hf://org/tiny@v2",
        "--cache-dir",
        "/models",
    ]
    assert env(init) == {
        "HF_HUB_OFFLINE": "0",
        "HOME": "/tmp",
        "HF_ENDPOINT": endpoint,
        "HF_TOKEN": {"secretKeyRef": {"name": "hf", "key": "t"}},
    }
    assert {m["mountPath"]: m.get("readOnly", False) for m in init["volumeMounts"]} == {
        "/models": False,
        "/tmp": False,
    }
    engine = engine_pod["containers"][0]
    assert serve_args(engine)["model"] == "/models/hf/org/tiny/v2"
    assert env(engine)["HF_HUB_OFFLINE"] == "1"
    assert {"HF_TOKEN", "HF_ENDPOINT"}.isdisjoint(env(engine))
    assert next(m for m in engine["volumeMounts"] if m["name"] == "model")["readOnly"] is True
    assert {"name": "model", "emptyDir": {}} in engine_pod["volumes"]

    router_pod = pod(objects, "md-router")["spec"]
    (tokenizer,) = router_pod["initContainers"]
    assert tokenizer["name"] == "download-tokenizer" and tokenizer["image"] == ROUTER_IMAGE
    assert tokenizer["command"][-1] == "--tokenizer-only"
    assert env(tokenizer)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "t"}}
    router = router_pod["containers"][0]
    assert router["command"][router["command"].index("--tokenizer") + 1] == (
        "/models/hf/org/tiny/v2"
    )
    assert {"HF_TOKEN", "HF_ENDPOINT"}.isdisjoint(env(router))
    assert {"name": "model", "emptyDir": {}} in router_pod["volumes"]
    # The Secret's name appears nowhere but in the two download containers.
    for o in objects:
        text = json.dumps(o)
        if o["kind"] == "Deployment":
            for c in o["spec"]["template"]["spec"].get("initContainers", []):
                text = text.replace(json.dumps(c), "")
        assert '"name": "hf"' not in text, o["metadata"]["name"]


def test_hf_without_a_token_or_endpoint_and_with_a_shared_cache_claim():
    objects = hf_objects(uri="hf://org/tiny", hf={}, cache={"claimName": "hf-cache"})
    engine_pod = pod(objects, "md-colocated")["spec"]
    (init,) = engine_pod["initContainers"]
    assert init["command"][2] == "hf://org/tiny@main"
    assert env(init) == {"HF_HUB_OFFLINE": "0", "HOME": "/tmp"}
    # Replicas share the download: the claim, writable by the init container.
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}} in engine_pod[
        "volumes"
    ]
    assert serve_args(engine_pod["containers"][0])["model"] == "/models/hf/org/tiny/main"
    # The router never waits on the engines' cache: its own volume, its own download.
    assert {"name": "model", "emptyDir": {}} in pod(objects, "md-router")["spec"]["volumes"]


def egress_ports_to_anywhere(policy: dict) -> set[int]:
    return {
        p["port"]
        for rule in policy["spec"]["egress"]
        if "to" not in rule
        for p in rule["ports"]
        if p["port"] != 53
    }


@pytest.mark.parametrize(
    ("endpoint", "port"),
    [(None, 443), ("https://mirror.example.com:8443/hf", 8443), ("http://mirror.internal", 80)],
)
def test_hf_downloads_may_leave_on_the_endpoints_port_only(endpoint, port):
    hf = {"endpoint": endpoint} if endpoint else {}
    objects = hf_objects(hf=hf)
    for name in ("md-router", "md-colocated"):
        policy = obj(objects, "NetworkPolicy", name)
        # The router's API-server rule names ports 443 and 6443 (no peers by default).
        expected = {port, 443, 6443} if name == "md-router" else {port}
        assert egress_ports_to_anywhere(policy) == expected, name
    for name in ("md-router", "md-colocated"):
        policy = obj(render(md()), "NetworkPolicy", name)
        expected = {443, 6443} if name == "md-router" else set()
        assert egress_ports_to_anywhere(policy) == expected, "pvc sources download nothing"


@pytest.mark.parametrize("endpoint", ["http://mirror:99999", "https://mirror:port", "ftp://x"])
def test_an_hf_endpoint_without_a_usable_port_is_a_spec_error(endpoint):
    """Fails for: a ValueError from URL parsing escaping the renderer (the operator's pass
    would crash instead of reporting Degraded)."""
    refused(md(model={**HF_MODEL, "hf": {"endpoint": endpoint}}), "spec.model.hf.endpoint")


@pytest.mark.parametrize(
    ("uri", "pvc"),
    [
        ("pvc://models/llama/v1", {"claimName": "models", "path": "llama/v1"}),
        ("pvc://models", {"claimName": "models"}),
    ],
)
def test_a_pvc_uri_renders_what_the_pvc_source_renders(uri, pvc):
    by_uri = render(md(model={"name": "m", "uri": uri}))
    by_source = render(md(model={"name": "m", "source": "pvc", "pvc": pvc}))
    assert by_uri == by_source
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in (pod(by_uri, "md-colocated")["spec"]["volumes"])


@pytest.mark.parametrize(
    ("model", "match"),
    [
        ({"uri": "pvc://Bad_Claim/x"}, "is not a claim name"),
        ({"uri": "s3://bucket/model"}, "must start with hf:// or pvc://"),
        ({"uri": "hf://just-a-name"}, "spec.model.uri"),
        ({"uri": "hf://org/m", "path": "/x"}, "uri replaces source, pvc, image and path"),
        ({"uri": "pvc://models", "cache": {"claimName": "c"}}, "hf and cache go with an hf://"),
        ({"source": "pvc", "pvc": {"claimName": "c"}, "hf": {}}, "hf and cache go with an hf://"),
        ({"uri": "hf://org/m", "cache": {"claimName": "Bad"}}, "cache.claimName"),
        ({"uri": "hf://org/m", "hf": {"tokenSecret": {"name": "s"}}}, "tokenSecret.key"),
        ({"uri": "hf://org/m", "hf": {"token": "hf_xxx"}}, "unknown field"),
    ],
)
def test_bad_model_uris_are_refused(model, match):
    refused(md(model={"name": "m", **model}), match)


# Pod overrides

OVERRIDES: dict[str, Any] = {
    "env": [{"name": "EXTRA", "value": "1"}],
    "envFrom": [{"secretRef": {"name": "extra-env"}}],
    "volumes": [{"name": "scratch", "emptyDir": {}}],
    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
        }
    ],
    "podAnnotations": {"example.com/a": "x"},
    "podLabels": {"example.com/l": "y"},
    "imagePullSecrets": [{"name": "pull"}],
    "priorityClassName": "high",
    "runtimeClassName": "nvidia",
    "terminationGracePeriodSeconds": 7,
}


@pytest.mark.parametrize("where", ["pool", "router"])
def test_each_pod_override_reaches_its_place_and_only_its_own_pod(where):
    """Fails for: an override dropped, put in the wrong pod, or replacing the operator's own
    env, volumes and mounts instead of adding to them."""
    if where == "pool":
        objects, target, other = (
            render(md(pools={"colocated": OVERRIDES})),
            "md-colocated",
            "md-router",
        )
    else:
        objects, target, other = render(md(router=OVERRIDES)), "md-router", "md-colocated"
    template = pod(objects, target)
    spec, container = template["spec"], template["spec"]["containers"][0]
    assert container["env"][-1] == {"name": "EXTRA", "value": "1"}
    assert "HOME" in env(container)  # the operator's are kept, the user's come after
    assert container["envFrom"] == OVERRIDES["envFrom"]
    assert spec["volumes"][-1] == OVERRIDES["volumes"][0]
    assert {"tmp", "fleet-secret", "model"} <= {v["name"] for v in spec["volumes"]}
    assert container["volumeMounts"][-1] == OVERRIDES["volumeMounts"][0]
    assert spec["affinity"] == OVERRIDES["affinity"]
    assert spec["topologySpreadConstraints"] == OVERRIDES["topologySpreadConstraints"]
    assert template["metadata"]["annotations"]["example.com/a"] == "x"
    assert template["metadata"]["labels"]["example.com/l"] == "y"
    assert template["metadata"]["labels"]["pagefleet.io/deployment"] == "md"
    assert spec["imagePullSecrets"] == [{"name": "pull"}]
    assert (spec["priorityClassName"], spec["runtimeClassName"]) == ("high", "nvidia")
    assert spec["terminationGracePeriodSeconds"] == 7
    untouched = pod(objects, other)
    assert "EXTRA" not in env(untouched["spec"]["containers"][0])
    assert "priorityClassName" not in untouched["spec"]
    assert "example.com/l" not in untouched["metadata"]["labels"]


def test_pool_service_account_and_shm_size():
    objects = render(md(pools={"colocated": {"serviceAccountName": "engines", "shmSize": "16Gi"}}))
    spec = pod(objects, "md-colocated")["spec"]
    assert spec["serviceAccountName"] == "engines"
    assert spec["automountServiceAccountToken"] is False  # engines still get no token
    shm = next(v for v in spec["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    default = next(
        v for v in pod(render(md()), "md-colocated")["spec"]["volumes"] if v["name"] == "shm"
    )
    assert default["emptyDir"]["sizeLimit"] == "2Gi"
    refused(md(pools={"colocated": {"shmSize": "lots"}}), "shmSize must be a quantity")
    refused(md(pools={"colocated": {"serviceAccountName": "Bad_Name"}}), "serviceAccountName")


def test_router_resources_default_and_override():
    """Fails for: a BestEffort router (no requests), or spec.router.resources ignored."""
    default = main_container(render(md()), "md-router")["resources"]
    assert default["requests"]["cpu"] and default["requests"]["memory"]
    assert default["limits"]["memory"]
    mine = {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}
    assert main_container(render(md(router={"resources": mine})), "md-router")["resources"] == mine
    refused(md(router={"resources": {"request": {"cpu": "1"}}}), "unknown field")


def _mount(path: str) -> dict:
    return {
        "volumes": [{"name": "x", "emptyDir": {}}],
        "volumeMounts": [{"name": "x", "mountPath": path}],
    }


RESERVED_CASES = [
    *[
        ({"env": [{"name": n, "value": "v"}]}, f"{n} is set by the operator")
        for n in sorted(RESERVED_ENV)
    ],
    *[
        ({"volumes": [{"name": n, "emptyDir": {}}]}, f"the name\\(s\\) {n} are the operator's")
        for n in sorted(RESERVED_VOLUMES)
    ],
    *[(_mount(p), "overlaps a path the operator mounts") for p in RESERVED_MOUNTS],
    *[
        (_mount(p), "overlaps a path the operator mounts")
        for p in ("/", "/var/run", "/models/x/", "/etc")
    ],
    # A path that only looks elsewhere: the kubelet cleans it to /models.
    (_mount("/scratch/../models"), "overlaps a path the operator mounts"),
    (_mount("/scratch/./../tmp/x"), "overlaps a path the operator mounts"),
    (_mount("//models"), "overlaps a path the operator mounts"),
    (_mount("relative/path"), "mountPath must be absolute"),
    ({"volumeMounts": [{"name": "model", "mountPath": "/weights"}]}, "'model' is not one of"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "duplicate name"),
    ({"env": [{"value": "1"}]}, "every item needs a name"),
    ({"podLabels": {"pagefleet.io/pool": "decode"}}, "pagefleet.io/pool is reserved"),
    ({"podLabels": {"app.kubernetes.io/component": "x"}}, "is reserved to the operator"),
    ({"podAnnotations": {"pagefleet.io/config-hash": "0"}}, "is reserved to the operator"),
    ({"podLabels": {"a": 1}}, "must map strings to strings"),
    ({"terminationGracePeriodSeconds": -1}, "terminationGracePeriodSeconds must be"),
    ({"affinity": ["x"]}, "affinity must be an object"),
    ({"env": {"A": "1"}}, "env must be a list of objects"),
    ({"priorityClassName": 5}, "priorityClassName must be a string"),
]


@pytest.mark.parametrize("where", ["pools.colocated", "router"])
@pytest.mark.parametrize(("override", "match"), RESERVED_CASES)
def test_overrides_of_what_the_operator_owns_are_refused(where, override, match):
    """Fails for: a user env/volume/mount/label silently replacing the model, the fleet
    secret, the API key or a selector label."""
    spec = (
        {"pools": {"colocated": override}} if where == "pools.colocated" else {"router": override}
    )
    with pytest.raises(SpecError, match=match) as caught:
        render(md(**spec))
    assert f"spec.{where}" in str(caught.value)


def test_an_unknown_pod_field_is_refused_not_dropped():
    refused(md(pools={"colocated": {"hostNetwork": True}}), "unknown field.*hostNetwork")
    refused(md(router={"nodeSelectr": {}}), "unknown field.*nodeSelectr")


# Placement and RDMA


def test_placement_is_merged_into_the_users_affinity():
    """Fails for: the user's affinity replacing the operator's placement term or vice versa."""
    user_pod = {
        "labelSelector": {"matchLabels": {"app": "cache"}},
        "topologyKey": "kubernetes.io/hostname",
    }
    user = {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {}}]
        },
        "podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 5, "podAffinityTerm": user_pod}
            ]
        },
    }
    prefill = {"resources": GPU, "affinity": user}
    ours = {
        "matchLabels": {"pagefleet.io/deployment": "md", "app.kubernetes.io/component": "engine"}
    }
    preferred = render(pd(prefill=prefill, kvTransfer={"placement": {"topologyKey": "rack"}}))
    affinity = pod(preferred, "md-prefill")["spec"]["affinity"]
    assert affinity["nodeAffinity"] == user["nodeAffinity"]
    terms = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [
        {"weight": 5, "podAffinityTerm": user_pod},
        {"weight": 100, "podAffinityTerm": {"labelSelector": ours, "topologyKey": "rack"}},
    ]
    decode = pod(preferred, "md-decode")["spec"]["affinity"]
    assert decode == {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": terms[1:]}}
    assert "affinity" not in pod(preferred, "md-router")["spec"]
    required = render(
        pd(prefill=prefill, kvTransfer={"placement": {"topologyKey": "rack", "required": True}})
    )
    pod_affinity = pod(required, "md-prefill")["spec"]["affinity"]["podAffinity"]
    assert pod_affinity["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"labelSelector": ours, "topologyKey": "rack"}
    ]
    assert pod_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == terms[:1]
    # The user's input is not mutated by the merge (the spec is parsed once per pass).
    assert user["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {"weight": 5, "podAffinityTerm": user_pod}
    ]


def test_placement_without_prefill_and_decode_is_refused():
    """Fails for: placement accepted on a colocated ModelDeployment and silently ignored."""
    refused(
        md(kvTransfer={"placement": {"topologyKey": "rack"}}), "placement needs mode disaggregated"
    )
    refused(pd(kvTransfer={"placement": {}}), "topologyKey is required")


RDMA = {"enabled": True, "resources": {"rdma/ib": 1}, "networks": "serving/ib", "hostNetwork": True}


def test_rdma_reaches_prefill_and_decode_pods_only():
    """Fails for: IPC_LOCK on the router, RDMA devices in requests but not limits (extended
    resources need both), UCX_TLS or the Multus network missing."""
    objects = render(pd(kvTransfer={"connector": "nixl", "rdma": RDMA}))
    for name in ("md-prefill", "md-decode"):
        template = pod(objects, name)
        container = template["spec"]["containers"][0]
        assert container["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["IPC_LOCK"],
        }
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["resources"]["requests"]["rdma/ib"] == 1
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 1, "rdma/ib": 1}
        assert env(container)["UCX_TLS"] == "rc,sm,self,cuda_copy,cuda_ipc,tcp"
        assert env(container)["UCX_TCP_PORT_RANGE"] == "14580-14609"
        assert template["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "serving/ib"
        assert template["spec"]["hostNetwork"] is True
        assert template["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    router = pod(objects, "md-router")
    assert router["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "hostNetwork" not in router["spec"]
    assert "k8s.v1.cni.cncf.io/networks" not in router["metadata"]["annotations"]
    plain = render(pd())
    container = main_container(plain, "md-prefill")
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "UCX_TLS" not in env(container) and "hostNetwork" not in pod(plain, "md-prefill")["spec"]
    custom = render(pd(kvTransfer={"rdma": {"enabled": True, "ucxTls": "rc,self"}}))
    assert env(main_container(custom, "md-decode"))["UCX_TLS"] == "rc,self"
    off = render(pd(kvTransfer={"rdma": {**RDMA, "enabled": False}}))
    assert "rdma/ib" not in json.dumps(off)


@pytest.mark.parametrize(
    ("model_deployment", "match"),
    [
        (md(kvTransfer={"rdma": {"enabled": True}}), "rdma needs mode disaggregated"),
        (pd(kvTransfer={"connector": "tcp", "rdma": {"enabled": True}}), "and the nixl connector"),
        (pd(kvTransfer={"rdma": {"enabled": "yes"}}), "rdma.enabled must be true or false"),
        (pd(kvTransfer={"rdma": {"enabled": True, "ucxTls": "rc; rm -rf"}}), "ucxTls"),
    ],
)
def test_rdma_where_it_cannot_work_is_refused(model_deployment, match):
    refused(model_deployment, match)


# KEDA and PodDisruptionBudgets


def keda_pool(**keda: Any) -> dict:
    return {"autoscaling": {"mode": "keda", "maxReplicas": 6, "keda": keda}}


def test_keda_options_reach_the_scaled_object():
    keda = {
        "pollingInterval": 5,
        "cooldownPeriod": 90,
        "activationThreshold": 0.5,
        "fallback": {"failureThreshold": 3, "replicas": 2},
        "authenticationRef": {"name": "prom-auth"},
        "authModes": "bearer",
    }
    objects = render(md(pools={"colocated": keda_pool(**keda)}), prometheus_url=PROMETHEUS)
    scaled = obj(objects, "ScaledObject", "md-colocated")["spec"]
    assert scaled["pollingInterval"] == 5 and scaled["cooldownPeriod"] == 90
    assert scaled["fallback"] == {"failureThreshold": 3, "replicas": 2}
    trigger = scaled["triggers"][0]  # the engines' waiting trigger (then the router's queue)
    assert trigger["metadata"]["activationThreshold"] == "0.5"
    assert trigger["metadata"]["authModes"] == "bearer"
    assert trigger["authenticationRef"] == {"name": "prom-auth", "kind": "TriggerAuthentication"}
    assert trigger["metricType"] == "AverageValue"  # what KEDA's fallback requires
    plain = render(md(pools={"colocated": keda_pool()}), prometheus_url=PROMETHEUS)
    spec = obj(plain, "ScaledObject", "md-colocated")["spec"]
    assert "pollingInterval" not in spec and "fallback" not in spec
    assert spec["cooldownPeriod"] == 300  # scaleDownStabilizationSeconds' default
    assert "authenticationRef" not in spec["triggers"][0]
    cluster = keda_pool(authenticationRef={"name": "a", "kind": "ClusterTriggerAuthentication"})
    objects = render(md(pools={"colocated": cluster}), prometheus_url=PROMETHEUS)
    ref = obj(objects, "ScaledObject", "md-colocated")["spec"]["triggers"][0]["authenticationRef"]
    assert ref == {"name": "a", "kind": "ClusterTriggerAuthentication"}


@pytest.mark.parametrize(
    ("autoscaling", "match"),
    [
        ({"mode": "builtin", "keda": {"pollingInterval": 5}}, "keda needs mode keda"),
        ({"keda": {"fallback": {"replicas": 2}}}, "keda needs mode keda|failureThreshold"),
        (
            {"mode": "keda", "keda": {"fallback": {"failureThreshold": 0, "replicas": 1}}},
            "failureThreshold",
        ),
        ({"mode": "keda", "keda": {"authModes": "oauth"}}, "authModes must be one of"),
        ({"mode": "keda", "keda": {"authenticationRef": {"name": "a", "kind": "Secret"}}}, "kind"),
        ({"mode": "keda", "keda": {"pollingInterval": 0}}, "pollingInterval"),
        ({"mode": "keda", "keda": {"pollInterval": 5}}, "unknown field"),
    ],
)
def test_bad_keda_options_are_refused(autoscaling, match):
    refused(md(pools={"colocated": {"autoscaling": autoscaling}}), match)


@pytest.mark.parametrize(("budget", "expected"), [(None, 1), (3, 3), ("50%", "50%"), (0, 0)])
def test_each_pool_has_a_disruption_budget(budget, expected):
    decode = {"resources": GPU}
    if budget is not None:
        decode["disruptionBudget"] = {"maxUnavailable": budget}
    objects = render(pd(decode=decode))
    budgets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"md-prefill", "md-decode"}
    assert budgets["md-prefill"]["spec"]["maxUnavailable"] == 1
    assert budgets["md-decode"]["spec"]["maxUnavailable"] == expected
    selector = budgets["md-decode"]["spec"]["selector"]["matchLabels"]
    labels = pod(objects, "md-decode")["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert not selector.items() <= pod(objects, "md-prefill")["metadata"]["labels"].items()


@pytest.mark.parametrize("budget", [-1, "half", "50", {"minAvailable": 1}])
def test_a_bad_disruption_budget_is_refused(budget):
    raw = budget if isinstance(budget, dict) else {"maxUnavailable": budget}
    refused(md(pools={"colocated": {"disruptionBudget": raw}}), "disruptionBudget")


# Names


@pytest.mark.parametrize("name", ["llama.v3", "Llama", "9lives", "x" * 54, "trailing-", ""])
def test_names_the_derived_objects_cannot_take_are_refused(name):
    with pytest.raises(SpecError, match=r"metadata\.name must be a DNS-1035 label of at most 53"):
        render(md(name=name))


def test_the_longest_name_fits_every_derived_object():
    """Services are DNS-1035 labels (63), label values too; other names DNS subdomains."""
    name = "a" * 53
    for o in render(md(name=name)) + render(pd(name=name)):
        limit = 63 if o["kind"] == "Service" else 253
        assert len(o["metadata"]["name"]) <= limit, o["metadata"]["name"]
        assert all(len(v) <= 63 for v in o["metadata"]["labels"].values())


# Every rendered object valid


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("example", ["gpu-disaggregated-rdma.yaml", "hf-colocated.yaml"])
def test_kitchen_sink_objects_validate_strictly(example, version):
    """Every object rendered from the examples that use each new field passes the API
    schema of both Kubernetes versions (strict: unknown fields fail)."""
    raw = yaml.safe_load((EXAMPLES / example).read_text())
    raw["metadata"]["uid"] = "uid-1"
    objects = render(raw, prometheus_url=PROMETHEUS)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "PodDisruptionBudget", "NetworkPolicy", "Service"} <= kinds
    validated = 0
    for o in objects:
        if o["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's CRD schemas are not bundled with kubernetes-validate
        kubernetes_validate.validate(copy.deepcopy(o), version, strict=True)
        validated += 1
    assert validated >= 10


def test_the_kitchen_sink_uses_every_new_field():
    """The example above stays a kitchen sink: each new field appears in it."""
    raw = yaml.safe_load((EXAMPLES / "gpu-disaggregated-rdma.yaml").read_text())
    spec = raw["spec"]
    prefill, decode = spec["pools"]["prefill"], spec["pools"]["decode"]
    assert {"uri", "hf", "cache"} <= set(spec["model"])
    assert {"tokenSecret", "endpoint"} <= set(spec["model"]["hf"])
    pool_fields = {"image", "serviceAccountName", "shmSize", "strategy", "disruptionBudget"}
    assert pool_fields | set(OVERRIDES) <= set(prefill)
    assert set(decode["autoscaling"]["keda"]) == {
        "pollingInterval",
        "cooldownPeriod",
        "activationThreshold",
        "fallback",
        "authenticationRef",
        "authModes",
    }
    assert {"resources", "env", "podAnnotations", "podLabels"} <= set(spec["router"])
    assert set(spec["kvTransfer"]["rdma"]) == {"enabled", "resources", "ucxTls", "networks"}
    assert set(spec["kvTransfer"]["placement"]) == {"topologyKey", "required"}
