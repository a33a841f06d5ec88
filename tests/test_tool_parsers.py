"""Tool calling without a server: parsing model output into calls (whole and streamed), the
schemas that required/named tool choices constrain output to, and request validation."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError
from tool_templates import tool_exchange

from pagefleet.engine.server.protocol import ChatCompletionRequest
from pagefleet.engine.server.tool_parsers import (
    AUTO_NEEDS_FLAGS,
    ParsedCall,
    ParsedOutput,
    ToolCallConfig,
    ToolStream,
    choose_parser,
    finish_reason,
    message_fields,
    named_parser,
    parse_hermes,
    parse_llama3_json,
    parse_required,
)
from pagefleet.engine.server.tools import Tool, named_schema, required_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/num"}},
            "required": ["a", "b"],
            "$defs": {"num": {"type": "number"}},
        },
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}


def call(name, arguments):
    return ParsedCall(name, arguments)


HERMES_CASES = [
    ("plain text, no calls", ParsedOutput("plain text, no calls")),
    ("a < b <tool", ParsedOutput("a < b <tool")),
    (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        ParsedOutput("Let me look.\n", (call("get_weather", '{"city": "Paris"}'),)),
    ),
    (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2.5}}</tool_call>\n'
        '<tool_call>{"arguments": {"s": "x}<\\/y"}, "name": "echo"}</tool_call>',
        ParsedOutput(
            "",
            (call("add", '{"a": 1, "b": 2.5}'), call("echo", '{"s": "x}<\\/y"}')),
        ),
    ),
    ('<tool_call>{"name": "now"}</tool_call>', ParsedOutput("", (call("now", "{}"),))),
    ("<tool_call>not json</tool_call>", ParsedOutput("")),
    (  # cut by max_tokens: the call, with what there is of its arguments
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
        ParsedOutput("", (call("get_weather", '{"city": "Pa'),)),
    ),
    ('<tool_call>{"name": "f", "arguments": 12}</tool_call>', ParsedOutput("", (call("f", "12"),))),
    # Bad escapes in a name or key: no call (not a server error).
    ('<tool_call>{"name": "\\q"}</tool_call><tool_call>{"\\q": 1}</tool_call>', ParsedOutput("")),
]

LLAMA_CASES = [
    ("The answer is 4.", ParsedOutput("The answer is 4.")),
    (
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
        ParsedOutput("", (call("get_weather", '{"city": "Oslo", "unit": "c"}'),)),
    ),
    (
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "now", "parameters": {}}',
        ParsedOutput("", (call("add", '{"a": 1, "b": 2}'), call("now", "{}"))),
    ),
    ('{"answer": 4, "why": "{"}', ParsedOutput('{"answer": 4, "why": "{"}')),
    ('  {"name": "now", "arguments": {}}', ParsedOutput("", (call("now", "{}"),))),
    ("<|python", ParsedOutput("<|python")),
    ('{"name": "now"', ParsedOutput("", (call("now", "{}"),))),
]

REQUIRED_CASES = [
    (
        '[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
        '{"name": "add", "parameters": {"a": 1, "b": 2}}]',
        ParsedOutput(
            "", (call("get_weather", '{"city": "Rome"}'), call("add", '{"a": 1, "b": 2}'))
        ),
    ),
    ('[ {"parameters": {}, "name": "now"} ]', ParsedOutput("", (call("now", "{}"),))),
    ("no array", ParsedOutput("no array")),
]


@pytest.mark.parametrize(("text", "expected"), HERMES_CASES)
def test_hermes(text, expected):
    assert parse_hermes(text, True) == expected


@pytest.mark.parametrize(("text", "expected"), LLAMA_CASES)
def test_llama3_json(text, expected):
    assert parse_llama3_json(text, True) == expected


@pytest.mark.parametrize(("text", "expected"), REQUIRED_CASES)
def test_required(text, expected):
    assert parse_required(text, True) == expected


def test_named_function_output_is_the_arguments():
    assert named_parser("add")(' {"a": 1, "b": 2}\n', True) == ParsedOutput(
        "", (call("add", '{"a": 1, "b": 2}'),)
    )


def _streamed(parse, text: str, cuts: list[int], stream: ToolStream | None = None) -> dict:
    """What a client assembles from the deltas of `text` arriving in pieces cut at `cuts`."""
    stream = stream or ToolStream(parse)
    content, calls = "", {}
    bounds = [0, *cuts, len(text)]
    for i, end in enumerate(bounds[1:]):
        delta = stream.delta(text[:end], final=i == len(bounds) - 2)
        content += delta.get("content", "")
        for item in delta.get("tool_calls", []):
            if "id" in item:  # a call's first delta: id and name before any argument
                assert item["index"] == len(calls) and item["function"]["name"]
                calls[item["index"]] = {"id": item["id"], **item["function"]}
            else:
                calls[item["index"]]["arguments"] += item["function"]["arguments"]
    return {"content": content, "calls": [(c["name"], c["arguments"]) for c in calls.values()]}


ALL_CASES = [
    *((parse_hermes, t) for t, _ in HERMES_CASES),
    *((parse_llama3_json, t) for t, _ in LLAMA_CASES),
    *((parse_required, t) for t, _ in REQUIRED_CASES),
    (named_parser("add"), ' {"a": 1, "b": 2}\n'),
]


@pytest.mark.parametrize(("parse", "text"), ALL_CASES)
def test_streamed_deltas_add_up_to_the_whole_answer_at_every_split(parse, text):
    whole = parse(text, True)
    expected = {"content": whole.content, "calls": [(c.name, c.arguments) for c in whole.calls]}
    # One character at a time, and every single split point.
    assert _streamed(parse, text, list(range(1, len(text)))) == expected
    for cut in range(len(text) + 1):
        assert _streamed(parse, text, [cut]) == expected


_LONG = 20_000
_ARGS = json.dumps({"text": 'line "q"\n' * (_LONG // 12), "xs": [[1, 2]] * 10})
_SMALL = '{"name": "f", "parameters": {"a": 1}}'


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (
            parse_hermes,
            f'Sure.{" " * 500}<tool_call>\n{{"name": "write", "arguments": {_ARGS}}}\n</tool_call>',
        ),
        (parse_hermes, "<tool_call>" + "</tool_call>\n<tool_call>".join([_SMALL] * 500) + "<"),
        (parse_hermes, "a < b <tool " * (_LONG // 12)),
        (parse_hermes, '<tool_call>{"name": "f", "arguments": {"a": ' + " " * _LONG + "1}}"),
        (parse_llama3_json, f'<|python_tag|>{{"name": "write", "parameters": {_ARGS}}}'),
        (parse_llama3_json, "; ".join([_SMALL] * 500)),
        (parse_required, "[" + ", ".join([_SMALL] * 500) + "]"),
        (named_parser("write"), _ARGS + " " * 2000),
    ],
)
def test_streaming_reads_each_character_a_bounded_number_of_times(parse, text):
    """A long output streamed 4 characters a chunk: each chunk reads the text appended since
    the last (plus a tag's length of lookback), not the whole output again, which would read
    a 20k-character output ~2500 times over and burn the server's event loop."""
    stream = ToolStream(parse)
    whole = parse(text, True)
    expected = {"content": whole.content, "calls": [(c.name, c.arguments) for c in whole.calls]}
    assert _streamed(parse, text, list(range(4, len(text), 4)), stream) == expected
    assert stream.scanner.meter.chars <= 8 * len(text)


def test_tags_never_leak_into_content_while_streaming():
    text = 'Sure.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    stream, content = ToolStream(parse_hermes), ""
    for end in range(1, len(text) + 1):
        delta = stream.delta(text[:end], final=False)
        content += delta.get("content", "")
        assert "<" not in content
    assert content == "Sure."


def test_message_and_finish_reason_shapes():
    parsed = parse_hermes('<tool_call>{"name": "now", "arguments": {}}</tool_call>', True)
    fields = message_fields(parsed, ["call_1"])
    assert fields == {
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        ],
    }
    assert finish_reason(parsed, "stop", named=False) == "tool_calls"
    assert finish_reason(parsed, "stop", named=True) == "stop"  # OpenAI's, for a named choice
    assert finish_reason(parsed, "length", named=False) == "length"
    assert message_fields(ParsedOutput("hi"), []) == {"content": "hi"}


