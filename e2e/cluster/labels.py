"""Label selectors as the API server reads them: the `labelSelector` query text (equality and
set-based) and the `LabelSelector` objects of Deployments and Services. Pure functions."""

from __future__ import annotations

import re
from dataclasses import dataclass

_TEXT = re.compile(
    r"^\s*(?:(?P<not>!)\s*(?P<absent>[\w./-]+)"
    r"|(?P<key>[\w./-]+)\s*(?:(?P<op>==|!=|=)\s*(?P<value>[\w./-]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?)\s*$"
)


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        return {
            "=": present and value in self.values,
            "in": present and value in self.values,
            "!=": not present or value not in self.values,
            "notin": not present or value not in self.values,
            "exists": present,
            "!exists": not present,
        }[self.op]


def _split(text: str) -> list[str]:
    """Commas separate requirements, except inside `in (a, b)`."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def parse_selector(text: str | None) -> tuple[Requirement, ...]:
    """`a=b,c!=d,e in (f,g),h,!i`; raises ValueError on anything else (the API answers 400)."""
    requirements = []
    for part in _split(text or ""):
        m = _TEXT.match(part)
        if not m:
            raise ValueError(f"unable to parse requirement: {part.strip()!r}")
        if m["absent"]:
            requirements.append(Requirement(m["absent"], "!exists"))
        elif m["op"]:
            op = "!=" if m["op"] == "!=" else "="
            requirements.append(Requirement(m["key"], op, frozenset([m["value"]])))
        elif m["setop"]:
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            requirements.append(Requirement(m["key"], m["setop"], values))
        else:
            requirements.append(Requirement(m["key"], "exists"))
    return tuple(requirements)


_EXPRESSION_OPS = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!exists"}


def from_label_selector(selector: dict | None) -> tuple[Requirement, ...]:
    """A `LabelSelector` object (matchLabels + matchExpressions)."""
    selector = selector or {}
    requirements = [
        Requirement(k, "=", frozenset([v])) for k, v in (selector.get("matchLabels") or {}).items()
    ]
    for e in selector.get("matchExpressions") or []:
        requirements.append(
            Requirement(e["key"], _EXPRESSION_OPS[e["operator"]], frozenset(e.get("values") or []))
        )
    return tuple(requirements)


def from_map(labels: dict[str, str] | None) -> tuple[Requirement, ...]:
    """A Service's plain `selector` map."""
    return tuple(Requirement(k, "=", frozenset([v])) for k, v in (labels or {}).items())


def matches(requirements: tuple[Requirement, ...], labels: dict[str, str] | None) -> bool:
    return all(r.matches(labels or {}) for r in requirements)
