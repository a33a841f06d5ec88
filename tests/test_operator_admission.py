"""Capacity admission: a ModelDeployment whose GPU pool's KV cache cannot hold one request of
its max-model-len (or that sets none) is refused before any object is applied, with the
numbers and the knobs that fix it; admitAnyway deploys it. The GPU type comes from
spec.capacity or the pool's nvidia.com/gpu.product nodeSelector, the model's shape from
spec.capacity.modelConfig or an hf:// model's config.json (fetched from tests/hf_stand_in.py,
never the internet); a check that cannot run says so and deploys."""

from __future__ import annotations

import json
import socket

import pytest
from operator_harness import (
    MD_API,
    NS,
    condition,
    emulator,
    get,
    md_status,
    model_deployment,
    next_pass,
    operator,
    wait_degraded,
    wait_for,
)
from test_capacity import HYBRID_27B
from test_capacity import QWEN25_7B as QWEN_7B
from test_helm_chart import helm, one, template, validate_model_deployment  # noqa: F401

from hf_stand_in import HfStandIn
from pagefleet.operator.admission import MAX_CONFIG_BYTES, ModelConfigs, check_capacity
from pagefleet.operator.handlers import KubeClient
from pagefleet.operator.spec import SpecError, parse_spec

CAPACITY = {"modelConfig": HYBRID_27B, "gpu": "H100-80GB", "numParameters": 27e9, "overheadGB": 5}
ONE_GPU = {"resources": {"limits": {"nvidia.com/gpu": 1}}}


def _refuse_fetch(url: str, token: str | None) -> dict:
    raise AssertionError(f"fetched {url} with no need")


def _spec(engine_args: dict, capacity: dict | None = None, pool: dict | None = None, **spec):
    raw = model_deployment(
        engineArgs=engine_args,
        pools={"colocated": pool or ONE_GPU},
        capacity=CAPACITY if capacity is None else capacity,
        **spec,
    )
    return parse_spec(raw["spec"])


def _verdict(spec, configs: ModelConfigs | None = None, token: str | None = None):
    return check_capacity(spec, configs or ModelConfigs(fetch=_refuse_fetch), lambda: token)


def test_a_pool_too_small_for_max_model_len_is_refused_with_numbers_and_knobs():
    verdict = _verdict(_spec({"max-model-len": 262144}))
    assert (verdict.status, verdict.reason, verdict.refused) == ("False", "PoolTooSmall", True)
    message = verdict.message
    assert "pool colocated" in message
    assert "222,768 tokens" in message and "14.6 GB" in message  # the published figures
    for knob in (
        "max-model-len <= 222,768",
        "kv-cache-dtype fp8 (445,552 tokens)",
        "tensor-parallel-size",
        "admitAnyway",
    ):
        assert knob in message


def test_each_fix_the_message_names_is_admitted():
    two_gpus = {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 2}}}
    for args, pool in (
        ({"max-model-len": 32768}, None),
        ({"max-model-len": 262144, "kv-cache-dtype": "fp8"}, None),  # a 1-byte KV cache
        ({"max-model-len": 262144}, two_gpus),  # KV heads and weights split over 2 GPUs
    ):
        verdict = _verdict(_spec(args, pool=pool))
        assert (verdict.status, verdict.reason) == ("True", "CapacityOK"), verdict.message
    ok = _verdict(_spec({"max-model-len": 32768}))
    assert "6 requests of max-model-len 32,768" in ok.message


def test_no_max_model_len_is_refused_unless_the_expert_overrides():
    verdict = _verdict(_spec({}))
    assert (verdict.reason, verdict.refused) == ("NoMaxModelLen", True)
    assert "262144 tokens" in verdict.message  # the model's native context
    # Refused even when the GPU and model are not known: no numbers then, still the fix.
    unknown = _verdict(_spec({}, capacity={}))
    assert unknown.reason == "NoMaxModelLen" and "engineArgs.max-model-len" in unknown.message
    anyway = _verdict(_spec({}, capacity={**CAPACITY, "admitAnyway": True}))
    assert (anyway.status, anyway.refused) == ("False", False)
    assert "deployed anyway" in anyway.message


