"""`pagefleet serve` through the real OpenAI SDK, raw HTTP for errors, and Prometheus' parser."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, settings

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.client import EngineLimits, EngineObserver, EngineStats
from pagefleet.engine.outputs import CompletionOutput, RequestOutput
from pagefleet.engine.validation import RequestRules
from server_utils import metric_value, running_server, wait_until

MESSAGES = [{"role": "user", "content": "Tell me about the river and the mountain."}]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    with running_server(tiny_checkpoints["llama"]) as (base, _):
        yield base


@pytest.fixture(scope="module")
def offline(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], num_gpu_blocks_override=256, max_model_len=256)


def client(base: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=kw.pop("api_key", "unused"), **kw)


def test_chat_and_completions_greedy_equal_offline(server, offline):
    c = client(server)
    want_chat = (
        offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    got = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want_chat
    assert got.choices[0].finish_reason in ("length", "stop")
    assert got.usage.completion_tokens <= 20 and got.usage.prompt_tokens > 10
    assert got.id.startswith("chatcmpl-")

    want = (
        offline.generate(
            ["hello world"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    comp = c.completions.create(model="tiny", prompt="hello world", max_tokens=12, temperature=0)
    assert comp.choices[0].text == want
    streamed = c.completions.create(
        model="tiny",
        prompt="hello world",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == comp.usage.completion_tokens


def test_streaming_chat_n2_stop_logprobs(server, offline):
    c = client(server)
    stream = c.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts[0] == texts[1] and texts[0]
    assert set(finish) == {0, 1}
    assert usage.completion_tokens == 2 * len(
        offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop = texts[0][3:6]
    cut = c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == texts[0][: texts[0].index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    lp = c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_async_sdk_concurrent_requests(server, offline):
    prompts = [f"question number {i} about the sky" for i in range(6)]
    want = [
        o.outputs[0].text
        for o in offline.generate(
            prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
        )
    ]

    async def go():
        c = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x")
        results = await asyncio.gather(
            *(
                c.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
                for p in prompts
            )
        )
        await c.close()
        return [r.choices[0].text for r in results]

    assert asyncio.run(go()) == want


def test_completion_logprobs_and_models_tokenize_version(server):
    r = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": "the cache", "max_tokens": 3, "temperature": 0, "logprobs": 2},
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    models = httpx.get(f"{server}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    tok = httpx.post(f"{server}/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert "hello world" in text
    assert httpx.get(f"{server}/version").json()["version"]


def test_a_reused_request_id_does_not_collide(server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(
                *(
                    c.post(
                        f"{server}/v1/completions",
                        headers={"X-Request-Id": "trace-1"},
                        json={"prompt": "same id", "max_tokens": 8},
                    )
                    for _ in range(3)
                )
            )

    assert [r.status_code for r in asyncio.run(main())] == [200, 200, 200]


def test_request_id_is_honoured_and_echoed(server):
    r = httpx.post(
        f"{server}/v1/completions",
        headers={"X-Request-Id": "abc-123"},
        json={"prompt": "hi", "max_tokens": 2},
    )
    assert r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "cmpl-abc-123"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "n": "many"}, 400, "n"),
        ({"max_tokens": 2}, 400, "prompt"),
        ({"prompt": "hi", "max_tokens": 300}, 400, "maximum context length is 256"),
        ({"prompt": "hi", "model": "gpt-9"}, 404, "gpt-9"),
        ({"prompt": [], "max_tokens": 2}, 400, "prompt"),
        ({"prompt": [10**9], "max_tokens": 2}, 400, "token ids"),
        # Refused before the stream starts (once the engine thread refused it mid-stream).
        ({"prompt": "hi", "max_tokens": 2, "stream": True, "stop_token_ids": [10**6]}, 400, "stop"),
    ],
)
def test_client_mistakes_are_openai_shaped_errors(server, body, status, needle):
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and "type" in err


@pytest.mark.parametrize(
    ("path", "api"), [("/v1/embeddings", "Embeddings"), ("/pooling", "Pooling")]
)
def test_a_generation_engine_refuses_embeddings_with_a_400(server, path, api):
    r = httpx.post(f"{server}{path}", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"does not support the {api} API" in message and "--runner pooling" in message


def test_malformed_json_and_oversized_bodies(server):
    r = httpx.post(
        f"{server}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    big = json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1})
    r = httpx.post(
        f"{server}/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_metrics_have_vllm_names_and_types(server):
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(f"{server}/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    families = {
        f.name: f.type for f in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)
    }
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "pagefleet:kv_cache_cached_free_blocks": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:iteration_tokens_total": "histogram",
    }
    for name, kind in expected.items():
        assert families.get(name) == kind, (name, families.get(name))
    assert (
        metric_value(
            server, "vllm:cache_config_info", {"num_gpu_blocks": "256", "block_size": "16"}
        )
        == 1
    )
    assert metric_value(server, "vllm:request_success_total", {"finished_reason": "length"}) >= 1
    assert metric_value(server, "vllm:generation_tokens_total") >= 3


def test_disconnecting_streams_free_everything(server):
    async def drop(i: int):
        async with httpx.AsyncClient(timeout=30) as c:
            body = {
                "prompt": f"story {i} " * 10,
                "max_tokens": 200,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            }
            async with c.stream("POST", f"{server}/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen >= 3 + i % 5:
                        break  # leave mid-stream

    async def main():
        await asyncio.gather(*(drop(i) for i in range(16)))

    before = {reason: _finished(server, reason) for reason in ("abort", "length")}
    asyncio.run(main())

    def ended(reason: str) -> float:
        return _finished(server, reason) - before[reason]

    # A tiny model can finish a stream's 200 tokens before its client's leaving reaches the
    # server (CI caught it on a busy box): such a stream ends by length, not abort. Every one of
    # the 16 must end either way, at least one by the disconnect, and nothing stays held.
    wait_until(
        lambda: (
            metric_value(server, "vllm:num_requests_running") == 0
            and ended("abort") + ended("length") >= 16
        ),
        timeout=30,
        what="every left stream to end",
    )
    assert ended("abort") >= 1
    assert metric_value(server, "vllm:num_requests_running") == 0
    assert metric_value(server, "vllm:num_requests_waiting") == 0
    assert metric_value(server, "vllm:kv_cache_usage_perc") == 0


def _finished(server: str, reason: str) -> float:
    """vllm:request_success_total for one finished_reason (0 before the first such request)."""
    try:
        return metric_value(server, "vllm:request_success_total", {"finished_reason": reason})
    except KeyError:
        return 0.0


def test_api_key_guards_the_api_but_not_health_or_metrics(tiny_checkpoints):
    with running_server(tiny_checkpoints["llama"], "--api-key", "s3cret") as (base, _):
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(f"{base}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            client(base, api_key="nope").models.list()
        assert client(base, api_key="s3cret").models.list().data[0].id == "tiny"


def test_full_waiting_queue_answers_503_with_retry_after(tiny_checkpoints):
    flags = (
        "--max-waiting-requests",
        "1",
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        "64",
        "--max-model-len",
        "1024",
    )
    with running_server(tiny_checkpoints["llama"], *flags) as (base, _):

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "long " * 20, "max_tokens": 900, "ignore_eos": True}
                first = asyncio.ensure_future(c.post(f"{base}/v1/completions", json=body))
                for _ in range(500):  # the first one is running
                    if metric_value(base, "vllm:num_requests_running") == 1:
                        break
                    await asyncio.sleep(0.01)
                # One more may wait; the rest are refused while the first still runs.
                rest = await asyncio.gather(
                    *(c.post(f"{base}/v1/completions", json=body) for _ in range(3))
                )
                return await first, rest

        first, rest = asyncio.run(main())
        assert first.status_code == 200
        codes = sorted(r.status_code for r in rest)
        assert codes == [200, 503, 503], codes
        refused = next(r for r in rest if r.status_code == 503)
        assert refused.headers["retry-after"] and refused.json()["error"]["code"] == 503


def test_sigterm_finishes_in_flight_streams_and_exits_zero(tiny_checkpoints):
    import signal

    with running_server(tiny_checkpoints["llama"]) as (base, proc):

        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": "go on", "max_tokens": 60, "ignore_eos": True, "stream": True}
                async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 2:
                                proc.send_signal(signal.SIGTERM)
                    return lines

        lines = asyncio.run(main())
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("dataset", "endpoint", "extra"),
    [
        ("random", "completions", ["--request-rate", "50"]),
        ("shared-prefix", "chat", ["--num-groups", "2", "--prefix-len", "40"]),
        ("multi-turn", "chat", ["--num-turns", "3", "--max-concurrency", "2"]),
    ],
)
def test_bench_serve_measures_the_server(server, tmp_path, dataset, endpoint, extra):
    import subprocess

    from server_utils import PAGEFLEET

    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            PAGEFLEET,
            "bench",
            "serve",
            "--base-url",
            server,
            "--model",
            "tiny",
            "--endpoint",
            endpoint,
            "--dataset",
            dataset,
            "--num-prompts",
            "6",
            "--input-len",
            "12",
            "--output-len",
            "8",
            "--result-json",
            str(out),
            "--no-progress",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Output token throughput" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    turns = 3 if dataset == "multi-turn" else 1
    assert summary["completed"] == 6 * turns and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * turns * 8
    assert 0 < summary["ttft_s"]["median"] <= summary["e2e_s"]["p99"]
    assert summary["itl_s"]["mean"] > 0


def test_openapi_fuzz_never_answers_5xx(server):
    """Schema-driven requests for every operation of the server's OpenAPI document (valid and
    edge values, bounded count): a client's input is never answered with a 5xx."""
    import schemathesis
    from hypothesis import given

    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=10,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)

        check()


