"""What the operator renders for a pool that can sit at zero: KEDA's ScaledObject (validated
against KEDA's published CRD schema, tests/keda_schema.py) with its activation triggers, the
router's queue flags from spec.router.queue, the router's readiness at zero engines, and the
CRD's documented settings."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from keda_schema import validate_scaled_object

from pagefleet.operator.crd import crd
from pagefleet.operator.reconcile import RenderOptions, desired_objects
from pagefleet.operator.spec import SpecError, parse_spec

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
GOLDEN = Path(__file__).resolve().parent / "golden" / "operator"
MODEL = {"name": "qwen2-7b", "pvc": {"claimName": "models", "path": "qwen"}}


def model_deployment(pool: dict, router: dict | None = None) -> dict:
    spec: dict[str, Any] = {"model": MODEL, "pools": {"colocated": pool}}
    if router is not None:
        spec["router"] = router
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "qwen", "namespace": "serving", "uid": "uid-qwen"},
        "spec": spec,
    }


def render(pool: dict, router: dict | None = None) -> list[dict]:
    options = RenderOptions(prometheus_url=PROMETHEUS)
    return desired_objects(model_deployment(pool, router), options)


def scaled_object(objects: list[dict]) -> dict:
    (found,) = [o for o in objects if o["kind"] == "ScaledObject"]
    return found


def router_container(objects: list[dict]) -> dict:
    (router,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "qwen-router"
    ]
    return router["spec"]["template"]["spec"]["containers"][0]


def keda_pool(**autoscaling: Any) -> dict:
    return {"autoscaling": {"mode": "keda", "maxReplicas": 6, **autoscaling}}


def test_a_keda_pool_at_zero_activates_on_the_routers_queue():
    """minReplicas 0: minReplicaCount 0, the router-queue trigger active from the first held
    request, the idle window as KEDA's cooldownPeriod; the whole object valid for KEDA's
    CRD. Fails for: no trigger KEDA can see at zero pods (the engines' series do not exist
    then), a missing activation threshold, or a field KEDA's schema refuses."""
    scaled = scaled_object(render(keda_pool(minReplicas=0, scaleToZeroIdleSeconds=900)))
    validate_scaled_object(scaled, KUBERNETES_VERSIONS)
    spec = scaled["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 6)
    assert spec["cooldownPeriod"] == 900
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert list(triggers) == ["engines-waiting", "router-queued", "engines-running"]
    queued = triggers["router-queued"]["metadata"]
    assert queued["query"] == (
        'sum(pagefleet_router:queued_requests{namespace="serving",pod=~"qwen-router-.*",'
        'model="qwen2-7b"})'
    )
    assert (queued["threshold"], queued["activationThreshold"]) == ("4", "0")
    assert triggers["engines-running"]["metadata"]["activationThreshold"] == "0"
    # The user's activation threshold applies to both demand triggers.
    pool = keda_pool(minReplicas=0, keda={"activationThreshold": 3, "cooldownPeriod": 60})
    spec = scaled_object(render(pool))["spec"]
    thresholds = {t["name"]: t["metadata"].get("activationThreshold") for t in spec["triggers"]}
    assert thresholds == {"engines-waiting": "3", "router-queued": "3", "engines-running": "0"}
    assert spec["cooldownPeriod"] == 60  # keda.cooldownPeriod wins


def test_the_keda_golden_validates_against_kedas_schema():
    """The reviewed golden, as stored, is a ScaledObject KEDA's CRD accepts."""
    objects = list(yaml.safe_load_all((GOLDEN / "keda.yaml").read_text()))
    validate_scaled_object(scaled_object(objects), KUBERNETES_VERSIONS)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("triggers", 1, "metadata", "activationThreshold"), 0),  # a number: KEDA wants strings
        (("triggers", 1, "activationThreshold"), "0"),  # beside metadata, not in it
        (("minReplicaCount",), -1),
        (("triggers", 0, "metadata", "threshold"), "eight"),
        (("scaleTargetRef", "name"), ""),
    ],
)
def test_the_keda_schema_refuses_what_keda_would(path, value):
    """The validator is not a rubber stamp: each mistake a renderer could make fails it."""
    scaled = copy.deepcopy(scaled_object(render(keda_pool(minReplicas=0))))
    target = scaled["spec"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_scaled_object(scaled, KUBERNETES_VERSIONS)


def test_the_keda_schema_applies_the_crds_rule():
    """KEDA's CEL rule: minReplicaCount <= maxReplicaCount."""
    scaled = copy.deepcopy(scaled_object(render(keda_pool(minReplicas=0))))
    scaled["spec"]["minReplicaCount"] = 7
    with pytest.raises(AssertionError, match="minReplicaCount"):
        validate_scaled_object(scaled, KUBERNETES_VERSIONS)


def test_the_router_queue_spec_becomes_the_routers_flags():
    """spec.router.queue reaches the router's command by the router's flag names; values at
    the router's defaults are left to it. Fails for: a bound dropped or misnamed."""
    router = {"queue": {"size": 0, "timeoutSeconds": 600, "saturationWaiting": 8}}
    router["queue"]["saturationKv"] = 0.85
    command = router_container(render({}, router))["command"]
    at = command.index("--queue-size")
    assert command[at:] == [
        "--queue-size",
        "0",
        "--queue-timeout",
        "600",
        "--saturation-waiting",
        "8",
        "--saturation-kv",
        "0.85",
    ]
    plain = router_container(render({}))["command"]
    assert not [f for f in plain if f.startswith(("--queue-", "--saturation-"))]


@pytest.mark.parametrize(
    ("queue", "match"),
    [
        ({"saturationKv": 0}, "saturationKv must be above 0"),
        ({"saturationKv": 1.5}, r"saturationKv must be a number from 0 to 1"),
        ({"size": -1}, r"queue.size must be an integer >= 0"),
        ({"timeoutSeconds": 0}, r"queue.timeoutSeconds must be an integer >= 1"),
        ({"saturationWaiting": 0}, r"queue.saturationWaiting must be an integer >= 1"),
        ({"sizee": 3}, r"spec.router.queue: unknown field\(s\) sizee"),
    ],
)
def test_bad_queue_bounds_are_refused_by_field(queue, match):
    with pytest.raises(SpecError, match=match):
        parse_spec({"model": MODEL, "router": {"queue": queue}})


@pytest.mark.parametrize(
    ("autoscaling", "readiness"),
    [
        ({"mode": "builtin", "minReplicas": 0}, "/livez"),
        ({"mode": "keda", "minReplicas": 0}, "/livez"),
        ({"mode": "builtin", "minReplicas": 1}, "/health"),
        ({"mode": "none", "minReplicas": 0}, "/health"),  # spec.replicas decides: no wake-up
    ],
)
def test_the_router_stays_ready_without_engines_where_a_pool_can_sit_at_zero(
    autoscaling, readiness
):
    """At zero engines /health fails, so a router probed on it leaves its Service: no request
    would reach it, nothing would queue, and the pool would never wake. Fails for: the
    probe left on /health where a pool scales to zero."""
    container = router_container(render({"autoscaling": autoscaling}))
    assert container["readinessProbe"]["httpGet"]["path"] == readiness
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"


@pytest.mark.parametrize("min_replicas, period", [(0, 2), (1, 10)])
def test_a_pool_woken_from_zero_is_probed_often_while_it_starts(min_replicas, period):
    """A request waits on a pool woken from zero: its engine's startup probe runs every 2 s
    (not 10, which added up to 10 s to a cold start in benchmarks/scale_from_zero.py), still
    allowing 30 minutes to load."""
    objects = render({"autoscaling": {"mode": "builtin", "minReplicas": min_replicas}})
    (engines,) = [
        o for o in objects if o["kind"] == "Deployment" and "router" not in o["metadata"]["name"]
    ]
    (container,) = engines["spec"]["template"]["spec"]["containers"]
    probe = container["startupProbe"]
    assert probe["periodSeconds"] == period
    assert probe["periodSeconds"] * probe["failureThreshold"] == 1800


def test_the_crd_documents_scale_to_zero_and_the_queue():
    """What `kubectl explain` shows: minReplicas 0's cold-start cost, the idle window's
    default and meaning, the queue's defaults. Fails for: a default or a description lost."""
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    pool = schema["properties"]["pools"]["properties"]["colocated"]
    autoscaling = pool["properties"]["autoscaling"]["properties"]
    assert "cold start" in autoscaling["minReplicas"]["description"]
    assert "model load" in autoscaling["minReplicas"]["description"]
    idle = autoscaling["scaleToZeroIdleSeconds"]
    assert (idle["default"], idle["minimum"]) == (300, 0)
    assert "Never while a request is in flight" in idle["description"]
    queue = schema["properties"]["router"]["properties"]["queue"]["properties"]
    assert (queue["size"]["default"], queue["timeoutSeconds"]["default"]) == (256, 120)
    assert "default" not in queue["saturationWaiting"] and "default" not in queue["saturationKv"]
    assert parse_spec({"model": MODEL}).pools[0].autoscaling.scale_to_zero_idle_s == 300
