"""Endpoint picking as a pipeline of small plugins: filters -> weighted scorers -> picker.

Pure: it sees plain data about pods and the request and returns candidates with their reasons.
Each scorer maps every candidate pod to [0, 1]; the picker orders the scored candidates into
the order the router tries them (as llm-d's endpoint picker returns its targets): `max-score`
takes the highest weighted sum and breaks ties at random (with the generator it is given).
All three kinds are chosen by name in the router's config.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Defaults and why (see docs/benchmarks.md once the fleet experiment has run): prefix affinity
# saves the most work, so it weighs most, as in llm-d (prefix 3, queue 2, kv-usage 2); the
# in-flight count reacts between scrapes, so bursts spread even before metrics move. LoRA
# affinity scores every pod alike for base-model requests (benchmarks/multi_lora.py).
DEFAULT_WEIGHTS = {
    "prefix": 3.0,
    "queue": 2.0,
    "kv-usage": 2.0,
    "inflight": 1.0,
    "lora-affinity": 2.0,
}


@dataclass
class Pod:
    """What the router knows about one engine pod."""

    name: str
    url: str
    role: str = "both"  # prefill | decode | both
    models: frozenset[str] = frozenset()
    healthy: bool = True
    waiting: float = 0.0
    kv_usage: float = 0.0
    inflight: int = 0
    active_blocks: int = 0  # prompt blocks of the requests in flight (router's own count)
    num_gpu_blocks: int = 0
    # LoRA: the pod's adapters (from its /v1/models), those its running and waiting requests
    # use and how many one step runs (vllm:lora_requests_info; max_lora 0: unknown or no
    # LoRA), and those the router sent it lately, newest last (its resident slots are LRU).
    adapters: frozenset[str] = frozenset()
    active_adapters: frozenset[str] = frozenset()
    max_lora: int = 0
    recent_adapters: list[str] = field(default_factory=list)
    caches_prefixes: bool = True  # False: its /metrics say enable_prefix_caching False

    @property
    def endpoint(self) -> str:
        """`host:port`, as a gateway names the pod (the Endpoint Picker Protocol's form)."""
        return self.url.partition("://")[2].rstrip("/")

    def begin(self, blocks: int) -> None:
        """The router sent this pod a request of `blocks` prompt blocks."""
        self.inflight += 1
        self.active_blocks += blocks

    def end(self, blocks: int) -> None:
        self.inflight -= 1
        self.active_blocks -= blocks

    def sent_adapter(self, name: str) -> None:
        """The router sent the pod a request for adapter `name`: it is (or will be) in one of
        the pod's max_lora slots, which evict the least recently used."""
        recent = self.recent_adapters
        if name in recent:
            recent.remove(name)
        recent.append(name)
        del recent[: -max(self.max_lora, 1)]


@dataclass
class RoutingRequest:
    model: str
    block_hashes: Sequence[bytes]
    role: str | None = None  # the role a pod must serve (P/D); None: any that serves "both"
    adapter: str | None = None  # the LoRA adapter `model` names; None: the base model
    # pod -> leading blocks held (host-tier blocks count HOST_TIER_WEIGHT, see prefix_index)
    prefix_matches: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    """A pod that passed the filters, with its weighted score and each scorer's part of it."""

    pod: Pod
    score: float
    contributions: dict[str, float]  # scorer -> weighted score


Filter = Callable[[RoutingRequest, list[Pod]], list[Pod]]
Scorer = Callable[[RoutingRequest, list[Pod]], dict[str, float]]
# Candidates best score first -> the order to try them (the first is the choice).
Picker = Callable[[list[Candidate], random.Random], list[Candidate]]


def healthy_filter(req: RoutingRequest, pods: list[Pod]) -> list[Pod]:
    return [p for p in pods if p.healthy]


def model_filter(req: RoutingRequest, pods: list[Pod]) -> list[Pod]:
    """Pods that serve the model: its base model or, for a LoRA adapter, one that lists it."""
    if req.adapter is not None:
        return [p for p in pods if req.adapter in p.adapters]
    return [p for p in pods if not p.models or req.model in p.models]


def role_filter(req: RoutingRequest, pods: list[Pod]) -> list[Pod]:
    if req.role is None:
        return [p for p in pods if p.role == "both"] or pods
    return [p for p in pods if p.role in (req.role, "both")]


def prefix_scorer(req: RoutingRequest, pods: list[Pod]) -> dict[str, float]:
    total = len(req.block_hashes)
    if not total:
        return {p.name: 0.0 for p in pods}
    return {p.name: req.prefix_matches.get(p.name, 0) / total for p in pods}


def _relative_load(values: dict[str, float]) -> dict[str, float]:
    """1 for an idle pod, falling smoothly as its load grows relative to the fleet's mean.
    (Min-max normalisation would give the busiest pod 0 even when it has one request more,
    which throws away a prefix hit for nothing.)"""
    if not values:
        return {}
    mean = sum(values.values()) / len(values)
    return {name: 1.0 / (1.0 + v / (mean + 1.0)) for name, v in values.items()}


def queue_scorer(req: RoutingRequest, pods: list[Pod]) -> dict[str, float]:
    return _relative_load({p.name: p.waiting for p in pods})


def kv_usage_scorer(req: RoutingRequest, pods: list[Pod]) -> dict[str, float]:
    return {p.name: min(max(1.0 - p.kv_usage, 0.0), 1.0) for p in pods}


def inflight_scorer(req: RoutingRequest, pods: list[Pod]) -> dict[str, float]:
    return _relative_load({p.name: float(p.inflight) for p in pods})


# In-flight blocks cost less than blocks to prefill: most of an in-flight request's prompt is
# already computed, and what it still costs (decode reads) is spread over its remaining steps.
# Chosen with benchmarks/router_fleet.py (see docs/benchmarks.md).
ACTIVE_BLOCK_COST = 0.25


def kv_cost_scorer(req: RoutingRequest, pods: list[Pod]) -> dict[str, float]:
    """Work a pod would have with this request, in blocks: the prompt blocks it must prefill
    plus the blocks of the requests it already has in flight (as Dynamo's KV router weighs
    them). Cheapest pod 1, others (min + 1) / (cost + 1): a prefix hit wins until the pod's
    backlog costs more than prefilling the prompt elsewhere, which spreads hot prefixes."""
    total = len(req.block_hashes)
    cost = {
        p.name: total - req.prefix_matches.get(p.name, 0) + ACTIVE_BLOCK_COST * p.active_blocks
        for p in pods
    }
    low = min(cost.values(), default=0)
    return {name: (low + 1) / (c + 1) for name, c in cost.items()}


# LoRA affinity, for a request naming an adapter: a pod whose requests use it now has it in a
# slot; a pod whose slots all hold adapters in use would make it wait; of the others, one the
# router sent it to lately most likely still holds it, and any loads it into a free slot
# without evicting an adapter its requests use.
LORA_ACTIVE, LORA_RECENT, LORA_FREE_SLOT = 1.0, 0.8, 0.5


def lora_affinity_scorer(req: RoutingRequest, pods: list[Pod]) -> dict[str, float]:
    """Where the adapter is loaded, or loadable without evicting a busy one (as the Gateway
    API Inference Extension's LoRA affinity); every pod alike for base-model requests."""
    if req.adapter is None:
        return {p.name: 1.0 for p in pods}
    scores = {}
    for p in pods:
        if req.adapter in p.active_adapters:
            scores[p.name] = LORA_ACTIVE
        elif p.max_lora and len(p.active_adapters) >= p.max_lora:
            scores[p.name] = 0.0  # every slot holds an adapter in use
        elif req.adapter in p.recent_adapters:
            scores[p.name] = LORA_RECENT
        else:
            scores[p.name] = LORA_FREE_SLOT
    return scores


TIE = 1e-9  # scores this close are equal


def max_score_picker(ranked: list[Candidate], rng: random.Random) -> list[Candidate]:
    """The best score first, a tie among the best broken at random (a fixed order would send
    every request of an idle fleet to one pod); the rest stay best first, for retries."""
    tied = [c for c in ranked if ranked[0].score - c.score <= TIE]
    if len(tied) > 1:
        rng.shuffle(tied)
    return tied + ranked[len(tied) :]


def random_picker(ranked: list[Candidate], rng: random.Random) -> list[Candidate]:
    """Scores ignored: any candidate, uniformly (a baseline for the scorers to beat)."""
    return rng.sample(ranked, len(ranked))


FILTERS: dict[str, Filter] = {"healthy": healthy_filter, "model": model_filter, "role": role_filter}
SCORERS: dict[str, Scorer] = {
    "prefix": prefix_scorer,
    "queue": queue_scorer,
    "kv-usage": kv_usage_scorer,
    "inflight": inflight_scorer,
    "kv-cost": kv_cost_scorer,
    "lora-affinity": lora_affinity_scorer,
}
PICKERS: dict[str, Picker] = {"max-score": max_score_picker, "random": random_picker}


class Pipeline:
    def __init__(
        self, filters: Sequence[str], weights: dict[str, float], picker: str = "max-score"
    ) -> None:
        unknown = [f for f in filters if f not in FILTERS]
        unknown += [s for s in weights if s not in SCORERS]
        unknown += [picker] if picker not in PICKERS else []
        if unknown:
            raise ValueError(
                f"unknown plugins {unknown}; filters: {sorted(FILTERS)}, "
                f"scorers: {sorted(SCORERS)}, pickers: {sorted(PICKERS)}"
            )
        if any(w < 0 for w in weights.values()):
            raise ValueError("scorer weights must be >= 0")
        self.filters = [FILTERS[f] for f in filters]
        self.weights = {name: w for name, w in weights.items() if w > 0}
        self.picker = PICKERS[picker]

    @classmethod
    def from_config(cls, config: dict | None = None) -> Pipeline:
        """From the router's YAML config:
        `{filters: [...], scorers: {name: weight}, picker: name}`."""
        config = config or {}
        known = ("filters", "scorers", "picker", "pd_threshold_tokens")
        unknown = set(config) - set(known)
        if unknown:
            raise ValueError(
                f"router config: unknown keys {sorted(unknown)}; known: {', '.join(known)}"
            )
        filters = config.get("filters", ["healthy", "model", "role"])
        weights = config.get("scorers", DEFAULT_WEIGHTS)
        picker = config.get("picker", "max-score")
        if not isinstance(filters, list) or not isinstance(weights, dict):
            raise ValueError("router config: filters must be a list, scorers a mapping")
        return cls(filters, {str(k): float(v) for k, v in weights.items()}, str(picker))

    def candidates(self, req: RoutingRequest, pods: list[Pod]) -> list[Pod]:
        for f in self.filters:
            pods = f(req, pods)
        return pods

    def rank(self, req: RoutingRequest, pods: list[Pod]) -> list[Candidate]:
        """Candidates best score first (equal scores in the pods' order)."""
        pods = self.candidates(req, pods)
        if not pods:
            return []
        per_scorer = {name: SCORERS[name](req, pods) for name in self.weights}
        ranked = []
        for pod in pods:
            parts = {name: w * per_scorer[name][pod.name] for name, w in self.weights.items()}
            ranked.append(Candidate(pod, sum(parts.values()), parts))
        ranked.sort(key=lambda c: c.score, reverse=True)
        return ranked

    def pick(self, req: RoutingRequest, pods: list[Pod], rng: random.Random) -> list[Candidate]:
        """The candidates in the order to try them: the picker's choice first, then the
        fallbacks for a pod that fails before answering. Empty: no pod can serve `req`."""
        ranked = self.rank(req, pods)
        return self.picker(ranked, rng) if ranked else []
