"""The router with LoRA adapters, in process over mock engines: it learns each pod's adapters
(/v1/models) and the adapters in use (vllm:lora_requests_info, as vLLM exports it), sends an
adapter's requests only to pods that serve it and prefers those where it is loaded, and hashes
an adapter's prompt exactly as the engine keys its blocks."""

from __future__ import annotations

import asyncio
import json

import httpx

from pagefleet.common.block_hash import hash_blocks, lora_extra_keys
from pagefleet.common.kv_events import BlockStored, decode_batch, encode_batch
from pagefleet.common.metrics_text import parse_metrics
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.request import Request
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.router.app import Router, RouterConfig, build_router_app
from pagefleet.router.pods import PodRegistry, served_adapters
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scoring import Pipeline, Pod, RoutingRequest, lora_affinity_scorer

PROMPT = list(range(1, 70))


def metrics_page(running: str = "", waiting: str = "", max_lora: int = 2) -> str:
    lines = [
        'vllm:num_requests_waiting{model_name="tiny"} 0.0',
        'vllm:kv_cache_usage_perc{model_name="tiny"} 0.0',
        # vLLM leaves every combination it reported behind, valued the time it was set.
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="stale",'
        'waiting_lora_adapters=""} 100.0',
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} 200.0',
    ]
    return "\n".join(lines) + "\n"


def models_page(*adapters: str) -> dict:
    cards = [{"id": "tiny", "object": "model"}]
    return {"data": cards + [{"id": a, "object": "model", "parent": "tiny"} for a in adapters]}


ENGINES = {  # pod -> (its adapters, those in use)
    "a": (("sql",), ""),
    "b": (("sql", "chat"), "chat"),
    "c": ((), ""),
}


def engines(request: httpx.Request) -> httpx.Response:
    adapters, running = ENGINES[request.url.host]
    if request.url.path == "/metrics":
        return httpx.Response(200, text=metrics_page(running))
    if request.url.path == "/v1/models":
        return httpx.Response(200, json=models_page(*adapters))
    body = json.dumps({"served_by": request.url.host}).encode()
    return httpx.Response(
        200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(body)
    )


async def route_all(bodies: list[dict]) -> list[httpx.Response]:
    registry = PodRegistry()
    registry.set_pods([Pod(name, f"http://{name}") for name in ENGINES])
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    for status in list(registry.status.values()):
        await registry._scrape(client, status)
    router = Router(
        registry, PrefixIndex("approximate"), Pipeline.from_config(), RouterConfig("tiny")
    )
    router.clock = lambda: 0.0  # every scrape stays fresh
    for status in registry.status.values():
        status.scraped_at = 0.0
    app = build_router_app(router, client=client)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
        return [await http.post("/v1/completions", json=b) for b in bodies]


def test_adapter_requests_go_only_to_pods_that_serve_it_loaded_ones_first():
    """Fails for: the model filter ignoring adapters (pod c, without them, gets some: 404 on a
    real engine), the affinity scorer ignoring what is in use (chat splits between b and a
    tie), the router refusing adapter names that are not its --model (404)."""
    bodies = [{"model": m, "prompt": PROMPT} for m in ["sql"] * 4 + ["chat"] * 3]
    bodies.append({"model": "unknown", "prompt": PROMPT})
    responses = asyncio.run(route_all(bodies))
    served = [r.json().get("served_by") for r in responses[:-1]]
    assert set(served[:4]) <= {"a", "b"}  # never c
    # The first sql request finds no pod using it: a, with a free slot and nothing in use,
    # ties b's free slot at load; the rest follow it (the router recorded where it went).
    assert len(set(served[:4])) == 1
    assert served[4:] == ["b"] * 3  # chat is in use on b, and only b serves it
    assert responses[-1].status_code == 404


def test_affinity_scores_loaded_then_recent_then_free_slots():
    pods = [
        Pod("active", "u", active_adapters=frozenset({"x"}), max_lora=1),
        Pod("full", "u", active_adapters=frozenset({"y"}), max_lora=1, recent_adapters=["x"]),
        Pod("recent", "u", active_adapters=frozenset(), max_lora=2, recent_adapters=["x"]),
        Pod("free", "u", active_adapters=frozenset({"y"}), max_lora=2),
    ]
    scores = lora_affinity_scorer(RoutingRequest("x", [], adapter="x"), pods)
    assert scores["active"] > scores["recent"] > scores["free"] > scores["full"] == 0
    base = lora_affinity_scorer(RoutingRequest("m", []), pods)
    assert len(set(base.values())) == 1  # base-model requests: no preference
    serving = [Pod("with", "u", adapters=frozenset({"x"})), Pod("without", "u")]
    pipeline = Pipeline.from_config()
    assert [p.name for p in pipeline.candidates(RoutingRequest("x", [], adapter="x"), serving)] == [
        "with"
    ]
    assert len(pipeline.candidates(RoutingRequest("m", []), serving)) == 2
    pod = Pod("p", "u", max_lora=2)
    for name in ("a", "b", "a", "c"):
        pod.sent_adapter(name)
    assert pod.recent_adapters == ["a", "c"]  # the pod's LRU slots, as the router sees them


