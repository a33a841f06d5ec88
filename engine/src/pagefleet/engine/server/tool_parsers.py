"""Model output -> OpenAI `tool_calls`: the Hermes and Llama 3 JSON formats, and the JSON that
`tool_choice: required` or a named function constrains the output to.

Every parser is a pure function of the text generated so far: `parse(text, final)` returns a
snapshot (content, calls) that only ever grows as text is appended: content and each call's
arguments extend what an earlier snapshot said, calls are only added, a call's name never
changes. Streaming sends the difference between successive snapshots (`ToolStream`), so the
deltas a client concatenates always equal the non-streaming answer for the same text.
Arguments are the model's own JSON text for the value (never re-serialized), which is what
makes them streamable as fragments. Text held back while it may still become a tag or a call
(a partial `<tool_call>`, a leading `{` whose name is not known yet) is released, as content
or call, once it is decided or the output ends.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes", "llama3_json")

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes writes the first, Llama 3 the second
_WS = " \t\n\r"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text as the model wrote it (a prefix of it while streaming)


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: tuple[ParsedCall, ...] = ()


Parser = Callable[[str, bool], ParsedOutput]


# ------------------------------------------------------------------ a partial JSON scanner


class _Invalid(Exception):
    """The text cannot be the JSON it should be (as opposed to not finished yet)."""


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
# Inside a container: strings, brackets, and runs of anything else.
_CONTAINER_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]|[^"{}\[\]]+', re.DOTALL)
_SCALAR = re.compile(r"[^,}\]\s]+")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at `i` ends, or None if the text ends first. Containers
    are matched by bracket depth; the inside is checked only as far as the caller needs."""
    first = text[i]
    if first == '"':
        m = _STRING.match(text, i)
        return m.end() if m else None
    if first in "{[":
        depth, pos = 0, i
        while pos < len(text):
            m = _CONTAINER_TOKEN.match(text, pos)
            if m is None:  # an unterminated string
                return None
            token = m.group()
            if token in "{[":
                depth += 1
            elif token in "}]":
                depth -= 1
                if depth == 0:
                    return m.end()
            pos = m.end()
        return None
    m = _SCALAR.match(text, i)
    if m is None:
        raise _Invalid(f"no JSON value at {i}")
    # A number or literal at the very end may still grow.
    return None if m.end() == len(text) else m.end()


@dataclass
class _ObjectScan:
    """What a (possibly unfinished) JSON object's top level says so far."""

    end: int | None = None  # index after the closing brace, once seen
    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # key -> value span


