"""spec.adapters (issue 35): LoRA adapters from hf:// or pvc:// sources reach every engine of
the pool as --enable-lora --lora-modules (downloaded like a model, the token only in the
download container), the router weighs LoRA affinity, the chart passes them through, and an
adapter whose rank is above a pool's max-lora-rank is refused at admission with the reason
(from an hf:// adapter's adapter_config.json, served by tests/hf_stand_in.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from operator_harness import (
    MD_API,
    condition,
    emulator,
    get,
    md_status,
    model_deployment,
    operator,
    wait_degraded,
    wait_for,
)
from test_helm_chart import helm, one, template, validate_model_deployment  # noqa: F401
from test_operator_pods import env, md, obj, pod, render, serve_args

from hf_stand_in import HfStandIn
from pagefleet.engine.lora.config import parse_lora_modules
from pagefleet.operator.admission import AdapterRefused, ModelConfigs, check_adapters
from pagefleet.operator.handlers import KubeClient
from pagefleet.operator.spec import SpecError, parse_spec

TOKEN = {"name": "hf", "key": "t"}
HF_ADAPTER = {
    "name": "sql",
    "uri": "hf://org/sql-lora@v1",
    "hf": {"tokenSecret": TOKEN, "endpoint": "https://mirror.example.com:8443"},
}
PVC_ADAPTER = {"name": "chat", "uri": "pvc://adapters/tenants/chat", "rank": 8}


def test_adapters_reach_every_engine_as_lora_modules_and_the_token_only_its_download():
    """Fails for: an engine pool without the adapters (a P/D pair would refuse the adapter's
    requests on one side), a path the engine does not find, a writable adapter mount, the HF
    token in a serving container, the router not weighing LoRA affinity or its pods not
    allowed to reach the adapter's endpoint."""
    objects = render(
        md(
            mode="disaggregated",
            pools={"prefill": {}, "decode": {}},
            adapters=[HF_ADAPTER, PVC_ADAPTER],
            engineArgs={"max-lora-rank": 32},
        )
    )
    for name in ("md-prefill", "md-decode"):
        spec = pod(objects, name)["spec"]
        engine = spec["containers"][0]
        args = serve_args(engine)
        assert args["enable_lora"] is True and args["max_lora_rank"] == 32
        modules = parse_lora_modules(args["lora_modules"])  # as the engine reads them
        assert [(m.name, m.path) for m in modules] == [
            ("sql", "/adapters/hf/org/sql-lora/v1"),
            ("chat", "/adapter-claims/1/tenants/chat"),
        ]
        (download,) = [c for c in spec["initContainers"] if c["name"] == "download-adapter-0"]
        assert download["command"] == [
            "pagefleet",
            "download",
            "hf://org/sql-lora@v1",
            "--cache-dir",
            "/adapters",
        ]
        assert env(download)["HF_TOKEN"] == {"secretKeyRef": TOKEN}
        assert env(download)["HF_ENDPOINT"] == "https://mirror.example.com:8443"
        assert "HF_TOKEN" not in env(engine)
        mounts = {m["mountPath"]: m.get("readOnly") for m in engine["volumeMounts"]}
        assert mounts["/adapters"] is True and mounts["/adapter-claims/1"] is True
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["adapters"] == {"name": "adapters", "emptyDir": {}}
        claim = volumes["adapter-1"]["persistentVolumeClaim"]
        assert claim == {"claimName": "adapters", "readOnly": True}
        policy = obj(objects, "NetworkPolicy", name)
        ports = {p["port"] for r in policy["spec"]["egress"] if "to" not in r for p in r["ports"]}
        assert 8443 in ports
    router = pod(objects, "md-router")["spec"]
    assert "HF_TOKEN" not in json.dumps(router)
    config = obj(objects, "ConfigMap", "md-router")["data"]["router.yaml"]
    assert yaml.safe_load(config)["scorers"]["lora-affinity"] == 2
    # Without adapters nothing of it: no flag, no volume, no weight.
    plain = render(md())
    assert serve_args(pod(plain, "md-colocated")["spec"]["containers"][0])["enable_lora"] is False
    plain_config = obj(plain, "ConfigMap", "md-router")["data"]["router.yaml"]
    assert "lora-affinity" not in yaml.safe_load(plain_config)["scorers"]


