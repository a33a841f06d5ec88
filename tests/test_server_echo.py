"""`echo` with prompt logprobs, `prompt_logprobs`, `stream_options.continuous_usage_stats` and
the request-field audit, through a real `pagefleet serve` against HF transformers' log-softmax.

lm-evaluation-harness scores a multiple-choice answer with one completions request per context
+ continuation: `echo: true, logprobs: 1, max_tokens: 1` (0 in some versions), prompts as token
ids, and sums `token_logprobs` over the continuation's positions. Before this file the server
accepted `echo` and returned no prompt tokens: lm-eval scored every choice 0.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from hf_reference import hf_logprobs
from pagefleet.engine.server.protocol import ChatCompletionRequest, ChatMessage
from server_utils import running_server

CONTEXTS = [
    [11, 42, 7, 300, 255, 18, 99, 4, 61, 77, 123, 5, 250, 190, 33, 64, 17, 80],  # > one block
    [5, 6, 7, 8, 9],
]


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    with running_server(tiny_checkpoints["llama"]) as (base, _):
        yield base


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    from pagefleet.common.tokenizer import load_tokenizer

    return load_tokenizer(tiny_checkpoints["llama"])


def post(server: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server}{path}", json={"model": "tiny", **body}, timeout=60)


def assert_prompt_logprobs_match_hf(logprobs: dict, prompt: list[int], path: str) -> None:
    """Each prompt token's logprob (from position 1) equals HF's log-softmax at the position
    before it; the top entry is HF's most likely token there (lm-eval's is_greedy check)."""
    ref = hf_logprobs(path, prompt)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for pos in range(1, len(prompt)):
        got = logprobs["token_logprobs"][pos]
        assert math.isclose(got, ref[pos - 1, prompt[pos]].item(), abs_tol=1e-4), pos
        best = max(logprobs["top_logprobs"][pos].values())
        assert math.isclose(best, ref[pos - 1].max().item(), abs_tol=1e-4), pos


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request_returns_hf_prompt_logprobs(
    server, tokenizer, tiny_checkpoints, max_tokens
):
    """The request lm-eval's local-completions backend sends for loglikelihood. Fails for: echo
    ignored (the audit's bug: no prompt tokens, every choice scored 0), prompt logprobs not
    requested from the engine, entries shifted by one position, the generated token kept with
    max_tokens 0 or dropped with max_tokens 1."""
    body = {"prompt": CONTEXTS, "echo": True, "logprobs": 1, "max_tokens": max_tokens}
    r = post(server, {**body, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, choice in zip(CONTEXTS, choices, strict=True):
        lp = choice["logprobs"]
        generated = 1 if max_tokens else 0
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + generated
        assert_prompt_logprobs_match_hf(lp, prompt, tiny_checkpoints["llama"])
        prompt_text = tokenizer.decode(prompt)
        assert choice["text"].startswith(prompt_text)
        assert lp["tokens"][: len(prompt)] == [tokenizer.decode([t]) for t in prompt]
        if max_tokens:  # the sampled token follows, with its own logprob
            ref = hf_logprobs(tiny_checkpoints["llama"], prompt)[-1]
            assert math.isclose(lp["token_logprobs"][-1], ref.max().item(), abs_tol=1e-4)
            assert choice["text"] == prompt_text + lp["tokens"][-1]
        else:
            assert choice["text"] == prompt_text
        assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])


def test_echo_of_a_text_prompt_prepends_it_to_the_same_completion(server):
    """Fails for: echo replacing the completion, or the prompt echoed as re-decoded tokens
    instead of the text the client sent."""
    prompt = "Tell me about the river and the mountain."
    plain = post(server, {"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
    echoed = post(server, {"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True})
    assert echoed.json()["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    assert echoed.json()["usage"] == plain["usage"]


def test_streamed_echo_sends_the_prompt_once_with_logprobs_then_the_completion(
    server, tiny_checkpoints
):
    """Fails for: the echo sent with every chunk or never, logprobs of the prompt missing from
    the first chunk, text offsets restarting at 0 in each chunk."""
    prompt = CONTEXTS[0]
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    whole = post(server, body).json()["choices"][0]
    text, tokens, token_logprobs, offsets = "", [], [], []
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                tokens += choice["logprobs"]["tokens"]
                token_logprobs += choice["logprobs"]["token_logprobs"]
                offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"] and len(tokens) == len(prompt) + 5
    assert token_logprobs == pytest.approx(whole["logprobs"]["token_logprobs"])
    assert offsets == whole["logprobs"]["text_offset"]
    assert_prompt_logprobs_match_hf(whole["logprobs"], prompt, tiny_checkpoints["llama"])


def test_prompt_logprobs_field_returns_vllm_shape(server, tiny_checkpoints):
    """vLLM's `prompt_logprobs` (completions: per choice; chat: per response). Fails for: the
    field dropped, ranks or values off, the first entry not None."""
    prompt = CONTEXTS[1]
    r = post(server, {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2})
    entries = r.json()["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(tiny_checkpoints["llama"], prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = entries[pos][str(prompt[pos])]
        assert math.isclose(entry["logprob"], ref[pos - 1, prompt[pos]].item(), abs_tol=1e-4)
        assert entry["rank"] == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1
        assert len(entries[pos]) <= 3
    chat = post(
        server,
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
        "/v1/chat/completions",
    ).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3


def _chunks(server: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server}{path}", json={"model": "tiny", **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_running_usage_on_every_chunk(server, path):
    """Fails for: continuous_usage_stats ignored (the audit's finding), usage counting all
    choices' tokens instead of the chunk's own choice, or a prompt count that moves."""
    body = {"max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2, "ignore_eos": True}
    body["stream"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if path == "/v1/completions":
        body["prompt"] = "hello world"
    else:
        body["messages"] = [{"role": "user", "content": "hello world"}]
    chunks = _chunks(server, path, body)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    prompt_tokens = final["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        for choice in chunk["choices"]:
            assert usage["completion_tokens"] >= seen.get(choice["index"], 0)
            seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {0: 6, 1: 6}
    plain = _chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"]


REFUSED = [
    ({"prompt": "x", "bad_words": ["river"]}, "bad_words"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (
        {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "continuous_usage_stats",
    ),
    ({"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, "bogus"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "priority": 1}, "priority"),
]
CHAT_REFUSED = [
    # tool_choice defaults to auto with tools, which needs a parser (vLLM's 400).
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "--enable-auto-tool-choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"echo": True}, "echo"),
    ({"chat_template": "{{ 1 }}"}, "chat_template"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}, "tool_calls"),
]


@pytest.mark.parametrize(("body", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_completion_fields_are_refused_by_name(server, body, field):
    """A field a client sets and we cannot honour is a 400 naming it, never a silent drop.
    Fails for: the field ignored (200)."""
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "field"), CHAT_REFUSED, ids=[f for _, f in CHAT_REFUSED])
def test_unsupported_chat_fields_are_refused_by_name(server, body, field):
    r = post(
        server, {"messages": [{"role": "user", "content": "hi"}], **body}, "/v1/chat/completions"
    )
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_default_values_of_unsupported_fields_pass():
    """What SDKs send by default is not a refusal: null, false, empty, text format, tool_choice
    none, parallel_tool_calls true."""
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "logit_bias": None,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "parallel_tool_calls": True,
        "priority": 0,
    }
    req = ChatCompletionRequest.model_validate(body)
    assert req.messages[0].text() == "hi"


def test_message_names_reach_the_chat_template():
    """Fails for: `name` accepted and dropped on the way to the template."""
    named = ChatMessage(role="user", content="hi", name="ada").for_template()
    assert named == {"role": "user", "content": "hi", "name": "ada"}
    assert "name" not in ChatMessage(role="user", content="hi").for_template()