def test_the_gpu_type_comes_from_the_pools_gpu_product_label():
    """GPU feature discovery's product names map to the table; an unknown one is a check that
    cannot run (deployed, with the fix), not a refusal."""
    shape_only = {k: v for k, v in CAPACITY.items() if k != "gpu"}
    labelled = {**ONE_GPU, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    by_label = _verdict(_spec({"max-model-len": 262144}, shape_only, labelled))
    assert by_label.reason == "PoolTooSmall" and "222,768 tokens" in by_label.message
    l4 = {**ONE_GPU, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}}
    assert _verdict(_spec({"max-model-len": 8192}, shape_only, l4)).reason == "PoolTooSmall"
    odd = {**ONE_GPU, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-Quadro-RTX-8000"}}
    unknown = _verdict(_spec({"max-model-len": 8192}, shape_only, odd))
    assert (unknown.status, unknown.refused) == ("Unknown", False)
    assert "gpuMemoryGB" in unknown.message
    # An L4 cannot even hold the bf16 weights: the fix is smaller weights, not a shorter context.
    l4_verdict = _verdict(_spec({"max-model-len": 8192}, shape_only, l4))
    assert "holds 0 tokens" in l4_verdict.message and "fp8, int4" in l4_verdict.message
    assert "max-model-len <=" not in l4_verdict.message
    nothing = _verdict(_spec({"max-model-len": 8192}, shape_only))
    assert nothing.status == "Unknown" and "nvidia.com/gpu.product" in nothing.message


def test_cpu_pools_are_not_checked_against_gpu_memory():
    cpu = {"resources": {"requests": {"cpu": "4"}}}
    assert _verdict(_spec({}, pool=cpu)) is None


def test_capacity_spec_errors_name_the_field():
    for bad, field in (
        ({"gpu": "TPU"}, "spec.capacity.gpu"),
        ({"modelConfig": {}}, "spec.capacity.modelConfig"),
        ({"overheadGB": -1}, "spec.capacity.overheadGB"),
        ({"weightsFormat": "int3"}, "spec.capacity.weightsFormat"),
        ({"typo": 1}, "unknown field"),
    ):
        with pytest.raises(SpecError, match=field):
            _spec({"max-model-len": 8192}, {**CAPACITY, **bad})
    for length in (0, "many"):
        with pytest.raises(SpecError, match="max-model-len"):
            _verdict(_spec({"max-model-len": length}))
    missing_shape = _verdict(_spec({"max-model-len": 8192}, {**CAPACITY, "modelConfig": None}))
    assert missing_shape.status == "Unknown" and "modelConfig" in missing_shape.message


def test_the_crd_schema_takes_spec_capacity():
    md = model_deployment(
        engineArgs={"max-model-len": 8192},
        pools={"colocated": ONE_GPU},
        capacity={**CAPACITY, "admitAnyway": True, "gpuMemoryGB": 96, "weightsFormat": "fp8"},
    )
    validate_model_deployment(md)


def test_the_chart_passes_modeldeployment_capacity_to_the_spec(helm, tmp_path):  # noqa: F811
    """The chart's default ModelDeployment (a GPU pool with max-model-len) with
    modelDeployment.capacity set: the operator checks it as given, and it fits."""
    values = tmp_path / "values.yaml"
    capacity = {"gpu": "L4", "modelConfig": QWEN_7B, "overheadGB": 1}
    values.write_text(json.dumps({"modelDeployment": {"capacity": capacity}}))
    md = one(template(helm, "-f", str(values)), "ModelDeployment")
    assert md["spec"]["capacity"] == capacity
    validate_model_deployment(md)
    verdict = _verdict(parse_spec(md["spec"]))
    assert (verdict.status, verdict.reason) == ("True", "CapacityOK"), verdict.message
    assert "max-model-len 8,192" in verdict.message


# --- an hf:// model's config.json, from the stand-in Hub ------------------------------------

SHAPE_ONLY = {"gpu": "H100-80GB", "numParameters": 27e9, "overheadGB": 5}


def _hf_spec(hub: HfStandIn, repo: str, engine_args: dict | None = None, **hf):
    model = {"name": "m", "uri": f"hf://{repo}", "hf": {"endpoint": hub.endpoint, **hf}}
    return _spec(engine_args or {"max-model-len": 262144}, SHAPE_ONLY, model=model)


def test_an_hf_models_shape_is_read_from_its_config_json_once():
    with HfStandIn() as hub:
        hub.add_repo("org/hybrid", {"config.json": json.dumps(HYBRID_27B).encode()})
        configs = ModelConfigs()
        spec = _hf_spec(hub, "org/hybrid")
        for _ in range(3):
            verdict = _verdict(spec, configs)
            assert verdict.reason == "PoolTooSmall" and "222,768 tokens" in verdict.message
        assert hub.gets("org/hybrid", "config.json") == 1


def test_a_gated_models_config_is_fetched_with_the_token():
    with HfStandIn() as hub:
        config = {"config.json": json.dumps(HYBRID_27B).encode()}
        hub.add_repo("org/gated", config, gated_tokens={"hf_granted"})
        secret = {"tokenSecret": {"name": "hf-token", "key": "token"}}
        spec = _hf_spec(hub, "org/gated", **secret)
        denied = _verdict(spec, ModelConfigs())
        assert (denied.status, denied.refused) == ("Unknown", False)
        assert "HTTP 401" in denied.message and "tokenSecret" in denied.message
        granted = _verdict(spec, ModelConfigs(), token="hf_granted")
        assert granted.reason == "PoolTooSmall"


def test_a_config_that_cannot_be_read_is_a_check_that_could_not_run():
    """Catches the operator crashing (or hanging) on an endpoint that is down, a body that is
    not JSON or one far larger than a config: the condition says why, the pool deploys."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with HfStandIn() as hub:
        hub.add_repo("org/text", {"config.json": b"<html>not json</html>"})
        hub.add_repo("org/huge", {"config.json": b"{" + b" " * (MAX_CONFIG_BYTES + 1) + b"}"})
        for spec, why in (
            (_hf_spec(hub, "org/text"), "is not JSON"),
            (_hf_spec(hub, "org/huge"), "larger than"),
            (_hf_spec(hub, "org/absent"), "HTTP 401"),
        ):
            verdict = _verdict(spec, ModelConfigs())
            assert (verdict.status, verdict.reason) == ("Unknown", "CapacityUnknown")
            assert why in verdict.message and not verdict.refused
    model = {"name": "m", "uri": "hf://org/x", "hf": {"endpoint": f"http://127.0.0.1:{port}"}}
    down = _spec({"max-model-len": 8192}, SHAPE_ONLY, model=model)
    configs = ModelConfigs()
    verdict = _verdict(down, configs)
    assert verdict.status == "Unknown" and "could not be fetched" in verdict.message
    assert len(configs.failed) == 1  # remembered: the next pass does not wait on it again
    # Without max-model-len the pool is refused all the same.
    assert _verdict(_spec({}, SHAPE_ONLY, model=model), configs).reason == "NoMaxModelLen"


# --- the operator ----------------------------------------------------------------------------


def _events(client: KubeClient) -> list[dict]:
    found = client.request("GET", KubeClient.path("v1", "Event", NS)) or {}
    return found.get("items", [])


def test_operator_refuses_before_any_object_and_deploys_once_fixed():
    """Catches a ModelDeployment whose pool cannot hold one request failing only at pod start:
    the operator applies nothing, says why in Degraded, CapacityAdmitted and a Warning event,
    and deploys once max-model-len fits."""
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            md = model_deployment(
                engineArgs={"max-model-len": 262144},
                pools={"colocated": ONE_GPU},
                capacity=CAPACITY,
            )
            client.create(md)
            degraded = wait_degraded(client, "PoolTooSmall")
            assert "max-model-len <= 222,768" in degraded["message"]
            admitted = condition(md_status(client), "CapacityAdmitted")
            assert (admitted["status"], admitted["reason"]) == ("False", "PoolTooSmall")
            event = wait_for(lambda: [e for e in _events(client) if e["reason"] == "PoolTooSmall"])
            assert "kv-cache-dtype fp8" in event[0]["message"]
            assert get(client, "apps/v1", "Deployment", "llama-colocated") is None
            assert get(client, "v1", "Service", "llama-router") is None
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(md, {"spec": {"engineArgs": {"max-model-len": 32768}}})
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            wait_for(
                lambda: condition(md_status(client), "Degraded").get("status") == "False",
                what="Degraded cleared",
            )
            admitted = condition(md_status(client), "CapacityAdmitted")
            assert (admitted["status"], admitted["reason"]) == ("True", "CapacityOK")


def test_operator_deploys_when_the_check_cannot_run_and_says_so():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            model = {"name": "m", "uri": "hf://org/m", "hf": {"endpoint": endpoint}}
            client.create(
                model_deployment(
                    model=model,
                    engineArgs={"max-model-len": 8192},
                    pools={"colocated": ONE_GPU},
                    capacity=SHAPE_ONLY,
                )
            )
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            admitted = wait_for(lambda: condition(md_status(client), "CapacityAdmitted"))
            assert (admitted["status"], admitted["reason"]) == ("Unknown", "CapacityUnknown")
            assert "could not be fetched" in admitted["message"]
            assert condition(md_status(client), "Degraded")["status"] == "False"


def test_operator_deploys_anyway_on_the_override_and_warns_once():
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(
                model_deployment(
                    engineArgs={"max-model-len": 262144},
                    pools={"colocated": ONE_GPU},
                    capacity={**CAPACITY, "admitAnyway": True},
                )
            )
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            admitted = wait_for(lambda: condition(md_status(client), "CapacityAdmitted"))
            assert (admitted["status"], admitted["reason"]) == ("False", "PoolTooSmall")
            assert "deployed anyway" in admitted["message"]
            wait_for(lambda: [e for e in _events(client) if e["reason"] == "PoolTooSmall"])
            next_pass(state)
            assert len([e for e in _events(client) if e["reason"] == "PoolTooSmall"]) == 1
            assert condition(md_status(client), "Degraded")["status"] == "False"