def test_auto_needs_the_flags_required_and_named_do_not():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        choose_parser("auto", True, True, ToolCallConfig())
    assert AUTO_NEEDS_FLAGS.startswith('"auto" tool choice requires')
    assert choose_parser("required", True, True, ToolCallConfig()) is parse_required
    assert choose_parser("none", True, True, ToolCallConfig(True, "hermes")) is None
    auto = ToolCallConfig(True, "llama3_json")
    assert choose_parser("auto", True, True, auto) is parse_llama3_json
    one = choose_parser("auto", True, False, auto)  # parallel_tool_calls: false
    assert one('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}', True).calls == (
        call("a", "{}"),
    )


# ------------------------------------------------------------------ constrained schemas


def test_required_schema_accepts_exactly_calls_of_declared_tools():
    tools = [Tool(**t) for t in (WEATHER, ADD, NO_PARAMS)]
    schema = required_schema(tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = jsonschema.Draft202012Validator(schema)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [{"name": "add", "parameters": {"a": 1, "b": 2.5}}, {"name": "now", "parameters": {}}],
    ]
    bad = [
        [],
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "add", "parameters": {"a": 1, "b": "x"}}],  # $defs/num is a number
        [{"name": "nope", "parameters": {}}],
        [{"name": "now"}],
        [{"name": "now", "parameters": {}, "extra": "x"}],
        {"name": "now", "parameters": {}},
    ]
    assert all(valid.is_valid(g) for g in good)
    assert not any(valid.is_valid(b) for b in bad)
    # The parser turns what the schema allows into the calls it describes.
    text = json.dumps(good[1])
    assert [c.name for c in parse_required(text, True).calls] == ["add", "now"]
    one = jsonschema.Draft202012Validator(required_schema(tools, parallel_tool_calls=False))
    assert one.is_valid(good[0]) and not one.is_valid(good[1])
    assert "$defs" in ADD["function"]["parameters"]  # the request's tools are left as sent


