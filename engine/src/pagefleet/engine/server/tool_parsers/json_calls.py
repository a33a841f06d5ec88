"""Formats whose output is a sequence of JSON call objects: Llama 3's (`<|python_tag|>`,
`;`-separated), the array `tool_choice: required` constrains the output to, and a named
function's bare arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.engine.server.tool_parsers.scanning import (
    CallSpan,
    Invalid,
    Meter,
    ObjectScan,
    Trim,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


@dataclass
class CallSequence:
    """Objects from `pos` separated by `separator` (and ended by `closer`, if any): the calls
    they make (`settled`, `current`), and whether the first object is still undecided
    (unfinished and nameless). Anything else ends the sequence."""

    pos: int
    separator: str
    closer: str | None
    meter: Meter
    settled: list[CallSpan] = field(default_factory=list)
    current: CallSpan | None = None
    undecided: bool = False
    obj: ObjectScan | None = None
    after_object: bool = False
    stopped: bool = False

    def update(self, text: str, final: bool) -> None:
        n = len(text)
        self.current, self.undecided = None, False
        while not self.stopped:
            if self.obj is None:
                self.pos = skip_ws(text, self.pos, n, self.meter)
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
                self.obj = ObjectScan(self.pos, self.meter)
            try:
                self.obj.advance(text, n)
            except Invalid:
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
class JsonCallsScan:
    """Output that is calls if it opens with `opener` (after blanks), otherwise content; the
    calls' share of the snapshot comes from a CallSequence."""

    meter: Meter = field(default_factory=Meter)
    content_end: int = 0
    settled: list[CallSpan] = field(default_factory=list)
    current: CallSpan | None = None
    ws_end: int = 0
    is_content: bool = False
    sequence: CallSequence | None = None

    def _open(self, text: str, final: bool) -> bool:
        """Decide content or calls (setting is_content or sequence); False: not yet."""
        raise NotImplementedError

    def update(self, text: str, final: bool) -> None:
        n = len(text)
        if not self.is_content and self.sequence is None:
            self.ws_end = skip_ws(text, self.ws_end, n, self.meter)
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
class Llama3Scan(JsonCallsScan):
    """`<|python_tag|>{"name": ..., "parameters": {...}}; {...}` or the same without the tag.
    Output that does not start with the tag or `{`, or whose first object has no name, is
    content (decided once the first object ends)."""

    def _open(self, text: str, final: bool) -> bool:
        i = self.ws_end
        head = text[i : i + len(PYTHON_TAG) + 1]
        if not final and len(head) <= len(PYTHON_TAG) and PYTHON_TAG.startswith(head):
            return False  # may still become the tag
        if head.startswith(PYTHON_TAG):
            self.sequence = CallSequence(i + len(PYTHON_TAG), ";", None, self.meter)
        elif head.startswith("{"):
            self.sequence = CallSequence(i, ";", None, self.meter)
        else:
            self.is_content = True
        return True

    def _held(self, final: bool) -> bool:
        assert self.sequence is not None
        return self.sequence.undecided and not final


@dataclass
class RequiredScan(JsonCallsScan):
    """`tool_choice: required`: a JSON array of `{"name": ..., "parameters": {...}}` (what the
    structured-output schema from `required_schema` allows)."""

    def _open(self, text: str, final: bool) -> bool:
        i = self.ws_end
        if i >= len(text):
            self.is_content = final
            return final
        if text[i] == "[":
            self.sequence = CallSequence(i + 1, ",", "]", self.meter)
        else:
            self.is_content = True
        return True

    def _held(self, final: bool) -> bool:
        assert self.sequence is not None
        return self.sequence.undecided or not final


@dataclass
class NamedScan:
    """A named function: the whole output (without surrounding blanks) is its arguments."""

    name: str
    meter: Meter = field(default_factory=Meter)
    content_end: int = 0
    settled: list[CallSpan] = field(default_factory=list)
    current: CallSpan | None = None
    ws_end: int = 0
    trim: Trim | None = None

    def update(self, text: str, final: bool) -> None:
        n = len(text)
        if self.trim is None:
            self.ws_end = skip_ws(text, self.ws_end, n, self.meter)
            if self.ws_end >= n:
                self.current = CallSpan(self.name, literal="")
                return
            self.trim = Trim(self.ws_end, self.meter)
        self.current = CallSpan(self.name, self.ws_end, self.trim.update(text, n))