def test_lora_info_and_model_lists_are_read_as_vllm_writes_them_and_bounded():
    lora = parse_metrics(metrics_page("x,y", "z", 4))["lora"]
    assert lora == {"active": frozenset({"x", "y", "z"}), "max_lora": 4}  # the newest series
    names = ",".join(["n" * 300, *(f"a{i}" for i in range(1000))])
    hostile = f'vllm:lora_requests_info{{max_lora="lots",running_lora_adapters="{names}"}} 1\n'
    lora = parse_metrics(hostile)["lora"]
    assert lora["max_lora"] == 0 and len(lora["active"]) == 255 and "n" * 300 not in lora["active"]
    assert served_adapters(models_page("s")) == {"s"}
    assert served_adapters({"data": [{"id": ["x"], "parent": "m"}, "junk", {"id": "y"}]}) == set()
    assert served_adapters({"data": "nope"}) is None


def test_router_hashes_an_adapter_prompt_as_the_engine_keys_its_blocks():
    registry = PodRegistry()
    registry.set_pods([Pod("a", "http://a", adapters=frozenset({"sql"}))])
    router = Router(registry, PrefixIndex("precise"), Pipeline.from_config(), RouterConfig())
    adapter = LoRARequest("sql", 7, "/adapters/sql")
    engine = Request("r", PROMPT, SamplingParams(), block_size=16, lora_request=adapter)
    body = {"model": "sql", "prompt": PROMPT}
    assert router.prompt_hashes("/v1/completions", body, 16) == engine.block_hashes
    base = router.prompt_hashes("/v1/completions", {"model": "tiny", "prompt": PROMPT}, 16)
    assert base == hash_blocks(PROMPT, 16) and not set(base) & set(engine.block_hashes)
    assert engine.block_hashes == hash_blocks(PROMPT, 16, extra_keys=lora_extra_keys("sql"))


def test_kv_events_carry_the_adapter_in_vllms_fields():
    event = BlockStored([b"h1"], None, [1, 2], 16, None, "sql", 7)
    _, (decoded,) = decode_batch(encode_batch(1.0, [event]))
    assert (decoded.lora_name, decoded.lora_id) == ("sql", 7)
    # vLLM's own order: ..., block_size, lora_id, medium, lora_name, extra_keys, ...
    import msgpack

    raw = ["BlockStored", [b"h"], None, [], 16, 3, "GPU", "x" * 300, [["sql"]], 0]
    _, (vllm_event,) = decode_batch(msgpack.packb([1.0, [raw]], use_bin_type=True))
    assert vllm_event.lora_name is None and vllm_event.lora_id == 3  # an overlong name: none


def test_the_endpoint_picker_sends_an_adapters_request_only_where_it_is_served():
    """The Endpoint Picker shares the router's core: an adapter's request goes to the pod
    that lists it though the other pod is less loaded, a base request still takes the less
    loaded one, and an adapter no pod serves is the router's 404."""
    from test_epp_protocol import A, B, body_message, headers_message, immediate_of, mutation
    from test_epp_protocol import picker as epp_picker
    from test_epp_protocol import run as epp_run

    from pagefleet.router.ext_proc import DESTINATION_HEADER

    epp = epp_picker(model="tiny")  # B has the longer queue
    epp.router.registry.status[B].pod.adapters = frozenset({"sql"})

    def route(model: str):
        body = json.dumps({"model": model, "prompt": "a prompt " * 16}).encode()
        return epp_run(epp, headers_message(), body_message(body))[1]

    (routed, *_) = route("sql")
    assert mutation(routed)[DESTINATION_HEADER] == B
    (routed, *_) = route("tiny")
    assert mutation(routed)[DESTINATION_HEADER].split(",")[0] == A
    code, _, body = immediate_of(route("chat")[-1:])
    assert code == 404 and "does not exist" in body["error"]["message"]
