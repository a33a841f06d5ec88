"""Structured outputs (issue 24): grammar-constrained sampling offline and over the API, and
logit_bias, on the tiny random checkpoint (whose free output is noise, so every valid output
is the grammar's doing)."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import jsonschema
import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "ok": {"type": "boolean"},
            },
            "required": ["zip", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -5, "maximum": 5},
            "y": {"enum": [1, 2, 3]},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 2,
}
PROMPTS = ["Tell me about the river.", "The mountain and the sea"]


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def schema_params(schema: dict, **kw) -> SamplingParams:
    text = json.dumps(schema, sort_keys=True)
    return SamplingParams(structured_outputs=so(json=text), **{"max_tokens": 200, **kw})


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], num_gpu_blocks_override=256, max_model_len=512)


@pytest.fixture(scope="module")
def tight_llm(tiny_checkpoints):
    """A small pool (preemption) with n-gram speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    return LLM(
        tiny_checkpoints["llama"],
        num_gpu_blocks_override=32,
        block_size=8,
        max_model_len=160,
        speculative_config=spec,
    )


def test_json_schema_outputs_validate_for_many_seeds(llm):
    params = [schema_params(s, seed=seed) for s in (PERSON, POINTS) for seed in range(3)]
    outs = llm.generate([PROMPTS[i % 2] for i in range(len(params))], params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        (c,) = out.outputs
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), json.loads(p.structured_outputs.json))


def test_regex_choice_grammar_and_json_object_outputs_match(llm):
    params = [
        SamplingParams(seed=1, max_tokens=32, structured_outputs=so(regex=r"\d{3}-[a-z]{2,4}")),
        SamplingParams(seed=2, max_tokens=32, structured_outputs=so(choice=("yes", "no", "maybe"))),
        SamplingParams(seed=3, max_tokens=32, structured_outputs=so(grammar='start: "ab" | "cd"')),
        SamplingParams(seed=4, max_tokens=40, structured_outputs=so(json_object=True)),
    ]
    regex, choice, grammar, obj = (
        o.outputs[0] for o in llm.generate([PROMPTS[0]] * 4, params, use_tqdm=False)
    )
    assert re.fullmatch(r"\d{3}-[a-z]{2,4}", regex.text)
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    assert grammar.text in ("ab", "cd")
    # A random model may run out of tokens inside an object: what it wrote is still a prefix.
    assert obj.text.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_schema_needing_a_long_output_ends_at_max_tokens(llm):
    schema = {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 200}
    (out,) = llm.generate(PROMPTS[0], schema_params(schema, seed=0, max_tokens=12))
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    assert c.text.startswith('["')  # valid so far: a prefix of a conforming document


def test_permissive_grammar_greedy_equals_free_greedy(llm):
    # Any token, by id: the random model's output is not even valid UTF-8, which a text regex
    # such as (?s:.*) would (rightly) refuse.
    vocab = llm.engine.model_config.vocab_size
    any_token = so(grammar=f"start: t*\nt: <[0-{vocab - 1}]>")
    free = SamplingParams(temperature=0, max_tokens=24)
    anything = SamplingParams(temperature=0, max_tokens=24, structured_outputs=any_token)
    outs = llm.generate(PROMPTS * 2, [free, free, anything, anything], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in outs[2:]]


def test_logit_bias_moves_the_greedy_choice(llm):
    (base,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
    first = base.outputs[0].token_ids[0]
    other = (first + 7) % 300 + 3
    pushed = SamplingParams(temperature=0, max_tokens=1, logit_bias={other: 100})
    banned = SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100})
    up, down = llm.generate([PROMPTS[0]] * 2, [pushed, banned], use_tqdm=False)
    assert up.outputs[0].token_ids == [other]
    assert down.outputs[0].token_ids[0] != first


def test_logit_bias_tensors_are_built_once_per_request():
    """The bias a request's params carry becomes tensors at its first sampled step and is
    reused at every later one (before: rebuilt each step); the values land where they
    should, on every row of a verify step."""
    from pagefleet.engine.request import Request
    from pagefleet.engine.structured.logits import constrain_logits

    req = Request("r", [1, 2], SamplingParams(logit_bias={5: 2.0, 7: -1.0}))
    first = constrain_logits(torch.zeros(1, 10), [req])
    built = req.logit_bias
    assert first[0, 5] == 2.0 and first[0, 7] == -1.0 and first[0, 6] == 0.0
    verify = constrain_logits(torch.zeros(3, 10), [req], {"r": [4, 4]})
    assert req.logit_bias is built
    assert verify[:, 5].tolist() == [2.0] * 3