def _scan_object(text: str, i: int) -> _ObjectScan:
    """The keys and value spans of the object starting at text[i] == '{'; stops quietly where
    the text ends, raises _Invalid where it stops being an object."""
    scan = _ObjectScan()
    i = _skip_ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            raise _Invalid("object key expected")
        m = _STRING.match(text, i)
        if m is None:
            return scan
        key = json.loads(m.group())
        i = _skip_ws(text, m.end())
        if i >= len(text):
            return scan
        if text[i] != ":":
            raise _Invalid("':' expected")
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        end = _value_end(text, i)
        scan.fields.setdefault(key, (i, end))
        if end is None:
            return scan
        i = _skip_ws(text, end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            raise _Invalid("',' or '}' expected")
        i = _skip_ws(text, i + 1)
    return scan


def _call_of(text: str, scan: _ObjectScan, closed: bool) -> ParsedCall | None:
    """The call an object describes, once its name is known. Arguments: the value's text
    (while unfinished, what there is of it without trailing blanks, which may still be inside
    it); `{}` when the object (or its block) ended without any."""
    name_span = scan.fields.get("name")
    if name_span is None or name_span[1] is None:
        return None
    name = json.loads(text[name_span[0] : name_span[1]])
    if not isinstance(name, str):
        return None
    key = next((k for k in scan.fields if k in _ARGUMENT_KEYS), None)
    if key is None:
        arguments = "{}" if closed or scan.end is not None else ""
    else:
        start, end = scan.fields[key]
        arguments = text[start:end] if end is not None else text[start:].rstrip(_WS)
    return ParsedCall(name, arguments)


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text that may
    still turn into the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ------------------------------------------------------------------ the formats


def parse_hermes(text: str, final: bool) -> ParsedOutput:
    """`content <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...`. Content is the
    text before the first tag (as vLLM); a block without a name is no call; text between
    blocks is dropped."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        keep = len(text) if final else len(text) - _held_back(text, HERMES_OPEN)
        return ParsedOutput(text[:keep])
    calls: list[ParsedCall] = []
    pos = start
    while pos >= 0:
        body_start = pos + len(HERMES_OPEN)
        close = text.find(HERMES_CLOSE, body_start)
        closed = close >= 0 or final
        if close >= 0:
            body = text[body_start:close]
        else:
            body = text[body_start:]
            if not final:  # a partial closing tag is not part of the body
                body = body[: len(body) - _held_back(body, HERMES_CLOSE)]
        call = _object_call(body, closed)
        if call is not None:
            calls.append(call)
        if close < 0:
            break
        pos = text.find(HERMES_OPEN, close + len(HERMES_CLOSE))
    return ParsedOutput(text[:start], tuple(calls))


def _object_call(body: str, closed: bool) -> ParsedCall | None:
    i = _skip_ws(body, 0)
    if i >= len(body) or body[i] != "{":
        return None
    try:
        scan = _scan_object(body, i)
    except _Invalid:
        return None
    return _call_of(body, scan, closed)


def _call_sequence(
    text: str, i: int, separator: str, closer: str | None, final: bool
) -> tuple[list, bool]:
    """Objects from text[i:] separated by `separator` (and ended by `closer`, if any): the calls
    they make, and whether the first object is still undecided (unfinished and nameless)."""
    calls: list[ParsedCall] = []
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return calls, False
        if text[i] != "{":
            return calls, False  # not a call: the rest is dropped
        try:
            scan = _scan_object(text, i)
        except _Invalid:
            return calls, False
        call = _call_of(text, scan, final)
        if call is None:
            return calls, not calls and scan.end is None
        calls.append(call)
        if scan.end is None:
            return calls, False
        i = _skip_ws(text, scan.end)
        if i >= len(text) or (closer is not None and text[i] == closer):
            return calls, False
        if text[i] != separator:
            return calls, False
        i += 1


def parse_llama3_json(text: str, final: bool) -> ParsedOutput:
    """`<|python_tag|>{"name": ..., "parameters": {...}}; {...}` or the same without the tag.
    Output that does not start with the tag or `{`, or whose first object has no name, is
    content (decided once the first object ends)."""
    i = _skip_ws(text, 0)
    rest = text[i:]
    if not final and PYTHON_TAG.startswith(rest):
        return ParsedOutput("")  # may still become the tag
    if rest.startswith(PYTHON_TAG):
        i += len(PYTHON_TAG)
    elif not rest.startswith("{"):
        return ParsedOutput(text)
    calls, undecided = _call_sequence(text, i, ";", None, final)
    if calls:
        return ParsedOutput("", tuple(calls))
    return ParsedOutput("" if undecided and not final else text)


def parse_required(text: str, final: bool) -> ParsedOutput:
    """`tool_choice: required`: a JSON array of `{"name": ..., "parameters": {...}}` (what the
    structured-output schema from `required_schema` allows)."""
    i = _skip_ws(text, 0)
    if i >= len(text):
        return ParsedOutput("" if not final else text)
    if text[i] != "[":
        return ParsedOutput(text)
    calls, undecided = _call_sequence(text, i + 1, ",", "]", final)
    if calls:
        return ParsedOutput("", tuple(calls))
    return ParsedOutput("" if (undecided or not final) else text)


def named_parser(name: str) -> Parser:
    """A named function: the whole output is its arguments."""

    def parse(text: str, final: bool) -> ParsedOutput:
        arguments = text.strip(_WS) if final else text.lstrip(_WS).rstrip(_WS)
        return ParsedOutput("", (ParsedCall(name, arguments),))

    return parse


def auto_parser(name: str) -> Parser:
    """The parser `--tool-call-parser NAME` selects."""
    return {"hermes": parse_hermes, "llama3_json": parse_llama3_json}[name]


# ------------------------------------------------------------------ OpenAI shapes


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def message_fields(parsed: ParsedOutput, call_ids: list[str]) -> dict:
    """`content` and `tool_calls` of a non-streamed message; content is None when empty and
    calls were made, as OpenAI answers."""
    if not parsed.calls:
        return {"content": parsed.content}
    return {
        "content": parsed.content or None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call, call_id in zip(parsed.calls, call_ids, strict=True)
        ],
    }


def finish_reason(parsed: ParsedOutput, engine_reason: str | None, named: bool) -> str | None:
    """OpenAI's: `tool_calls` when the model stopped after calling (a named function answers
    `stop`, as OpenAI and vLLM do); `length` stays, the last call's arguments being cut."""
    if parsed.calls and engine_reason == "stop" and not named:
        return "tool_calls"
    return engine_reason


@dataclass
class ToolStream:
    """One choice's streaming state: what was sent of the snapshot so far."""

    parse: Parser
    content_sent: int = 0
    call_ids: list[str] = field(default_factory=list)
    arguments_sent: list[int] = field(default_factory=list)

    def delta(self, text: str, final: bool) -> tuple[dict, ParsedOutput]:
        """The chat delta (`content` and/or `tool_calls`) new since the last call, and the
        snapshot of `text` it brings the client to."""
        parsed = self.parse(text, final)
        delta: dict = {}
        if len(parsed.content) > self.content_sent:
            delta["content"] = parsed.content[self.content_sent :]
            self.content_sent = len(parsed.content)
        calls = []
        for index, call in enumerate(parsed.calls):
            item: dict = {"index": index}
            if index == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self.arguments_sent.append(0)
                item |= {"id": self.call_ids[index], "type": "function"}
                item["function"] = {"name": call.name, "arguments": ""}
            sent = self.arguments_sent[index]
            if len(call.arguments) > sent:
                item.setdefault("function", {})["arguments"] = call.arguments[sent:]
                self.arguments_sent[index] = len(call.arguments)
            if len(item) > 1:
                calls.append(item)
        if calls:
            delta["tool_calls"] = calls
        return delta, parsed


def at_most_one(parse: Parser) -> Parser:
    """`parallel_tool_calls: false`: the first call only."""

    def first(text: str, final: bool) -> ParsedOutput:
        parsed = parse(text, final)
        return ParsedOutput(parsed.content, parsed.calls[:1])

    return first


@dataclass(frozen=True)
class ToolCallConfig:
    """The server's flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


def choose_parser(
    tool_choice, has_tools: bool, parallel_tool_calls: bool, config: ToolCallConfig
) -> Parser | None:
    """How a request's output becomes tool calls (None: plain content). `tool_choice` is
    "none", "auto", "required" or a named choice (with `.function.name`). Raises ValueError
    for `auto` on a server without a parser, as vLLM does."""
    if not has_tools or tool_choice == "none":
        return None
    if tool_choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise ValueError(AUTO_NEEDS_FLAGS)
        parse = auto_parser(config.tool_call_parser)
    elif tool_choice == "required":
        parse = parse_required
    else:
        parse = named_parser(tool_choice.function.name)
    return parse if parallel_tool_calls else at_most_one(parse)
