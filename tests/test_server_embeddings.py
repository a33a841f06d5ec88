"""`/v1/embeddings` and `/pooling` of a pooling engine through the openai SDK and raw HTTP, in
process (the app over a real `AsyncLLM`, built from `pagefleet serve`'s own flags): vectors
equal sentence-transformers', as floats and base64, with Matryoshka `dimensions` and token-id
inputs; hostile bodies are 400s that queue no work; completions and chat are refused."""

from __future__ import annotations

import argparse
import json
import re

import openai
import pytest
import torch
from st_checkpoints import st_checkpoint

MAX_MODEL_LEN = 64
TEXTS = ["hello world", "the river and the mountain are blue", "what is a cache block? " * 2]


@pytest.fixture(scope="module")
def st_path(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("st-server")
    return st_checkpoint(
        tiny_checkpoints["qwen3"],
        root / "qwen3-embedding",
        "lasttoken",
        True,
        legacy=True,
        matryoshka_dimensions=[16, 32, 64],
    )


@pytest.fixture(scope="module")
def http(st_path):
    from fastapi.testclient import TestClient

    from pagefleet.engine.async_llm import AsyncLLM
    from pagefleet.engine.server.app import ServerConfig, build_app
    from pagefleet.engine.server.serve import add_serve_parser, engine_args_from

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    flags = ["--runner", "pooling", "--convert", "embed", "--max-model-len", str(MAX_MODEL_LEN)]
    flags += ["--pooler-config", '{"pooling_type": "LAST"}', "--num-gpu-blocks-override", "64"]
    engine = AsyncLLM.from_engine_args(
        engine_args_from(parser.parse_args(["serve", st_path, *flags]))
    )
    try:
        with TestClient(build_app(engine, ServerConfig("tiny"))) as client:
            yield client
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def sdk(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


@pytest.fixture(scope="module")
def oracle(st_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(st_path, device="cpu")


def vectors(response) -> torch.Tensor:
    return torch.tensor([d.embedding for d in sorted(response.data, key=lambda d: d.index)])


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() >= 0.9999
    assert (got - want).abs().max() <= 1e-4


def test_the_openai_sdk_gets_sentence_transformers_vectors(sdk, http, oracle):
    want = oracle.encode(TEXTS, convert_to_tensor=True).float()
    as_base64 = sdk.embeddings.create(model="tiny", input=TEXTS)  # the SDK's default format
    assert_close(vectors(as_base64), want)
    as_floats = sdk.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert_close(vectors(as_floats), want)
    # The encodings carry the same floats: compared on one text, computed alone each time
    # (a row's last bits may depend on what else shares its batch, on either CPU linear path).
    one_b64 = sdk.embeddings.create(model="tiny", input=TEXTS[0])
    one_float = sdk.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    assert torch.equal(vectors(one_float), vectors(one_b64))
    ids = [oracle.tokenizer.encode(t) for t in TEXTS]
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(map(len, ids))
    assert_close(vectors(sdk.embeddings.create(model="tiny", input=ids)), want)
    one = sdk.embeddings.create(model="tiny", input=ids[1], user="someone")
    assert_close(vectors(one), want[1:2])
    short = sdk.embeddings.create(model="tiny", input=TEXTS, dimensions=32)
    assert_close(vectors(short), torch.nn.functional.normalize(want[:, :32], dim=-1))
    pooled = http.post("/pooling", json={"model": "tiny", "input": TEXTS, "task": "embed"})
    assert pooled.status_code == 200, pooled.text
    data = pooled.json()["data"]
    assert [d["object"] for d in data] == ["pooling"] * 3
    assert_close(torch.tensor([d["data"] for d in data]), want)


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, oracle):
    text = "the cat and the dog in the tree by the river " * 8
    ids = oracle.tokenizer.encode(text)
    assert len(ids) > MAX_MODEL_LEN
    body = {"input": text, "truncate_prompt_tokens": 10}
    got = http.post("/v1/embeddings", json=body).json()
    assert got["usage"]["prompt_tokens"] == 10
    same = http.post("/v1/embeddings", json={"input": [ids[-10:]]}).json()
    assert got["data"][0]["embedding"] == same["data"][0]["embedding"]
    whole = http.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": -1})
    assert whole.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


BAD_BODIES = [
    ({"input": []}, "input", "non-empty"),
    ({"input": ""}, "input", "empty"),
    ({"input": ["fine", "x y " * 100]}, "input", r"input\[1\].*maximum context length"),
    ({"input": [list(range(1, 80))]}, "input", "maximum context length"),
    ({"input": ["x"] * 10_000}, "input", "10000 items; at most 2048"),
    ({"input": [[["nested"]]]}, "input", "list of token ids"),
    ({"input": [1, "a"]}, "input", "one kind per request"),
    ({"input": {"text": "hi"}}, "input", "string or a non-empty list"),
    ({"input": [[10**9]]}, "input", "must be in"),
    ({"input": "hi", "dimensions": 20}, "dimensions", r"one of \[16, 32, 64\]"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "hi", "truncate_prompt_tokens": 100}, "truncate_prompt_tokens", "max_model_len"),
    ({"input": "hi", "messages": [{"role": "user"}]}, None, "messages is not supported"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_BODIES)
def test_bad_inputs_are_400s_naming_the_field(http, body, param, message):
    r = http.post("/v1/embeddings", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]


def test_hostile_bodies_queue_no_work_and_the_engine_still_serves(http):
    """After every refusal above, a deep-nested body and an unknown model, no prompt token was
    computed: each was refused before anything reached the engine."""
    before = metric(http, "vllm:prompt_tokens_total")
    for body, _, _ in BAD_BODIES:
        assert http.post("/v1/embeddings", json=body).status_code == 400
    deep = '{"input": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = http.post("/v1/embeddings", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert http.post("/v1/embeddings", json={"model": "other", "input": "hi"}).status_code == 404
    assert metric(http, "vllm:prompt_tokens_total") == before
    ok = http.post("/v1/embeddings", json={"input": ["hello", "world"]})
    assert ok.status_code == 200
    assert metric(http, "vllm:prompt_tokens_total") == before + ok.json()["usage"]["prompt_tokens"]
    assert metric(http, "vllm:request_success_total", finished_reason="stop") >= 2
    assert metric(http, "vllm:e2e_request_latency_seconds_count") >= 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_pooling_engine_refuses_generation(http, path):
    body = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    r = http.post(path, json=body)
    assert r.status_code == 400
    api = "Chat Completions" if "chat" in path else "Completions"
    assert f"does not support the {api} API" in r.json()["error"]["message"]
    assert "--runner pooling" in r.json()["error"]["message"]


def metric(http, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def test_openapi_fuzz_of_the_pooling_endpoints_never_answers_5xx(http):
    """Schema-driven bodies for /v1/embeddings and /pooling (bounded count): a client's
    input is never answered with a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_asgi("/openapi.json", http.app)
    operations = [r.ok() for r in schema.get_all_operations()]
    pooling = [op for op in operations if op.path in ("/v1/embeddings", "/pooling")]
    assert len(pooling) == 2
    for operation in pooling:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=10,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            response = case.call()
            assert response.status_code < 500, (case.path, case.body, response.text)

        check()


def test_the_router_sends_embeddings_to_the_least_loaded_engine_fields_intact(http, oracle):
    """The router in process over this engine's app as two pods, "busy" (5 waiting) and
    "idle": /v1/embeddings and /pooling go to "idle" (load-aware: the first input is under a
    block, so no prefix affinity applies), the body arrives byte for byte (dimensions,
    encoding_format, user pass through) and the vectors come back."""
    import asyncio

    import httpx

    from pagefleet.router.app import Router, RouterConfig, build_router_app
    from pagefleet.router.pods import PodRegistry
    from pagefleet.router.prefix_index import PrefixIndex
    from pagefleet.router.scoring import Pipeline, Pod

    registry = PodRegistry()
    registry.set_pods([Pod("busy", "http://busy"), Pod("idle", "http://idle")])
    for status in registry.status.values():
        status.scraped_at, status.ready = 0.0, True  # as after a good scrape
    registry.status["busy"].pod.waiting = 5.0
    pipeline = Pipeline.from_config({"scorers": {"prefix": 2.0, "queue": 1.0}})
    router = Router(
        registry, PrefixIndex("approximate"), pipeline, RouterConfig(), clock=lambda: 0.0
    )
    seen: list[tuple[str, str, bytes]] = []
    engine = httpx.ASGITransport(app=http.app)

    class Engines(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append((request.url.host, request.url.path, await request.aread()))
            return await engine.handle_async_request(request)

    body = json.dumps(
        {"model": "tiny", "input": TEXTS, "dimensions": 32, "user": "u", "encoding_format": "float"}
    ).encode()

    async def post(path: str) -> dict:
        app = build_router_app(router, client=httpx.AsyncClient(transport=Engines()))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            headers = {"content-type": "application/json"}
            r = await client.post(path, content=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()

    got = asyncio.run(post("/v1/embeddings"))
    pooled = asyncio.run(post("/pooling"))
    assert [(host, path) for host, path, _ in seen] == [
        ("idle", "/v1/embeddings"),
        ("idle", "/pooling"),
    ]
    assert all(sent == body for _, _, sent in seen)
    want = torch.nn.functional.normalize(
        oracle.encode(TEXTS, convert_to_tensor=True)[:, :32], dim=-1
    )
    assert_close(torch.tensor([d["embedding"] for d in got["data"]]), want)
    # A separate request: equal within rounding (a row's last bits depend on its batch).
    assert_close(torch.tensor([d["data"] for d in pooled["data"]]), want)


def test_bench_serve_drives_embeddings(http, tmp_path):
    """`pagefleet bench serve --endpoint embeddings` against this engine on a loopback port:
    every batch answered, embeddings and prompt tokens counted."""
    import asyncio
    import threading
    import time

    import uvicorn

    from pagefleet.common.cli import build_parser
    from pagefleet.fleet.bench_serve import run_bench
    from server_utils import free_port

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(http.app, host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "tiny"]
        argv += ["--endpoint", "embeddings", "--num-prompts", "10", "--batch-size", "4"]
        argv += ["--input-len", "8", "--no-progress", "--max-concurrency", "2"]
        argv += ["--result-json", str(tmp_path / "result.json")]
        assert asyncio.run(run_bench(build_parser().parse_args(argv))) == 0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    summary = json.loads((tmp_path / "result.json").read_text())["summary"]
    assert (summary["completed"], summary["failed"], summary["total_embeddings"]) == (3, 0, 10)
    assert summary["total_prompt_tokens"] >= 10 and summary["embedding_throughput"] > 0
