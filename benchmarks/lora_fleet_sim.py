"""The fleet part of benchmarks/multi_lora.py: a per-tenant LoRA trace routed by the router's
own scoring pipeline (pagefleet.router.scoring, as the router runs it) with and without the
lora-affinity scorer, over SIMULATED engines (no model runs: a step-time model).

Each simulated engine has `--max-loras` slots (least recently used evicted; a request whose
adapter is not in a slot pays a load), a prefix cache of blocks keyed by (adapter, block) as
the engine's (two adapters never share a block; least recently used evicted) and serves its
prefills one at a time, first come first served (TTFT = queueing + adapter load + prefill of
the uncached tokens), its decodes batched (overlapping freely); an adapter whose requests
still decode keeps its slot, so a request for another adapter waits for a free slot. The
router sees what it sees in a fleet: each pod's adapters, those its queued requests use
(vllm:lora_requests_info), its queue and in-flight counts, the leading blocks each pod holds
(as precise KV events tell it), and the adapters it sent each pod lately.
Tenants have their own adapter and system prompt, popularity Zipf-like; arrivals Poisson.
Reported per policy: prefix-cache hit rate, adapter loads, TTFT p50/p90 (simulated seconds).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from pagefleet.router.scoring import Pipeline, Pod, RoutingRequest

BLOCK = 16


@dataclass(frozen=True)
class FleetParams:
    pods: int = 4
    max_loras: int = 2
    tenants: int = 16
    requests: int = 2000
    rate: float = 5.0  # requests per simulated second
    system_blocks: int = 32  # the tenant's shared prompt
    user_blocks: int = 8  # each request's own part
    output_tokens: int = 64
    cache_blocks: int = 1024  # per pod
    load_s: float = 0.05  # an adapter into a slot
    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.008
    seed: int = 0


@dataclass
class SimPod:
    view: Pod  # what the router sees
    slots: OrderedDict = field(default_factory=OrderedDict)  # adapter -> None, LRU first
    cache: OrderedDict = field(default_factory=OrderedDict)  # (adapter, block) -> None
    busy_until: float = 0.0
    queued: list = field(default_factory=list)  # (start, end, adapter) heap by end


@dataclass
class FleetResult:
    hit_rate: float
    adapter_loads: int
    ttft_p50: float
    ttft_p90: float


def _trace(p: FleetParams) -> list[tuple[float, int]]:
    """(arrival time, tenant) pairs: Poisson arrivals, tenant i chosen with weight 1/(i+1)."""
    rng = random.Random(p.seed)
    weights = [1.0 / (i + 1) for i in range(p.tenants)]
    t, out = 0.0, []
    for _ in range(p.requests):
        t += rng.expovariate(p.rate)
        out.append((t, rng.choices(range(p.tenants), weights)[0]))
    return out


def _refresh(pod: SimPod, now: float) -> None:
    """The router's view of `pod` at `now`: requests finished are gone."""
    while pod.queued and pod.queued[0][0] <= now:
        heapq.heappop(pod.queued)
    waiting = [q for q in pod.queued if q[1] > now]
    pod.view.inflight = len(pod.queued)
    pod.view.waiting = float(len(waiting))
    pod.view.active_adapters = frozenset(q[2] for q in pod.queued)


def _leading_hits(pod: SimPod, blocks: list[tuple]) -> int:
    n = 0
    for b in blocks:
        if b not in pod.cache:
            break
        n += 1
    return n


def _serve(pod: SimPod, p: FleetParams, now: float, adapter: str, blocks: list[tuple]):
    """Queue the request on `pod`: (ttft, hit blocks, loaded an adapter). Prefills (and
    adapter loads) run one at a time; decodes are batched (they overlap freely), but an
    adapter whose requests still decode keeps its slot: a new adapter waits for a slot whose
    requests are done."""
    start = max(now, pod.busy_until)
    loaded = adapter not in pod.slots
    if loaded:
        if len(pod.slots) >= p.max_loras:
            release = {
                a: max((q[0] for q in pod.queued if q[2] == a), default=0.0) for a in pod.slots
            }
            victim = min(pod.slots, key=lambda a: (release[a], list(pod.slots).index(a)))
            start = max(start, release[victim])
            del pod.slots[victim]
        pod.slots[adapter] = None
    pod.slots.move_to_end(adapter)
    hits = _leading_hits(pod, blocks)
    for b in blocks:
        pod.cache[b] = None
        pod.cache.move_to_end(b)
    while len(pod.cache) > p.cache_blocks:
        pod.cache.popitem(last=False)
    prefill = (len(blocks) - hits) * BLOCK * p.prefill_s_per_token
    first = start + (p.load_s if loaded else 0.0) + prefill
    pod.busy_until = first
    heapq.heappush(pod.queued, (first + p.output_tokens * p.decode_s_per_token, first, adapter))
    return first - now, hits, loaded


def simulate(p: FleetParams, weights: dict[str, float]) -> FleetResult:
    adapters = [f"tenant{i}" for i in range(p.tenants)]
    pods = [
        SimPod(Pod(f"pod{i}", "", adapters=frozenset(adapters), max_lora=p.max_loras))
        for i in range(p.pods)
    ]
    pipeline = Pipeline(["healthy", "model", "role"], weights)
    rng = random.Random(p.seed + 1)
    ttfts, hits, total, loads = [], 0, 0, 0
    for n, (now, tenant) in enumerate(_trace(p)):
        adapter = adapters[tenant]
        blocks = [(adapter, "system", tenant, i) for i in range(p.system_blocks)]
        blocks += [(adapter, "user", n, i) for i in range(p.user_blocks)]
        for pod in pods:
            _refresh(pod, now)
        req = RoutingRequest(
            "base",
            [b"x"] * len(blocks),
            adapter=adapter,
            prefix_matches={pod.view.name: _leading_hits(pod, blocks) for pod in pods},
        )
        choice = pipeline.pick(req, [pod.view for pod in pods], rng)[0].pod
        pod = next(s for s in pods if s.view is choice)
        choice.sent_adapter(adapter)
        ttft, hit, loaded = _serve(pod, p, now, adapter, blocks)
        ttfts.append(ttft)
        hits, total, loads = hits + hit, total + len(blocks), loads + loaded
    ttfts.sort()
    return FleetResult(
        hits / total,
        loads,
        ttfts[len(ttfts) // 2],
        ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
    )


POLICIES = {
    "adapter-aware (prefix 3, queue 2, inflight 1, lora-affinity 2)": {
        "prefix": 3.0,
        "queue": 2.0,
        "inflight": 1.0,
        "lora-affinity": 2.0,
    },
    "not adapter-aware (prefix 3, queue 2, inflight 1)": {
        "prefix": 3.0,
        "queue": 2.0,
        "inflight": 1.0,
    },
    "load only (queue 2, inflight 1)": {"queue": 2.0, "inflight": 1.0},
}


def run_fleet(p: FleetParams) -> dict[str, FleetResult]:
    results = {}
    for name, weights in POLICIES.items():
        results[name] = r = simulate(p, weights)
        print(
            f"{name}: hit rate {r.hit_rate:.1%}, adapter loads {r.adapter_loads}, "
            f"TTFT p50 {r.ttft_p50 * 1000:.0f} ms, p90 {r.ttft_p90 * 1000:.0f} ms",
            flush=True,
        )
    return results
