"""How evenly a mixture-of-experts model's router spreads tokens, summarised per layer with
bounded cardinality for /metrics: tokens routed, the busiest expert's and the mean expert's
share, and under expert parallelism the busiest rank's (pure; the counts come from the model).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerLoad:
    """Cumulative (token, expert) assignments of one sparse layer since the engine started."""

    layer: int  # decoder layer index
    routed: int  # assignments: tokens x experts per token
    max_expert: int  # assignments of the busiest expert
    mean_expert: float  # assignments per expert on average
    max_rank: int | None = None  # under expert parallelism: of the busiest rank's experts
    mean_rank: float | None = None

    @property
    def imbalance(self) -> float:
        """Busiest expert over the mean (1.0: perfectly even; 0 before any token)."""
        return self.max_expert / self.mean_expert if self.mean_expert else 0.0


@dataclass(frozen=True)
class ExpertLoadStats:
    num_experts: int
    layers: tuple[LayerLoad, ...]


def summarise(
    counts: dict[int, list[int]], rank_ranges: list[tuple[int, int]] | None = None
) -> ExpertLoadStats:
    """`counts[layer][e]`: assignments to expert e; `rank_ranges`: (first expert, count) per
    rank under expert parallelism (None without)."""
    layers = []
    num_experts = 0
    for layer, per_expert in sorted(counts.items()):
        num_experts = len(per_expert)
        total = sum(per_expert)
        ranks = None
        if rank_ranges:
            ranks = [sum(per_expert[first : first + n]) for first, n in rank_ranges]
        layers.append(
            LayerLoad(
                layer,
                total,
                max(per_expert, default=0),
                total / num_experts if num_experts else 0.0,
                max(ranks) if ranks else None,
                total / len(ranks) if ranks else None,
            )
        )
    return ExpertLoadStats(num_experts, tuple(layers))
