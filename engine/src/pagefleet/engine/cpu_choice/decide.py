"""Machine-dependent CPU choices as a pure function of measured times: which path wins, by how
much, and the one line the engine logs to say why.

A choice picks among named candidates (the linear path of one weight shape: "plain" MKL or
"packed" oneDNN, model/linear_plan.py) from the seconds each took on every workload class it
was timed on (the rows of a linear).
The rule: a candidate's cost is the geometric mean, over the classes, of its time relative to
the fastest candidate on that class, so no single class dominates; the cheapest replaces the
default only when it beats the default's cost by more than `margin` (a tie or a near-tie keeps
the default, which needs no measurement to be safe). A measurement that failed (missing, not
finite, not positive) keeps the default and says which one failed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MARGIN = 0.05  # the cheapest must be 5% cheaper than the default to replace it


@dataclass(frozen=True)
class Timed:
    """Seconds per call of each candidate on one workload class (`label`: "rows=16")."""

    label: str
    seconds: Mapping[str, float | None]


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str


def choose(
    candidates: Sequence[str], default: str, timings: Sequence[Timed], margin: float = MARGIN
) -> Choice:
    """The candidate to use (see the module docstring) and why, in words for the log."""
    if default not in candidates:
        raise ValueError(f"default {default!r} is not a candidate of {list(candidates)}")
    failed = _first_failure(candidates, timings)
    if failed is not None:
        return Choice(default, f"{default} (the default): {failed}")
    costs = {name: _relative_cost(name, candidates, timings) for name in candidates}
    best = min(candidates, key=lambda name: (costs[name], name != default))
    rival = (
        best
        if best != default
        else min((c for c in candidates if c != default), key=costs.__getitem__, default=default)
    )
    per_class = ", ".join(_ratio_text(t, default, rival) for t in timings)
    if best == default:
        return Choice(default, f"{default} (the default) is fastest ({per_class})")
    speedup = costs[default] / costs[best]
    if speedup <= 1 + margin:
        return Choice(
            default,
            f"{default} (the default): {best} is only {speedup:.2f}x faster, within the "
            f"{margin:.0%} margin ({per_class})",
        )
    return Choice(best, f"{best} is {speedup:.2f}x faster than {default} ({per_class})")


def _first_failure(candidates: Sequence[str], timings: Sequence[Timed]) -> str | None:
    if not timings:
        return "nothing was measured"
    for timed in timings:
        for name in candidates:
            seconds = timed.seconds.get(name)
            if seconds is None or not math.isfinite(seconds) or seconds <= 0:
                return f"the measurement of {name} at {timed.label} failed ({seconds!r})"
    return None


def _relative_cost(name: str, candidates: Sequence[str], timings: Sequence[Timed]) -> float:
    logs = []
    for timed in timings:
        fastest = min(timed.seconds[c] for c in candidates)
        logs.append(math.log(timed.seconds[name] / fastest))
    return math.exp(sum(logs) / len(logs))


def _ratio_text(timed: Timed, default: str, rival: str) -> str:
    """`rival`'s speed relative to the default's on one class (>1: the rival is faster)."""
    if rival == default:
        return f"{timed.label}: {timed.seconds[default] * 1e6:.0f} us"
    return f"{timed.label}: {rival} {timed.seconds[default] / timed.seconds[rival]:.2f}x"