class _StubEngine(EngineObserver):
    """Only the EngineClient seam: what the server may know of an engine."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.limits = EngineLimits(RequestRules(64, 16, 8, len(tokenizer)), 4, True, "float32")
        self.is_running = True
        self.num_waiting_sequences = 0
        self.observers = []

    def stats(self) -> EngineStats:
        return EngineStats(3, 2, 0.25, 1, 100, 40, 5, 0, None)

    def subscribe(self, observer) -> None:
        self.observers.append(observer)


def test_the_server_needs_only_the_engine_client_seam(tiny_checkpoints):
    """The app is built over EngineClient alone: limits, a stats snapshot, subscriptions."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from pagefleet.common.tokenizer import load_tokenizer
    from pagefleet.engine.server.app import ServerConfig, build_app

    engine = _StubEngine(load_tokenizer(tiny_checkpoints["llama"]))
    app = build_app(engine, ServerConfig("stub"))
    assert len(engine.observers) == 1  # the metrics hear of steps, pulls and stalls
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 64
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(http.get("/metrics").text)
            for sample in family.samples
        }
        assert samples["vllm:num_requests_running"] == 3
        assert samples["vllm:prefix_cache_hits_total"] == 40
        too_long = http.post("/v1/completions", json={"prompt": [1] * 64})
        assert too_long.status_code == 400 and "maximum context length is 64" in too_long.text
        app.state.server.draining = True
        assert http.get("/health").status_code == 503


