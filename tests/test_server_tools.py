"""Tool calling through the OpenAI API, with the `openai` SDK.

Two halves: the app over a scripted engine (its output is the text a test chooses, so the
parsing, streaming and finish reasons of every tool choice are checked exactly, for both
parsers), and a real `pagefleet serve` on a tiny checkpoint served with a template that
renders tools (tools reach the prompt, a tool result goes back through the template, and
required/named choices always yield valid calls, which needs the grammar engine)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from tool_templates import TEMPLATES, tool_exchange

from pagefleet.engine.client import EngineLimits, EngineStats
from pagefleet.engine.outputs import CompletionOutput, RequestOutput
from pagefleet.engine.server.tool_parsers import ToolCallConfig
from pagefleet.engine.server.tools import Tool, required_schema
from pagefleet.engine.validation import RequestRules
from server_utils import running_router, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                # Enums and integers only: constrained sampling from a random model then ends
                # soon whatever string-length keywords the grammar engine supports.
                "city": {"type": "string", "enum": ["paris", "oslo", "rome"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"type": "integer"},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
USER = [{"role": "user", "content": "what is the weather in paris?"}]
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


# ------------------------------------------------------------------ a scripted engine


class _ScriptedEngine:
    """The EngineClient seam with output chosen by the test: choice i says texts[i], one
    character per step. Records the sampling params each request came with."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, texts
        self.limits = EngineLimits(RequestRules(4096, 16, 512, len(tokenizer)), 8, True, "float32")
        self.is_running, self.num_waiting_sequences = True, 0
        self.params, self.prompts = [], []

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, None)

    def subscribe(self, observer) -> None:
        pass

    def check_request(self, prompt, params) -> None:
        pass

    def abort(self, request_id) -> None:
        pass

    async def check_structured_outputs(self, constraint, tenant: str = "") -> None:
        """Where the grammar engine compiles a constraint before the request is submitted: here
        it must be a valid JSON schema."""
        jsonschema.Draft202012Validator.check_schema(json.loads(constraint.json))

    def generate(self, prompt, params, request_id):
        self.params.append(params)
        self.prompts.append(self.tokenizer.decode(prompt))
        return self._stream(prompt, params, request_id)

    async def _stream(self, prompt, params, request_id):
        texts = [self.texts[i % len(self.texts)] for i in range(params.n)]
        for end in range(1, max(map(len, texts)) + 1):
            await asyncio.sleep(0)
            outs = [
                CompletionOutput(
                    i,
                    t[:end],
                    [5] * min(end, len(t)),
                    finish_reason="stop" if end >= len(t) else None,
                )
                for i, t in enumerate(texts)
            ]
            done = all(o.finished for o in outs)
            yield RequestOutput(request_id, None, list(prompt), outs, finished=done)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    from pagefleet.common.tokenizer import load_tokenizer

    return load_tokenizer(tiny_checkpoints["qwen2"])


def _client(tokenizer, texts, parser="hermes", auto=True):
    """An OpenAI client over the app (in process) whose engine says `texts`."""
    from fastapi.testclient import TestClient

    from pagefleet.engine.server.app import ServerConfig, build_app

    engine = _ScriptedEngine(tokenizer, texts)
    config = ServerConfig(
        "tiny",
        tool_calls=ToolCallConfig(auto, parser if auto else None),
        chat_template=TEMPLATES[parser],
    )
    http = TestClient(build_app(engine, config))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http), engine


def _ask(client, stream: bool, **kwargs):
    """The choices' messages as (content, [(name, arguments)], finish_reason), assembled from
    the stream's deltas the way a client does when streaming."""
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, **kwargs}
    if not stream:
        out = client.chat.completions.create(**body)
        return [
            (
                c.message.content,
                [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()],
                c.finish_reason,
                [t.id for t in c.message.tool_calls or ()],
            )
            for c in sorted(out.choices, key=lambda c: c.index)
        ]
    choices: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            state = choices.setdefault(c.index, {"content": None, "calls": {}, "finish": None})
            if c.delta.content:
                state["content"] = (state["content"] or "") + c.delta.content
            for t in c.delta.tool_calls or ():
                if t.id:  # the call's first delta names it
                    assert t.index not in state["calls"] and t.function.name
                    state["calls"][t.index] = [t.function.name, t.function.arguments or "", t.id]
                else:
                    assert t.function.name is None
                    state["calls"][t.index][1] += t.function.arguments or ""
            state["finish"] = c.finish_reason or state["finish"]
    return [
        (
            s["content"],
            [(name, args) for name, args, _ in s["calls"].values()],
            s["finish"],
            [i for *_, i in s["calls"].values()],
        )
        for _, s in sorted(choices.items())
    ]