def test_a_flood_of_grammars_from_one_tenant_does_not_hold_up_another():
    """One compile thread; tenant a queues five slow grammars, then tenant b one of its own
    and one a has queued too. b's own compile runs after at most one more of a's, and the
    shared one in b's turn, ahead of a's later ones. Fails with a plain FIFO pool (b's
    compile would wait for all five)."""
    from pagefleet.engine.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(None, 0, frozenset(), max_workers=1)
    release, order = threading.Event(), []

    def slow_compile(params):
        release.wait(30)
        order.append(params.regex)
        return params.regex

    compiler._compile = slow_compile
    try:
        flood = [compiler.compile(so(regex=f"a{i}"), "a") for i in range(5)]
        mine = compiler.compile(so(regex="b"), "b")
        assert compiler.compile(so(regex="a4"), "b") is flood[4]  # one compile, two turns
        release.set()
        for entry in (*flood, mine):
            assert entry.future.result(30) is not None
    finally:
        release.set()
        compiler.close()
    assert sorted(order) == ["a0", "a1", "a2", "a3", "a4", "b"]  # each compiled once
    assert order.index("b") <= 2
    assert order.index("a4") < order.index("a3")


def test_grammar_with_n_and_a_prefix_cache_hit(llm):
    prompt = "The river, the mountain, the sea, the sky and the road " * 3
    params = schema_params(POINTS, n=3, seed=5)
    first, again = (llm.generate(prompt, params)[0] for _ in range(2))
    assert again.num_cached_tokens > 0
    for out in (first, again):
        assert len(out.outputs) == 3
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), POINTS)
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]


def test_grammar_survives_preemption_and_speculation(tight_llm, llm):
    # A prompt that repeats itself gives the n-gram proposer drafts; 6 requests in a 32-block
    # pool preempt each other.
    prompt = '[{"x":1,"y":2},{"x":1,"y":2}] ' * 2
    params = [schema_params(POINTS, seed=s, max_tokens=80) for s in range(6)]
    outs = tight_llm.generate([prompt] * 6, params, use_tqdm=False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), POINTS)
    stats = tight_llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode.num_draft_tokens > 0
    greedy = schema_params(POINTS, temperature=0, max_tokens=60)
    (spec_out,) = tight_llm.generate(prompt, greedy)
    jsonschema.validate(json.loads(spec_out.outputs[0].text), POINTS)
    (plain_out,) = llm.generate(prompt, greedy)  # no speculation: verification changes nothing
    assert spec_out.outputs[0].token_ids == plain_out.outputs[0].token_ids


def test_a_compile_past_the_time_limit_fails_the_request(llm):
    compiler = llm.engine.grammars.compiler
    release = threading.Event()
    real_compile, real_timeout = compiler._compile, compiler.timeout_s
    compiler._compile = lambda params: release.wait(30) and real_compile(params)
    compiler.timeout_s = 0.0
    try:
        with pytest.raises(ValueError, match="took over"):
            llm.generate(PROMPTS[0], SamplingParams(structured_outputs=so(regex="slow|never")))
    finally:
        release.set()
        compiler._compile, compiler.timeout_s = real_compile, real_timeout
    assert not llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------- the API


@pytest.fixture(scope="module")
def http(tiny_checkpoints):
    from fastapi.testclient import TestClient

    from pagefleet.engine.async_llm import AsyncLLM
    from pagefleet.engine.config import EngineArgs
    from pagefleet.engine.server.app import ServerConfig, build_app

    args = EngineArgs(tiny_checkpoints["llama"], num_gpu_blocks_override=128, max_model_len=256)
    engine = AsyncLLM.from_engine_args(args)
    try:
        with TestClient(build_app(engine, ServerConfig("m"))) as client:
            yield client
    finally:
        engine.shutdown()


def chat(http, **body):
    messages = [{"role": "user", "content": "Give me a point."}]
    return http.post("/v1/chat/completions", json={"messages": messages, "seed": 0, **body})


def test_a_grammar_compiled_long_ago_is_served_from_the_cache(http):
    """A constraint compiled more than the compile time limit ago comes from the cache: before,
    the server waited for the cached compile with what was left of the limit (nothing), and
    answered 400 "took too long" (a CI flake whenever the second request came 10 s later)."""
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINTS}}
    assert chat(http, response_format=rf, max_tokens=60).status_code == 200
    compiler = http.app.state.server.engine.engine.grammars.compiler
    for entry in compiler._cache.values():
        entry.started -= 3600  # compiled an hour ago
    again = chat(http, response_format=rf, max_tokens=60)
    assert again.status_code == 200, again.text
    jsonschema.validate(json.loads(again.json()["choices"][0]["message"]["content"]), POINTS)


def test_response_format_json_schema_on_chat_streamed_and_not(http):
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINTS, "strict": True}}
    body = chat(http, response_format=rf, max_tokens=120, n=2).json()
    for choice in body["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), POINTS)
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": rf,
            "max_tokens": 120,
            "stream": True,
            "seed": 1,
        },
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), POINTS)


