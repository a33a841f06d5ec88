"""Bounded work per request on one engine's API (issue 14, findings 6, 7 and 10): a streaming
client that never reads, a 5,000-prompt list, prompts too long to be worth tokenizing, lone
surrogates, chunked bodies over the limit, and what /v1/models gives away. Each attack must be
refused or cut short with its resources freed, while ordinary requests keep working."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from server_utils import metric_value, rss_bytes, running_server, unread_stream

MiB = 1 << 20
STALL_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    with running_server(
        tiny_checkpoints["llama"],
        "--max-waiting-requests",
        "8",
        "--client-stall-timeout",
        str(STALL_TIMEOUT),
    ) as (base, proc):
        yield base, proc


def ok_completion(base: str) -> None:
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def finished(base: str, reason: str) -> float:
    try:
        return metric_value(
            base, "vllm:request_success_total", {"model_name": "tiny", "finished_reason": reason}
        )
    except KeyError:
        return 0.0


def test_a_client_that_never_reads_is_aborted_and_its_memory_bounded(tiny_checkpoints):
    """Before: the engine buffered every step's cumulative output (text, tokens and 20
    logprobs for each of n=128 samples) for a client that never read: +2.5 GB in 55 s."""
    limit = 400 * MiB
    with running_server(
        tiny_checkpoints["llama"],
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "9000",
        "--client-stall-timeout",
        str(STALL_TIMEOUT),
    ) as (base, proc):
        ok_completion(base)
        baseline = rss_bytes(proc.pid)
        completed = finished(base, "length")
        client = unread_stream(base)
        try:
            grown = 0
            deadline = time.monotonic() + 240
            while metric_value(base, "pagefleet:client_stall_aborts_total") < 1:
                grown = max(grown, rss_bytes(proc.pid) - baseline)
                assert grown < limit, f"the engine grew by {grown / MiB:.0f} MiB"
                assert finished(base, "length") == completed, "the unread request ran to its end"
                assert time.monotonic() < deadline, "the stalled request was never aborted"
                time.sleep(0.2)
            # Its blocks are freed while the client is still connected, still not reading.
            while metric_value(base, "vllm:kv_cache_usage_perc") > 0:
                assert time.monotonic() < deadline, "the aborted request's blocks stay used"
                time.sleep(0.1)
            assert metric_value(base, "vllm:num_requests_running") == 0
            assert finished(base, "length") == completed
            assert rss_bytes(proc.pid) - baseline < limit
            ok_completion(base)
        finally:
            client.close()


def test_a_5000_prompt_list_is_refused_and_every_sub_request_counts(engine):
    """Before: one 55 KB body of 5,000 prompts x n=128 queued 37,486 requests past
    --max-waiting-requests 8 (one capacity check for the whole list)."""
    base, _ = engine
    prompts = [[5, 6, 7]] * 5000
    for n in (1, 128):
        body = {"model": "tiny", "prompt": prompts, "n": n, "max_tokens": 1}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text[:300]
        assert metric_value(base, "vllm:num_requests_waiting") == 0
    # 3 prompts x n=3 is 9 sequences: more than the waiting queue's 8.
    body = {"model": "tiny", "prompt": [[5, 6], [7, 8], [9, 10]], "n": 3, "max_tokens": 1}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "8" in r.json()["error"]["message"], r.text
    body["n"] = 2  # 6 sequences fit
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 6, r.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "name": "a\udfff"}]},
        ),
        ("/tokenize", {"prompt": "x\ud83d"}),
    ],
)
def test_lone_surrogates_get_a_400_json_error(engine, path, body):
    """Before: a lone surrogate reached the tokenizer and came back as a plain-text 500."""
    base, _ = engine
    raw = json.dumps({"model": "tiny", **body})  # json.dumps escapes it as \\udxxx
    r = httpx.post(f"{base}{path}", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400
    ok_completion(base)


def test_over_long_prompts_are_refused_before_tokenizing_and_tokenize_is_capped(engine):
    """Before: prompts up to the 4 MiB body limit were tokenized (on the event loop) before
    the length check, and /tokenize tokenized anything."""
    base, _ = engine
    text = "block " * 300_000  # ~1.8 MB, far beyond 256 tokens
    for path, body in (
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        # A message's name goes to the chat template too.
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": text}]}),
        ("/tokenize", {"prompt": text}),
    ):
        r = httpx.post(f"{base}{path}", json={"model": "tiny", **body}, timeout=60)
        assert r.status_code == 400, (path, r.text[:300])
        assert "maximum context length is 256" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/tokenize", json={"model": "tiny", "prompt": "hello world"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0


def test_an_over_limit_chunked_body_gets_413(engine):
    """Before: a chunked body over the limit got 400 (FastAPI's body error), not 413."""
    base, _ = engine

    def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * MiB
        yield b'"}'

    r = httpx.post(
        f"{base}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["code"] == 413
    ok_completion(base)


def test_models_do_not_show_the_checkpoint_path(engine, tiny_checkpoints):
    """Before: /v1/models showed the checkpoint's filesystem path as `root`."""
    base, _ = engine
    text = httpx.get(f"{base}/v1/models").text
    assert tiny_checkpoints["llama"] not in text and "/tmp" not in text
    assert json.loads(text)["data"][0]["id"] == "tiny"
