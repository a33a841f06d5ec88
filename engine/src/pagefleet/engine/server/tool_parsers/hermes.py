"""The Hermes format (Qwen's): content, then `<tool_call>{"name": ..., "arguments": {...}}`
`</tool_call>` blocks; text between blocks is dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.engine.server.tool_parsers.scanning import (
    CallSpan,
    Invalid,
    Meter,
    ObjectScan,
    find,
    held_back,
    skip_ws,
)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class HermesBlock:
    """An open `<tool_call>` block: its body from `body_start`."""

    body_start: int
    meter: Meter
    close_from: int = -1  # where the closing tag may start (earlier text was searched)
    pos: int = -1  # past the blanks before the body's object
    obj: ObjectScan | None = None
    dead: bool = False  # not an object: no call

    def call(self, text: str, limit: int, closed: bool) -> CallSpan | None:
        if self.dead:
            return None
        try:
            if self.obj is None:
                self.pos = skip_ws(text, max(self.pos, self.body_start), limit, self.meter)
                if self.pos >= limit:
                    return None
                if text[self.pos] != "{":
                    raise Invalid("not an object")
                self.obj = ObjectScan(self.pos, self.meter)
            self.obj.advance(text, limit)
        except Invalid:
            self.dead = True
            return None
        return self.obj.call(text, limit, closed)


@dataclass
class HermesScan:
    """`content <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...`. Content is the
    text before the first tag (as vLLM); a block without a name is no call; text between
    blocks is dropped."""

    meter: Meter = field(default_factory=Meter)
    content_end: int = 0
    settled: list[CallSpan] = field(default_factory=list)
    current: CallSpan | None = None
    tagged: bool = False  # the first tag was seen: content is decided
    search_from: int = 0  # where the next opening tag may start
    block: HermesBlock | None = None

    def update(self, text: str, final: bool) -> None:
        n = len(text)
        while True:
            if self.block is None:
                self.current = None
                start = find(text, HERMES_OPEN, self.search_from, self.meter)
                if start < 0:
                    self.search_from = max(self.search_from, n - len(HERMES_OPEN) + 1)
                    if not self.tagged:
                        held = 0 if final else held_back(text, n, 0, HERMES_OPEN)
                        self.content_end = n - held
                    return
                if not self.tagged:
                    self.tagged, self.content_end = True, start
                body = start + len(HERMES_OPEN)
                self.block = HermesBlock(body, self.meter, close_from=body)
            block = self.block
            close = find(text, HERMES_CLOSE, block.close_from, self.meter)
            if close < 0:
                block.close_from = max(block.close_from, n - len(HERMES_CLOSE) + 1)
                # A partial closing tag is not part of the body.
                held = 0 if final else held_back(text, n, block.body_start, HERMES_CLOSE)
                self.current = block.call(text, n - held, final)
                return
            call = block.call(text, close, True)
            if call is not None:
                self.settled.append(call)
            self.block, self.search_from = None, close + len(HERMES_CLOSE)