@pytest.mark.parametrize(
    ("field", "value", "check"),
    [
        ("guided_choice", ["left", "right"], lambda t: t in ("left", "right")),
        ("guided_regex", "[0-9]{4}", lambda t: re.fullmatch("[0-9]{4}", t)),
        ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ("guided_json", POINTS, lambda t: jsonschema.validate(json.loads(t), POINTS) is None),
        ("response_format", {"type": "json_object"}, lambda t: t.startswith("{")),
    ],
)
def test_completions_take_every_constraint_field(http, field, value, check):
    body = {"prompt": "Pick:", "max_tokens": 120, "seed": 3, field: value}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert check(r.json()["choices"][0]["text"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"suffix": "x"}, None),  # still refused: not implemented
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_json": {"enum": ["x" * 70_000]}}, None),  # over the size bound
        ({"guided_regex": "a" * 70_000}, None),
        ({"guided_choice": [str(i) for i in range(1000)]}, None),
        ({"guided_choice": ["a"], "guided_regex": "a"}, None),  # two constraints
        ({"logit_bias": {"999999": 5}}, "logit_bias"),  # not a token of this vocabulary
        ({"logit_bias": {"5": 101}}, None),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, None),
        ({"response_format": {"type": "json_schema"}}, None),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(http, body, param):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    name = next(iter(body))
    assert name in error["message"] or error.get("param") == name
    if param is not None:
        assert error.get("param") == param or name in error["message"]


def test_pathological_regexes_answer_promptly(http):
    # llguidance's lexer is lazy and fuel-bounded: these compile (or fail) in milliseconds
    # instead of building exponential automata; the request still ends within max_tokens.
    for regex in ["(a{1,1000}){1,1000}", "(a|b)*a(a|b){25}", "((a+)+)+b"]:
        r = http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 8, "guided_regex": regex}
        )
        assert r.status_code in (200, 400), r.text


def test_logit_bias_over_the_api_and_unknown_fields_are_counted(http):
    body = {"prompt": "The river", "max_tokens": 1, "temperature": 0}
    free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    target = 42 if _decode(http, 42) != free else 43  # a token greedy would not pick
    pushed = http.post(
        "/v1/completions",
        json={**body, "logit_bias": {str(target): 100}, "metadata": {"a": 1}, "zzz_made_up": 1},
    )
    assert pushed.status_code == 200
    assert pushed.json()["choices"][0]["text"] == _decode(http, target) != free
    metrics = http.get("/metrics").text
    assert 'pagefleet:ignored_request_fields_total{field="metadata",model_name="m"} 1.0' in metrics
    assert 'pagefleet:ignored_request_fields_total{field="other",model_name="m"} 1.0' in metrics
    assert "zzz_made_up" not in metrics  # an unknown name never becomes a label


def _decode(http, token: int) -> str:
    return http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]


def test_a_compiling_grammar_waits_without_blocking_other_requests(llm):
    engine, compiler = llm.engine, llm.engine.grammars.compiler
    release = threading.Event()
    real_compile = compiler._compile
    compiler._compile = lambda params: release.wait(30) and real_compile(params)
    try:
        choice = SamplingParams(structured_outputs=so(choice=("north", "south", "a-new-one")))
        engine.add_request("grammar", PROMPTS[0], choice)
        engine.add_request("free", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
        done = {}
        while "free" not in done:
            done |= {o.request_id: o for o in engine.step() if o.finished}
        assert "grammar" not in done and not engine.scheduler.requests.get("grammar")
    finally:
        release.set()
        compiler._compile = real_compile
    while "grammar" not in done:
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done["grammar"].outputs[0].text in ("north", "south", "a-new-one")


def test_pd_prefill_token_and_decode_are_both_constrained(tiny_checkpoints, llm, monkeypatch):
    """In-process P/D over the TCP connector: the prefill engine's one token obeys the grammar,
    the decode engine pulls the prompt's KV and enforces it from there; output equals
    colocated."""
    from server_utils import FLEET_SECRET, free_port

    monkeypatch.setenv("PAGEFLEET_FLEET_SECRET", FLEET_SECRET)

    def engine(role: str) -> LLM:
        config = {"kv_connector": "tcp", "kv_role": role, "kv_port": free_port()}
        return LLM(
            tiny_checkpoints["llama"],
            max_model_len=256,
            num_gpu_blocks_override=64,
            kv_transfer_config=json.dumps({**config, "kv_ip": "127.0.0.1"}),
        )

    choices = ("alpha", "beta", "gamma-ray")
    prompt = list(range(10, 60))
    constrained = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=so(choice=choices)
    )
    prefill, decode = engine("kv_producer"), engine("kv_consumer")
    try:
        hold = dataclasses.replace(
            constrained, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        (first,) = prefill.generate([prompt], hold, use_tqdm=False)
        assert any(c.startswith(first.outputs[0].text) for c in choices)
        pull = dataclasses.replace(constrained, kv_transfer_params=first.kv_transfer_params)
        (out,) = decode.generate([prompt], pull, use_tqdm=False)
        assert decode.engine.connector.stats.transfers == 1
        assert decode.engine.connector.stats.failures == 0
    finally:
        prefill.engine.close()
        decode.engine.close()
    (colocated,) = llm.generate([prompt], constrained, use_tqdm=False)
    assert out.outputs[0].text == colocated.outputs[0].text
    assert out.outputs[0].text in choices