class _EndlessEngine(_StubEngine):
    """Streams one more token per tick until its stream is closed (which aborts it)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.open_streams = 0

    def check_request(self, prompt, params) -> None:
        pass

    def generate(self, prompt, params, request_id):
        return self._stream(prompt, request_id)

    async def _stream(self, prompt, request_id):
        self.open_streams += 1
        try:
            for n in range(1, 100_000):
                await asyncio.sleep(0)
                out = CompletionOutput(0, "a" * n, [5] * n)
                yield RequestOutput(request_id, None, list(prompt), [out])
        finally:
            await asyncio.sleep(0)  # an abort that awaits, as the engine client's does
            self.open_streams -= 1


async def _leave_after_first_chunk(app, path: str, body: dict) -> int:
    """One streamed request over ASGI the way uvicorn (spec 2.3) runs it; the client
    disconnects once the first chunk arrived. Returns the number of chunks it saw."""
    first_chunk = asyncio.Event()
    chunks = []
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if request:
            return request.pop()
        await first_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            first_chunk.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    return len(chunks)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hello", "stream": True, "n": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
    ],
)
def test_a_client_that_leaves_a_stream_aborts_it_at_once(tiny_checkpoints, path, body):
    """Without relying on the garbage collector (off here): CI saw an idle server keep left
    streams running, and their aborts uncounted, past a 30-second wait."""
    import gc

    from pagefleet.common.tokenizer import load_tokenizer
    from pagefleet.engine.server.app import ServerConfig, build_app

    engine = _EndlessEngine(load_tokenizer(tiny_checkpoints["llama"]))
    app = build_app(engine, ServerConfig("stub"))
    gc.disable()
    try:
        seen = asyncio.run(asyncio.wait_for(_leave_after_first_chunk(app, path, body), 60))
        assert 1 <= seen < 1000
        assert engine.open_streams == 0  # every stream closed, so aborted in the engine
    finally:
        gc.enable()
    aborts = app.state.server.metrics.success.labels("stub", "abort")._value.get()
    assert aborts == body.get("n", 1)