HERMES_OUT = (
    'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
LLAMA_OUT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": 2}}'
)
TWO_CALLS = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 1, "b": 2}')]


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [("hermes", HERMES_OUT, "Checking."), ("llama3_json", LLAMA_OUT, None)],
)
@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed(tokenizer, parser, text, content, stream):
    client, engine = _client(tokenizer, [text, "no call here"], parser)
    first, second = _ask(client, stream, n=2)
    # The tools went through the format's template into the prompt.
    marker = {"hermes": "<tools>", "llama3_json": "Environment: ipython"}[parser]
    assert marker in engine.prompts[0] and '"name": "get_weather"' in engine.prompts[0]
    assert first[:3] == (content, TWO_CALLS, "tool_calls")
    assert all(i.startswith("call_") for i in first[3]) and len(set(first[3])) == 2
    assert second[:3] == ("no call here", [], "stop")  # each choice parsed on its own


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer, stream):
    client, _ = _client(tokenizer, [HERMES_OUT])
    ((_, calls, _, _),) = _ask(client, stream, parallel_tool_calls=False)
    assert calls == TWO_CALLS[:1]


@pytest.mark.parametrize("stream", [False, True])
def test_required_constrains_and_parses_an_array_of_calls(tokenizer, stream):
    text = json.dumps([{"name": "add", "parameters": {"a": 1, "b": 2}}])
    client, engine = _client(tokenizer, [text], auto=False)  # needs no flag
    ((content, calls, finish, _),) = _ask(client, stream, tool_choice="required")
    assert (content, calls, finish) == (None, [("add", '{"a": 1, "b": 2}')], "tool_calls")
    schema = json.loads(engine.params[0].structured_outputs.json)
    assert schema == required_schema([Tool(**t) for t in TOOLS])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_constrains_the_output_to_its_arguments(tokenizer, stream):
    client, engine = _client(tokenizer, ['{"a": 4, "b": 5}'], auto=False)
    ((content, calls, finish, _),) = _ask(client, stream, tool_choice=NAMED_ADD)
    assert (content, calls, finish) == (None, [("add", '{"a": 4, "b": 5}')], "stop")
    assert json.loads(engine.params[0].structured_outputs.json) == ADD["function"]["parameters"]


def test_auto_without_the_flags_is_refused_as_vllm_does(tokenizer):
    client, engine = _client(tokenizer, ["x"], auto=False)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
    # none: the tools are rendered, the output is plain content
    out = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="none"
    )
    assert out.choices[0].message.content == "x" and not out.choices[0].message.tool_calls
    assert engine.params[0].structured_outputs is None


def test_hostile_tool_bodies_are_400s(tokenizer):
    """A schema nested 100k deep (the JSON parser's bound) or too big in all (ours)."""
    client, _ = _client(tokenizer, ["x"], auto=False)
    http = client._client
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000
    body = (
        '{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": '
        '[{"type": "function", "function": {"name": "f", "parameters": ' + deep + "}}]}"
    )
    r = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    wide = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "d" * 100} for i in range(4000)},
    }
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": wide}}],
        },
    )
    assert r.status_code == 400 and "at most 524288" in r.json()["error"]["message"]


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    """One server (each costs seconds of CI time): the parser only matters for "auto", which
    the scripted half covers for both formats, templates included."""
    template = tmp_path_factory.mktemp("templates") / "hermes.jinja"
    template.write_text(TEMPLATES["hermes"])
    with running_server(
        tiny_checkpoints["qwen2"],
        "--max-model-len",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--chat-template",
        str(template),
    ) as (base, _):
        yield base


