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
text is the same scanner fed once. The formats' scanners are hermes.py and json_calls.py,
both built on scanning.py; this module turns their state into OpenAI's shapes.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from pagefleet.engine.server.tool_parsers.hermes import HermesScan
from pagefleet.engine.server.tool_parsers.json_calls import (
    Llama3Scan,
    NamedScan,
    RequiredScan,
)
from pagefleet.engine.server.tool_parsers.scanning import CallSpan, Scanner

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text as the model wrote it (a prefix of it while streaming)


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class Parser:
    """A tool-call format: `new_scanner()` makes one output's resumable parse state; calling
    the parser parses a whole text. `max_calls` keeps only the first calls."""

    new_scanner: Callable[[], Scanner]
    max_calls: int | None = None

    def __call__(self, text: str, final: bool) -> ParsedOutput:
        scanner = self.new_scanner()
        scanner.update(text, final)
        return self.snapshot(scanner, text)

    def calls(self, scanner: Scanner) -> list[CallSpan]:
        calls = [*scanner.settled, *([scanner.current] if scanner.current else [])]
        return calls[: self.max_calls]

    def snapshot(self, scanner: Scanner, text: str) -> ParsedOutput:
        calls = (ParsedCall(c.name, c.arguments(text)) for c in self.calls(scanner))
        return ParsedOutput(text[: scanner.content_end], tuple(calls))


parse_hermes = Parser(HermesScan)
parse_llama3_json = Parser(Llama3Scan)
parse_required = Parser(RequiredScan)


def named_parser(name: str) -> Parser:
    """A named function: the whole output is its arguments."""
    return Parser(partial(NamedScan, name))


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
    scanner: Scanner = field(init=False)

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

    def _send(self, items: list[dict], index: int, call: CallSpan, text: str) -> None:
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
