"""JSON-valued flags (vLLM's --*-config): one object, unknown keys refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def parse_json_object(
    flag: str, raw: str | dict[str, Any], known: Iterable[str], ignored: Iterable[str] = ()
) -> dict[str, Any]:
    """`raw` (the flag's text, or a dict given in Python) as a dict; ValueError naming `flag`
    if it is not a JSON object or has keys outside `known` (`ignored` keys pass, dropped)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{flag} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} must be a JSON object")
    known = set(known)
    ignored = set(ignored)
    unknown = sorted(set(raw) - known - ignored)
    if unknown:
        raise ValueError(f"{flag}: unknown keys {unknown}; known: {sorted(known)}")
    return {k: v for k, v in raw.items() if k not in ignored}