def _tokenized_prompt(base: str, body: dict) -> str:
    import httpx

    ids = httpx.post(f"{base}/tokenize", json=body, timeout=30).json()["tokens"]
    return httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]


def test_tools_and_tool_results_reach_the_template(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x")
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    with_tools = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert "get_weather" in _tokenized_prompt(server, {"messages": USER, "tools": TOOLS})
    conversation = [*USER, *tool_exchange("sunny and 21 degrees")]
    answer = client.chat.completions.create(
        model="tiny", messages=conversation, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = _tokenized_prompt(server, {"messages": conversation, "tools": TOOLS})
    # The call's arguments rendered as an object (not a JSON string), and the result.
    assert '"arguments": {"city": "Paris"}' in prompt
    assert "sunny and 21 degrees" in prompt


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_always_yield_valid_calls(server, choice, stream):
    """Needs the grammar engine (issue 24's structured outputs): a random model's free output
    is noise; constrained, every call names a tool and its arguments validate."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x")
    tool_choice = "required" if choice == "required" else NAMED_ADD
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    # One call at most under required (maxItems 1), so that the output stays short.
    choices = _ask(
        client,
        stream,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        n=3,
        seed=0,
        temperature=1.0,
        max_tokens=200,
    )
    assert len(choices) == 3
    for _, calls, finish, _ in choices:
        assert finish in ("tool_calls", "stop"), finish  # never cut off mid-call here
        assert len(calls) == 1
        for name, arguments in calls:
            assert choice == "required" or name == "add"
            jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_gets_valid_calls_and_json_through_the_router(server, tiny_checkpoints, stream):
    """What an agent framework does, through `pagefleet router` (with its tokenizer, so the
    router renders the tools for its prefix hashes): a named tool call whose arguments
    validate, then a json_schema answer that parses and validates."""
    with running_router("--endpoints", server, "--tokenizer", tiny_checkpoints["qwen2"]) as (
        router,
        _,
    ):
        client = openai.OpenAI(base_url=f"{router}/v1", api_key="x")
        [(_, calls, finish, _)] = _ask(
            client, stream, tool_choice=NAMED_ADD, seed=1, temperature=1.0, max_tokens=200
        )
        assert finish == "stop" and [name for name, _ in calls] == ["add"]
        jsonschema.validate(json.loads(calls[0][1]), ADD["function"]["parameters"])
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2]}},
            "required": ["city", "days"],
        }
        format_ = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema}}
        body = dict(model="tiny", messages=USER, response_format=format_, max_tokens=200, seed=2)
        if stream:
            chunks = client.chat.completions.create(**body, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**body).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)


def test_serve_flags_have_vllms_names():
    from pagefleet.common.cli import build_parser
    from pagefleet.engine.server.serve import tool_call_config

    def config(*flags):
        return tool_call_config(build_parser().parse_args(["serve", "m", *flags]))

    assert config() == ToolCallConfig()
    assert config("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json") == (
        ToolCallConfig(True, "llama3_json")
    )
    # The operator's engineArgs pass bools as --x / --no-x.
    assert config("--no-enable-auto-tool-choice", "--exclude-tools-when-tool-choice-none") == (
        ToolCallConfig(False, None, True)
    )
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        config("--enable-auto-tool-choice")
    with pytest.raises(SystemExit):
        config("--tool-call-parser", "mistral")


def test_a_multi_turn_exchange_with_the_sdks_own_message_objects(tokenizer):
    """The agent loop: the SDK's returned message goes back as is, then the tool's result."""
    client, engine = _client(tokenizer, [HERMES_OUT])
    messages = list(USER)
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    messages.append(message)
    for call in message.tool_calls:
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name}: ok"}
        )
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert second.choices[0].message.tool_calls  # the scripted engine repeats itself
    prompt = engine.prompts[1]
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in prompt
    assert "<tool_response>\nget_weather: ok\n</tool_response>" in prompt
