"""Model output -> OpenAI `tool_calls`: the Hermes and Llama 3 JSON formats, and the JSON that
`tool_choice: required` or a named function constrains the output to.

A parser reads the text generated so far into a snapshot (content, calls) that only ever grows
as text is appended: content and each call's arguments extend what an earlier snapshot said,
calls are only added, a call's name never changes. Streaming sends the difference between
successive snapshots (`ToolStream`), so the deltas a client concatenates always equal the
non-streaming answer for the same text. Arguments are the model's own JSON text for the value
(never re-serialized), which is what makes them streamable as fragments. Text held back while
it may still become a tag or a call (a partial `<tool_call>`, a leading `{` whose name is not
known yet) is released, as content or call, once it is decided or the output ends.

Each format is a resumable scanner: it keeps what it settled (finished calls, where the open
call's JSON stands) and reads only the text appended since, so streaming a long output costs
time linear in its length, not quadratic (every chunk re-parsing everything). Parsing a whole
text is the same scanner fed once.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

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


@dataclass
class _Meter:
    """Characters the scanners looked at: what tests bound to prove the work is linear."""

    chars: int = 0


@dataclass(frozen=True)
class _CallSpan:
    """A call as positions in the text: its arguments are text[start:end], or `literal` (`{}`
    for a call that ended without arguments)."""

    name: str
    start: int = 0
    end: int = 0
    literal: str | None = None

    def size(self) -> int:
        return len(self.literal) if self.literal is not None else self.end - self.start

    def arguments(self, text: str, sent: int = 0) -> str:
        """The arguments after the first `sent` characters."""
        if self.literal is not None:
            return self.literal[sent:]
        return text[self.start + sent : self.end]


class _Scanner(Protocol):
    """One output's parse state. After `update(text, final)`: content is text[:content_end];
    the calls are `settled` (finished: never change again, only appended to) then `current`
    (the call still being written, if any)."""

    content_end: int
    settled: list[_CallSpan]
    current: _CallSpan | None
    meter: _Meter

    def update(self, text: str, final: bool) -> None: ...


# ------------------------------------------------------------------ a resumable JSON scanner


class _Invalid(Exception):
    """The text cannot be the JSON it should be (as opposed to not finished yet)."""


_WS_RUN = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\]*')
_PLAIN_RUN = re.compile(r'[^"{}\[\]]*')  # inside a container, between strings and brackets
_SCALAR_RUN = re.compile(r"[^,}\]\s]*")


def _skip_ws(text: str, i: int, limit: int, meter: _Meter) -> int:
    end = _WS_RUN.match(text, i, limit).end()
    meter.chars += end - i + 1
    return end


def _find(text: str, tag: str, start: int, meter: _Meter) -> int:
    meter.chars += max(len(text) - start, 0)
    return text.find(tag, start)


def _held_back(text: str, end: int, floor: int, tag: str) -> int:
    """Length of the longest suffix of text[floor:end] that is a proper prefix of `tag` (text
    that may still turn into the tag)."""
    tail = text[max(floor, end - len(tag) + 1) : end]
    for n in range(len(tail), 0, -1):
        if tail.endswith(tag[:n]):
            return n
    return 0


@dataclass
class _Trim:
    """Where text[start:limit] ends without trailing blanks, as `limit` grows."""

    start: int
    meter: _Meter
    scanned: int = -1
    end: int = -1

    def update(self, text: str, limit: int) -> int:
        if self.scanned < 0:
            self.scanned = self.end = self.start
        if limit > self.scanned:
            kept = text[self.scanned : limit].rstrip(_WS)
            self.meter.chars += limit - self.scanned
            if kept:
                self.end = self.scanned + len(kept)
            self.scanned = limit
        return self.end


@dataclass
class _ValueScan:
    """The JSON value starting at text[start] (not a blank), read as far as the text goes and
    resumed there. Containers are matched by bracket depth; their inside is not checked."""

    start: int
    meter: _Meter
    pos: int = -1
    depth: int = 0
    in_string: bool = False
    scalar: bool = False
    end: int | None = None

    def advance(self, text: str, limit: int) -> int | None:
        """Where the value ends, or None if text[:limit] ends first."""
        if self.end is not None:
            return self.end
        if self.pos < 0:
            first = text[self.start]
            self.pos = self.start + 1
            if first == '"':
                self.in_string = True
            elif first in "{[":
                self.depth = 1
            elif first in ",}]":
                raise _Invalid(f"no JSON value at {self.start}")
            else:
                self.scalar, self.pos = True, self.start
        if self.scalar:
            self.pos = self._run(_SCALAR_RUN, text, limit)
            if self.pos == self.start:
                raise _Invalid(f"no JSON value at {self.start}")
            # A number or literal at the very end may still grow.
            self.end = self.pos if self.pos < limit else None
            return self.end
        while self.pos < limit:
            if self.in_string:
                self.pos = self._run(_STRING_RUN, text, limit)
                if self.pos >= limit:
                    break
                if text[self.pos] == "\\":
                    if self.pos + 1 >= limit:  # the escaped character is not here yet
                        break
                    self.pos += 2
                    continue
                self.pos += 1
                self.in_string = False
                if self.depth == 0:
                    self.end = self.pos
                    return self.end
                continue
            self.pos = self._run(_PLAIN_RUN, text, limit)
            if self.pos >= limit:
                break
            char = text[self.pos]
            self.pos += 1
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
                    return self.end
        return None

    def _run(self, pattern: re.Pattern, text: str, limit: int) -> int:
        end = pattern.match(text, self.pos, limit).end()
        self.meter.chars += end - self.pos + 1
        return end


_NO_NAME = object()


@dataclass
class _ObjectScan:
    """A (possibly unfinished) JSON object's top level from text[start] == '{', resumed where
    the text ended: the first `name` value and the first arguments value (their own scanners),
    and its end once seen. `advance` raises _Invalid where the text stops being an object."""

    start: int
    meter: _Meter
    pos: int = -1
    state: str = "first"  # first, key, in_key, colon, value, in_value, after
    part: _ValueScan | None = None  # the key or value being read
    key: str = ""
    name: _ValueScan | None = None
    arguments: _ValueScan | None = None
    end: int | None = None
    _name: object = None
    _trim: _Trim | None = None

    def advance(self, text: str, limit: int) -> None:
        if self.pos < 0:
            self.pos = self.start + 1
        while self.end is None:
            if self.state in ("in_key", "in_value"):
                assert self.part is not None
                end = self.part.advance(text, limit)
                if end is None:
                    return
                if self.state == "in_key":
                    self.key = _json_string(text[self.part.start : end])
                self.pos, self.state = end, "colon" if self.state == "in_key" else "after"
                continue
            self.pos = _skip_ws(text, self.pos, limit, self.meter)
            if self.pos >= limit:
                return
            char = text[self.pos]
            if self.state == "first" and char == "}":
                self.end = self.pos + 1
            elif self.state in ("first", "key"):
                if char != '"':
                    raise _Invalid("object key expected")
                self.part, self.state = _ValueScan(self.pos, self.meter), "in_key"
            elif self.state == "colon":
                if char != ":":
                    raise _Invalid("':' expected")
                self.pos, self.state = self.pos + 1, "value"
            elif self.state == "value":
                self.part, self.state = _ValueScan(self.pos, self.meter), "in_value"
                if self.key == "name" and self.name is None:
                    self.name = self.part
                elif self.key in _ARGUMENT_KEYS and self.arguments is None:
                    self.arguments = self.part
            elif char == "}":
                self.end = self.pos + 1
            elif char == ",":
                self.pos, self.state = self.pos + 1, "key"
            else:
                raise _Invalid("',' or '}' expected")

    def call(self, text: str, limit: int, closed: bool) -> _CallSpan | None:
        """The call the object describes, once its name is known. Arguments: the value's text
        (while unfinished, what there is of it without trailing blanks, which may still be
        inside it); `{}` when the object (or its block) ended without any."""
        if self.name is None or self.name.end is None:
            return None
        if self._name is None:
            self._name = _name_of(text[self.name.start : self.name.end])
        if not isinstance(self._name, str):
            return None
        if self.arguments is None:
            return _CallSpan(self._name, literal="{}" if closed or self.end is not None else "")
        start, end = self.arguments.start, self.arguments.end
        if end is None:
            if self._trim is None:
                self._trim = _Trim(start, self.meter)
            end = self._trim.update(text, limit)
        return _CallSpan(self._name, start, end)


def _json_string(token: str) -> str:
    try:
        return json.loads(token)
    except ValueError:  # a bad escape
        raise _Invalid("bad string") from None


def _name_of(token: str) -> object:
    try:
        return json.loads(token)
    except ValueError:
        return _NO_NAME


# ------------------------------------------------------------------ the formats


@dataclass
class _HermesBlock:
    """An open `<tool_call>` block: its body from `body_start`."""

    body_start: int
    meter: _Meter
    close_from: int = -1  # where the closing tag may start (earlier text was searched)
    pos: int = -1  # past the blanks before the body's object
    obj: _ObjectScan | None = None
    dead: bool = False  # not an object: no call

    def call(self, text: str, limit: int, closed: bool) -> _CallSpan | None:
        if self.dead:
            return None
        try:
            if self.obj is None:
                self.pos = _skip_ws(text, max(self.pos, self.body_start), limit, self.meter)
                if self.pos >= limit:
                    return None
                if text[self.pos] != "{":
                    raise _Invalid("not an object")
                self.obj = _ObjectScan(self.pos, self.meter)
            self.obj.advance(text, limit)
        except _Invalid:
            self.dead = True
            return None
        return self.obj.call(text, limit, closed)


@dataclass
class _HermesScan:
    """`content <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...`. Content is the
    text before the first tag (as vLLM); a block without a name is no call; text between
    blocks is dropped."""

    meter: _Meter = field(default_factory=_Meter)
    content_end: int = 0
    settled: list[_CallSpan] = field(default_factory=list)
    current: _CallSpan | None = None
    tagged: bool = False  # the first tag was seen: content is decided
    search_from: int = 0  # where the next opening tag may start
    block: _HermesBlock | None = None

    def update(self, text: str, final: bool) -> None:
        n = len(text)
        while True:
            if self.block is None:
                self.current = None
                start = _find(text, HERMES_OPEN, self.search_from, self.meter)
                if start < 0:
                    self.search_from = max(self.search_from, n - len(HERMES_OPEN) + 1)
                    if not self.tagged:
                        held = 0 if final else _held_back(text, n, 0, HERMES_OPEN)
                        self.content_end = n - held
                    return
                if not self.tagged:
                    self.tagged, self.content_end = True, start
                body = start + len(HERMES_OPEN)
                self.block = _HermesBlock(body, self.meter, close_from=body)
            block = self.block
            close = _find(text, HERMES_CLOSE, block.close_from, self.meter)
            if close < 0:
                block.close_from = max(block.close_from, n - len(HERMES_CLOSE) + 1)
                # A partial closing tag is not part of the body.
                held = 0 if final else _held_back(text, n, block.body_start, HERMES_CLOSE)
                self.current = block.call(text, n - held, final)
                return
            call = block.call(text, close, True)
            if call is not None:
                self.settled.append(call)
            self.block, self.search_from = None, close + len(HERMES_CLOSE)


@dataclass
class _CallSequence:
    """Objects from `pos` separated by `separator` (and ended by `closer`, if any): the calls
    they make (`settled`, `current`), and whether the first object is still undecided
    (unfinished and nameless). Anything else ends the sequence."""

    pos: int
    separator: str
    closer: str | None
    meter: _Meter
    settled: list[_CallSpan] = field(default_factory=list)
    current: _CallSpan | None = None
    undecided: bool = False
    obj: _ObjectScan | None = None
    after_object: bool = False
    stopped: bool = False

    def update(self, text: str, final: bool) -> None:
        n = len(text)
        self.current, self.undecided = None, False
        while not self.stopped:
            if self.obj is None:
                self.pos = _skip_ws(text, self.pos, n, self.meter)
                if self.pos >= n:
                    return
                char = text[self.pos]
                if self.after_object:
                    # The closer, or anything but the separator, ends the sequence.
                    self.stopped = char != self.separator
                    self.pos, self.after_object = self.pos + 1, False
                    continue
                if char != "{":
                    self.stopped = True  # not a call: the rest is dropped
                    return
                self.obj = _ObjectScan(self.pos, self.meter)
            try:
                self.obj.advance(text, n)
            except _Invalid:
                self.stopped = True
                return
            call = self.obj.call(text, n, final)
            if call is None:
                self.stopped = self.obj.end is not None
                self.undecided = not self.settled and not self.stopped
                return
            if self.obj.end is None:
                self.current = call
                return
            self.settled.append(call)
            self.pos, self.obj, self.after_object = self.obj.end, None, True


@dataclass
class _JsonCallsScan:
    """Output that is calls if it opens with `opener` (after blanks), otherwise content; the
    calls' share of the snapshot comes from a _CallSequence."""

    meter: _Meter = field(default_factory=_Meter)
    content_end: int = 0
    settled: list[_CallSpan] = field(default_factory=list)
    current: _CallSpan | None = None
    ws_end: int = 0
    is_content: bool = False
    sequence: _CallSequence | None = None

    def _open(self, text: str, final: bool) -> bool:
        """Decide content or calls (setting is_content or sequence); False: not yet."""
        raise NotImplementedError

    def update(self, text: str, final: bool) -> None:
        n = len(text)
        if not self.is_content and self.sequence is None:
            self.ws_end = _skip_ws(text, self.ws_end, n, self.meter)
            if not self._open(text, final):
                self.content_end = 0
                return
        if self.is_content:
            self.content_end = n
            return
        assert self.sequence is not None
        self.sequence.update(text, final)
        self.settled, self.current = self.sequence.settled, self.sequence.current
        if self.settled or self.current:
            self.content_end = 0
        else:
            self.content_end = 0 if self._held(final) else n

    def _held(self, final: bool) -> bool:
        raise NotImplementedError


@dataclass
class _Llama3Scan(_JsonCallsScan):
    """`<|python_tag|>{"name": ..., "parameters": {...}}; {...}` or the same without the tag.
    Output that does not start with the tag or `{`, or whose first object has no name, is
    content (decided once the first object ends)."""

    def _open(self, text: str, final: bool) -> bool:
        i = self.ws_end
        head = text[i : i + len(PYTHON_TAG) + 1]
        if not final and len(head) <= len(PYTHON_TAG) and PYTHON_TAG.startswith(head):
            return False  # may still become the tag
        if head.startswith(PYTHON_TAG):
            self.sequence = _CallSequence(i + len(PYTHON_TAG), ";", None, self.meter)
        elif head.startswith("{"):
            self.sequence = _CallSequence(i, ";", None, self.meter)
        else:
            self.is_content = True
        return True

    def _held(self, final: bool) -> bool:
        assert self.sequence is not None
        return self.sequence.undecided and not final


@dataclass
class _RequiredScan(_JsonCallsScan):
    """`tool_choice: required`: a JSON array of `{"name": ..., "parameters": {...}}` (what the
    structured-output schema from `required_schema` allows)."""

    def _open(self, text: str, final: bool) -> bool:
        i = self.ws_end
        if i >= len(text):
            self.is_content = final
            return final
        if text[i] == "[":
            self.sequence = _CallSequence(i + 1, ",", "]", self.meter)
        else:
            self.is_content = True
        return True

    def _held(self, final: bool) -> bool:
        assert self.sequence is not None
        return self.sequence.undecided or not final


@dataclass
class _NamedScan:
    """A named function: the whole output (without surrounding blanks) is its arguments."""

    name: str
    meter: _Meter = field(default_factory=_Meter)
    content_end: int = 0
    settled: list[_CallSpan] = field(default_factory=list)
    current: _CallSpan | None = None
    ws_end: int = 0
    trim: _Trim | None = None

    def update(self, text: str, final: bool) -> None:
        n = len(text)
        if self.trim is None:
            self.ws_end = _skip_ws(text, self.ws_end, n, self.meter)
            if self.ws_end >= n:
                self.current = _CallSpan(self.name, literal="")
                return
            self.trim = _Trim(self.ws_end, self.meter)
        self.current = _CallSpan(self.name, self.ws_end, self.trim.update(text, n))


@dataclass(frozen=True)
class Parser:
    """A tool-call format: `new_scanner()` makes one output's resumable parse state; calling
    the parser parses a whole text. `max_calls` keeps only the first calls."""

    new_scanner: Callable[[], _Scanner]
    max_calls: int | None = None

    def __call__(self, text: str, final: bool) -> ParsedOutput:
        scanner = self.new_scanner()
        scanner.update(text, final)
        return self.snapshot(scanner, text)

    def calls(self, scanner: _Scanner) -> list[_CallSpan]:
        calls = [*scanner.settled, *([scanner.current] if scanner.current else [])]
        return calls[: self.max_calls]

    def snapshot(self, scanner: _Scanner, text: str) -> ParsedOutput:
        calls = (ParsedCall(c.name, c.arguments(text)) for c in self.calls(scanner))
        return ParsedOutput(text[: scanner.content_end], tuple(calls))


parse_hermes = Parser(_HermesScan)
parse_llama3_json = Parser(_Llama3Scan)
parse_required = Parser(_RequiredScan)


def named_parser(name: str) -> Parser:
    """A named function: the whole output is its arguments."""
    return Parser(partial(_NamedScan, name))


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
    """One choice's streaming state: the parser's scanner, and what of its snapshot was sent.
    Each chunk costs the text appended since the last one: finished calls already sent are
    not looked at again."""

    parse: Parser
    content_sent: int = 0
    call_ids: list[str] = field(default_factory=list)
    arguments_sent: list[int] = field(default_factory=list)
    settled_sent: int = 0  # finished calls sent in full
    scanner: _Scanner = field(init=False)

    def __post_init__(self) -> None:
        self.scanner = self.parse.new_scanner()

    def delta(self, text: str, final: bool) -> dict:
        """The chat delta (`content` and/or `tool_calls`) new since the last call."""
        scanner = self.scanner
        scanner.update(text, final)
        delta: dict = {}
        if scanner.content_end > self.content_sent:
            delta["content"] = text[self.content_sent : scanner.content_end]
            self.content_sent = scanner.content_end
        limit = len(scanner.settled) + 1 if self.parse.max_calls is None else self.parse.max_calls
        items = []
        for index in range(self.settled_sent, min(len(scanner.settled), limit)):
            self._send(items, index, scanner.settled[index], text)
        self.settled_sent = len(scanner.settled)
        if scanner.current is not None and len(scanner.settled) < limit:
            self._send(items, len(scanner.settled), scanner.current, text)
        if items:
            delta["tool_calls"] = items
        return delta

    def parsed(self, text: str) -> ParsedOutput:
        """The snapshot of `text` (the last one `delta` was given) the client was brought to."""
        return self.parse.snapshot(self.scanner, text)

    def _send(self, items: list[dict], index: int, call: _CallSpan, text: str) -> None:
        item: dict = {"index": index}
        if index == len(self.call_ids):
            self.call_ids.append(new_call_id())
            self.arguments_sent.append(0)
            item |= {"id": self.call_ids[index], "type": "function"}
            item["function"] = {"name": call.name, "arguments": ""}
        sent = self.arguments_sent[index]
        if call.size() > sent:
            item.setdefault("function", {})["arguments"] = call.arguments(text, sent)
            self.arguments_sent[index] = call.size()
        if len(item) > 1:
            items.append(item)


def at_most_one(parse: Parser) -> Parser:
    """`parallel_tool_calls: false`: the first call only."""
    return dataclasses.replace(parse, max_calls=1)


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