@pytest.mark.parametrize(
    ("adapters", "match"),
    [
        ([{**PVC_ADAPTER, "name": "m"}], "is taken"),  # the model's own name
        ([PVC_ADAPTER, {**PVC_ADAPTER, "rank": 4}], "is taken"),
        ([{**PVC_ADAPTER, "name": "a,b"}], "1-128 characters"),  # would split a metric list
        ([{**PVC_ADAPTER, "uri": "https://x/y"}], "must start with hf:// or pvc://"),
        ([{**PVC_ADAPTER, "uri": "pvc://Bad_Claim"}], "is not a claim name"),
        ([{"name": "x"}], "uri is required"),
        ([{**PVC_ADAPTER, "rank": 0}], "rank"),
        ([{**PVC_ADAPTER, "path": "/etc"}], "path"),  # unknown field, not dropped
        ([{**PVC_ADAPTER, "name": f"a{i}"} for i in range(33)], "at most 32"),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(adapters, match):
    with pytest.raises(SpecError, match=match):
        parse_spec({"model": {"name": "m", "pvc": {"claimName": "c"}}, "adapters": adapters})


def test_lora_modules_in_engine_args_are_refused_for_spec_adapters():
    """Fails if a user's --lora-modules could silently replace spec.adapters' (the user's
    flags come last and win)."""
    model = {"name": "m", "pvc": {"claimName": "c"}}
    for where in (
        {"engineArgs": {"lora-modules": "x=/y"}},
        {"pools": {"colocated": {"engineArgs": {"lora-modules": "x=/y"}}}},
    ):
        with pytest.raises(SpecError, match=r"list the adapters in spec\.adapters"):
            parse_spec({"model": model, **where})


def test_an_adapter_volume_name_is_the_operators():
    override = {"volumes": [{"name": "adapter-3", "emptyDir": {}}]}
    with pytest.raises(SpecError, match="adapter-3 are the operator's"):
        render(md(pools={"colocated": override}))


def test_an_adapter_above_a_pools_max_lora_rank_is_refused_with_the_reason():
    """Fails for: the rank read from the wrong place (the hf:// adapter's adapter_config.json,
    with the token of a gated one; a pvc:// adapter's spec rank), the limit not the pool's
    engineArgs over the spec's (16 by default), or an adapter whose rank cannot be known
    blocking the deployment (its engines check it)."""
    with HfStandIn() as hub:
        config = json.dumps({"r": 64, "lora_alpha": 16}).encode()
        hub.add_repo("org/big", {"adapter_config.json": config}, gated_tokens={"hf_ok"})
        big = {
            "name": "big",
            "uri": "hf://org/big",
            "hf": {"endpoint": hub.endpoint, "tokenSecret": TOKEN},
        }

        def check(engine_args: dict, adapters=(big,), **spec) -> None:
            raw = model_deployment(engineArgs=engine_args, adapters=list(adapters), **spec)
            token_of = lambda _: lambda: "hf_ok"  # noqa: E731 - the Secret's value
            check_adapters(parse_spec(raw["spec"]), ModelConfigs(), token_of)

        with pytest.raises(AdapterRefused) as refused:
            check({})
        assert refused.value.reason == "AdapterRankTooHigh"
        assert "big: rank 64 is above pool colocated's max-lora-rank 16" in str(refused.value)
        check({"max-lora-rank": 64})
        pools = {"prefill": {"engineArgs": {"max-lora-rank": 32}}, "decode": {}}
        with pytest.raises(AdapterRefused) as refused:
            check({"max-lora-rank": 64}, mode="disaggregated", pools=pools)
        assert "pool prefill's max-lora-rank 32" in str(refused.value)
        assert "decode" not in str(refused.value)
        assert hub.gets("org/big", "adapter_config.json") == 3
    with pytest.raises(
        AdapterRefused, match="chat: rank 8 is above pool colocated's max-lora-rank 4"
    ):
        check({"max-lora-rank": 4}, adapters=(PVC_ADAPTER,))
    check({"max-lora-rank": 8}, adapters=(PVC_ADAPTER,))
    # Rank unknown (a pvc:// adapter without one; an hf:// endpoint that is down): admitted.
    check({"max-lora-rank": 1}, adapters=({**PVC_ADAPTER, "rank": None},))
    check({"max-lora-rank": 1}, adapters=(big,))


def test_operator_refuses_an_adapter_rank_before_any_object_and_deploys_once_fixed():
    """The reconcile loop runs the adapter admission: Degraded says why and nothing is
    applied; raising max-lora-rank deploys engines that load the adapter."""
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            adapter = {**PVC_ADAPTER, "rank": 32}
            client.create(model_deployment(adapters=[adapter]))
            degraded = wait_degraded(client, "AdapterRankTooHigh")
            assert "raise engineArgs.max-lora-rank to 32" in degraded["message"]
            assert get(client, "apps/v1", "Deployment", "llama-colocated") is None
            md_obj = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(md_obj, {"spec": {"engineArgs": {"max-lora-rank": 32}}})
            deployment = wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            engine = deployment["spec"]["template"]["spec"]["containers"][0]
            assert serve_args(engine)["lora_modules"] == ["chat=/adapter-claims/0/tenants/chat"]
            wait_for(
                lambda: condition(md_status(client), "Degraded").get("status") == "False",
                what="Degraded cleared",
            )


def test_the_chart_passes_modeldeployment_adapters_to_the_spec(helm, tmp_path):  # noqa: F811
    values = tmp_path / "values.yaml"
    adapters = [HF_ADAPTER, PVC_ADAPTER]
    values.write_text(json.dumps({"modelDeployment": {"adapters": adapters}}))
    md_obj = one(template(helm, "-f", str(values)), "ModelDeployment")
    assert md_obj["spec"]["adapters"] == adapters
    validate_model_deployment(md_obj)
    assert [a.name for a in parse_spec(md_obj["spec"]).adapters] == ["sql", "chat"]
    assert "adapters" not in one(template(helm), "ModelDeployment")["spec"]