def test_required_schema_refuses_clashing_defs():
    other = json.loads(json.dumps(ADD))
    other["function"]["name"] = "add2"
    other["function"]["parameters"]["$defs"]["num"] = {"type": "string"}
    with pytest.raises(ValueError, match=r"\$defs/num"):
        required_schema([Tool(**ADD), Tool(**other)])


def test_named_schema_is_the_function_parameters():
    tools = [Tool(**t) for t in (WEATHER, NO_PARAMS)]
    valid = jsonschema.Draft202012Validator(named_schema(tools, "get_weather"))
    assert valid.is_valid({"city": "Paris", "unit": "c"}) and not valid.is_valid({"unit": "c"})
    assert named_schema(tools, "now") == {"type": "object", "properties": {}}


def _chat(**fields):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_required_and_named_choices_set_the_structured_output():
    req = _chat(tools=[WEATHER, ADD], tool_choice="required")
    params = req.sampling_params(16, None)
    schema = json.loads(params.structured_outputs.json)
    assert schema == required_schema(req.tools)
    req = _chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    assert json.loads(req.sampling_params(16, None).structured_outputs.json)["required"] == [
        "a",
        "b",
    ]
    assert _chat(tools=[WEATHER]).tool_choice == "auto"
    assert _chat(tools=[WEATHER]).sampling_params(16, None).structured_outputs is None
    assert _chat().tool_choice == "none"
    assert _chat(tools=[], tool_choice="required").tool_choice == "none"


# ------------------------------------------------------------------ hostile requests

_DEEP: dict = {"type": "object"}
for _ in range(40):
    _DEEP = {"type": "object", "properties": {"x": _DEEP}}


def _tool(name="f", parameters=None, **extra):
    function = {"name": name, **({"parameters": parameters} if parameters is not None else {})}
    return {"type": "function", "function": function, **extra}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [_tool("bad name!")]}, "pattern"),
        ({"tools": [_tool("x" * 65)]}, "pattern"),
        ({"tools": [_tool(f"t{i}") for i in range(129)]}, "at most 128 tools"),
        ({"tools": [_tool(), _tool()]}, "unique"),
        ({"tools": [_tool(parameters=_DEEP)]}, "deeper"),
        ({"tools": [_tool(parameters={"description": "x" * (600 << 10)})]}, "bytes"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "function"),
        ({"tools": [_tool(parameters=[1, 2])]}, "dict"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": "sometimes", "tools": [_tool()]}, "tool_choice"),
        (
            {"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "not one of the tools",
        ),
        ({"functions": [{"name": "f"}]}, "functions is not supported"),
    ],
)
def test_hostile_tools_are_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        _chat(**fields)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            "only assistant",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
                ],
            },
            "JSON text of an object",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}
                ],
            },
            "JSON text of an object",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": str(i), "function": {"name": "f", "arguments": "{}"}} for i in range(129)
                ],
            },
            "at most 128",
        ),
        ({"role": "tool", "tool_call_id": "x" * 257, "content": "r"}, "at most 256"),
    ],
)
def test_hostile_tool_messages_are_refused(message, error):
    with pytest.raises(ValidationError, match=error):
        ChatCompletionRequest(messages=[message])


def test_tool_messages_reach_the_template_with_arguments_as_objects():
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "weather?"}, *tool_exchange("22C")]
    )
    assistant, tool = (m.for_template() for m in req.messages[1:])
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tool == {"role": "tool", "content": "22C", "tool_call_id": "call_1"}
