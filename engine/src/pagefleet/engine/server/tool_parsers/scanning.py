"""The resumable scanning every tool-call format is built from: where a (possibly unfinished)
JSON value or object ends, read as far as the text goes and resumed there when text is
appended, so a streamed output costs time linear in its length. `Meter` counts the characters
looked at (what tests bound to prove it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

WS = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes writes the first, Llama 3 the second


@dataclass
class Meter:
    """Characters the scanners looked at: what tests bound to prove the work is linear."""

    chars: int = 0


@dataclass(frozen=True)
class CallSpan:
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


class Scanner(Protocol):
    """One output's parse state. After `update(text, final)`: content is text[:content_end];
    the calls are `settled` (finished: never change again, only appended to) then `current`
    (the call still being written, if any)."""

    content_end: int
    settled: list[CallSpan]
    current: CallSpan | None
    meter: Meter

    def update(self, text: str, final: bool) -> None: ...


class Invalid(Exception):
    """The text cannot be the JSON it should be (as opposed to not finished yet)."""


_WS_RUN = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\]*')
_PLAIN_RUN = re.compile(r'[^"{}\[\]]*')  # inside a container, between strings and brackets
_SCALAR_RUN = re.compile(r"[^,}\]\s]*")


def skip_ws(text: str, i: int, limit: int, meter: Meter) -> int:
    end = _WS_RUN.match(text, i, limit).end()
    meter.chars += end - i + 1
    return end


def find(text: str, tag: str, start: int, meter: Meter) -> int:
    meter.chars += max(len(text) - start, 0)
    return text.find(tag, start)


def held_back(text: str, end: int, floor: int, tag: str) -> int:
    """Length of the longest suffix of text[floor:end] that is a proper prefix of `tag` (text
    that may still turn into the tag)."""
    tail = text[max(floor, end - len(tag) + 1) : end]
    for n in range(len(tail), 0, -1):
        if tail.endswith(tag[:n]):
            return n
    return 0


@dataclass
class Trim:
    """Where text[start:limit] ends without trailing blanks, as `limit` grows."""

    start: int
    meter: Meter
    scanned: int = -1
    end: int = -1

    def update(self, text: str, limit: int) -> int:
        if self.scanned < 0:
            self.scanned = self.end = self.start
        if limit > self.scanned:
            kept = text[self.scanned : limit].rstrip(WS)
            self.meter.chars += limit - self.scanned
            if kept:
                self.end = self.scanned + len(kept)
            self.scanned = limit
        return self.end


@dataclass
class ValueScan:
    """The JSON value starting at text[start] (not a blank), read as far as the text goes and
    resumed there. Containers are matched by bracket depth; their inside is not checked."""

    start: int
    meter: Meter
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
                raise Invalid(f"no JSON value at {self.start}")
            else:
                self.scalar, self.pos = True, self.start
        if self.scalar:
            self.pos = self._run(_SCALAR_RUN, text, limit)
            if self.pos == self.start:
                raise Invalid(f"no JSON value at {self.start}")
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
class ObjectScan:
    """A (possibly unfinished) JSON object's top level from text[start] == '{', resumed where
    the text ended: the first `name` value and the first arguments value (their own scanners),
    and its end once seen. `advance` raises Invalid where the text stops being an object."""

    start: int
    meter: Meter
    pos: int = -1
    state: str = "first"  # first, key, in_key, colon, value, in_value, after
    part: ValueScan | None = None  # the key or value being read
    key: str = ""
    name: ValueScan | None = None
    arguments: ValueScan | None = None
    end: int | None = None
    _name: object = None
    _trim: Trim | None = None

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
            self.pos = skip_ws(text, self.pos, limit, self.meter)
            if self.pos >= limit:
                return
            char = text[self.pos]
            if self.state == "first" and char == "}":
                self.end = self.pos + 1
            elif self.state in ("first", "key"):
                if char != '"':
                    raise Invalid("object key expected")
                self.part, self.state = ValueScan(self.pos, self.meter), "in_key"
            elif self.state == "colon":
                if char != ":":
                    raise Invalid("':' expected")
                self.pos, self.state = self.pos + 1, "value"
            elif self.state == "value":
                self.part, self.state = ValueScan(self.pos, self.meter), "in_value"
                if self.key == "name" and self.name is None:
                    self.name = self.part
                elif self.key in ARGUMENT_KEYS and self.arguments is None:
                    self.arguments = self.part
            elif char == "}":
                self.end = self.pos + 1
            elif char == ",":
                self.pos, self.state = self.pos + 1, "key"
            else:
                raise Invalid("',' or '}' expected")

    def call(self, text: str, limit: int, closed: bool) -> CallSpan | None:
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
            return CallSpan(self._name, literal="{}" if closed or self.end is not None else "")
        start, end = self.arguments.start, self.arguments.end
        if end is None:
            if self._trim is None:
                self._trim = Trim(start, self.meter)
            end = self._trim.update(text, limit)
        return CallSpan(self._name, start, end)


def _json_string(token: str) -> str:
    try:
        return json.loads(token)
    except ValueError:  # a bad escape
        raise Invalid("bad string") from None


def _name_of(token: str) -> object:
    try:
        return json.loads(token)
    except ValueError:
        return _NO_NAME
