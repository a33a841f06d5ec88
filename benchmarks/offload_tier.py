"""The CPU offload tier on a multi-turn trace whose working set is several times the device pool.

Conversations take turns round-robin (a few in flight at once); each turn resends the whole
history plus a new user message, so by the time a conversation returns, the others have pushed
its blocks out of the device pool. Three engines run the same trace in one process, on the
57M-parameter checkpoint of offline_throughput.py (float32, CPU), their batches interleaved
(one batch of each engine in turn) so that a shared machine's load falls on all three alike:
  none:      the device pool alone (evicted history is recomputed);
  tier:      the same pool plus --kv-offloading-size holding the whole working set;
  infinite:  a device pool holding everything (the floor).
Reported: TTFT p50/p90 of returning turns, and prompt tokens computed; the tier's share of
recomputed tokens removed = 1 - (tier - infinite) / (none - infinite).

    .venv/bin/python benchmarks/offload_tier.py [--conversations 12] [--turns 4] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.client import EngineObserver, StepStats
from pagefleet.engine.kv_cache.host_tier import TierLoad
from pagefleet.engine.model.tiny import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import SHAPE

BLOCK = 16


@dataclass
class Conversation:
    history: list[int]
    turns_done: int = 0


@dataclass
class Result(EngineObserver):
    name: str
    returning_ttft: list[float] = field(default_factory=list)
    prompt_tokens_computed: int = 0
    wall_s: float = 0.0
    tier: dict = field(default_factory=dict)
    device_blocks: int = 0

    def on_step(self, stats: StepStats) -> None:
        self.prompt_tokens_computed += stats.num_prompt_tokens


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_trace(result: Result, llm: LLM, args: argparse.Namespace) -> Iterator[None]:
    """The trace on one engine, yielding after each batch of conversations so that the
    engines' batches can interleave (a shared machine's load then hits all of them alike)."""
    rng = random.Random(args.seed)
    engine = llm.engine
    result.device_blocks = engine.scheduler.kv_cache.num_blocks
    engine.subscribe(result)
    conversations = [
        Conversation([rng.randrange(10, 32000) for _ in range(args.system_tokens)])
        for _ in range(args.conversations)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    for turn in range(args.turns):
        for first in range(0, len(conversations), args.concurrency):
            start = time.perf_counter()
            batch = conversations[first : first + args.concurrency]
            ids = {}
            for conv in batch:
                conv.history += [rng.randrange(10, 32000) for _ in range(args.user_tokens)]
                ids[engine.add_request(None, list(conv.history), params)] = conv
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    conv = ids[out.request_id]
                    conv.history += out.outputs[0].token_ids
                    if turn > 0:
                        m = out.metrics
                        result.returning_ttft.append(m.first_token_time - m.arrival_time)
            result.wall_s += time.perf_counter() - start
            yield
    tier = engine.scheduler.kv_cache.host_tier
    if tier is not None:
        result.tier = {**vars(tier.stats), "bytes_moved": engine.tier_copier.bytes_moved}


def run_interleaved(traces: list[Iterator[None]]) -> None:
    """One batch of each trace in turn until all are done."""
    while traces:
        for trace in list(traces):
            if next(trace, StopIteration) is StopIteration:
                traces.remove(trace)


def time_block_copies(llm: LLM, num_blocks: int) -> dict[str, float]:
    """Milliseconds to store, and to load back (in the worker thread, waited for), one
    conversation's blocks: what a load takes off the step's critical path."""
    copier = llm.engine.tier_copier
    pairs = [(i, i) for i in range(num_blocks)]
    load = TierLoad("timing", pairs)
    times: dict[str, list[float]] = {"store": [], "load": []}
    for _ in range(20):
        start = time.perf_counter()
        copier.store(pairs)
        times["store"].append(time.perf_counter() - start)
        start = time.perf_counter()
        copier.start_load(load)
        while not copier.finished():
            copier.wait(0.01)
        times["load"].append(time.perf_counter() - start)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=192)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="pool / working set")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    final_tokens = args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)
    working_set = args.conversations * -(-final_tokens // BLOCK)
    pool = max(int(working_set * args.pool_fraction), args.concurrency * -(-final_tokens // BLOCK))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(f"{tmp}/ckpt", "LlamaForCausalLM", **SHAPE))
        common = dict(max_model_len=final_tokens + 16, max_num_seqs=args.concurrency)
        per_block = 2 * SHAPE["num_layers"] * SHAPE["num_kv_heads"] * 64 * BLOCK * 4
        tier_gib = 2 * working_set * per_block / (1 << 30)
        engines = {
            "none": dict(num_gpu_blocks_override=pool),
            "tier": dict(num_gpu_blocks_override=pool, kv_offloading_size=tier_gib),
            "infinite": dict(num_gpu_blocks_override=4 * working_set),
        }
        warm_up = argparse.Namespace(**{**vars(args), "turns": 1, "conversations": 4})
        run_interleaved(
            [run_trace(Result("warm-up"), LLM(path, **common, **engines["infinite"]), warm_up)]
        )
        results = {name: Result(name) for name in engines}
        llms = {name: LLM(path, **common, **extra) for name, extra in engines.items()}
        run_interleaved([run_trace(results[n], llms[n], args) for n in engines])
        copy_ms = time_block_copies(llms["tier"], -(-final_tokens // BLOCK))
    none, tier, inf = results["none"], results["tier"], results["infinite"]
    removed = 1 - (tier.prompt_tokens_computed - inf.prompt_tokens_computed) / max(
        none.prompt_tokens_computed - inf.prompt_tokens_computed, 1
    )
    print(
        f"working set {working_set} blocks, device pool {pool} blocks "
        f"({working_set / pool:.1f}x), {args.conversations} conversations x {args.turns} turns"
    )
    head = ("engine", "TTFT p50 ms", "p90 ms", "prompt tokens computed", "wall s")
    print("{:>9} {:>12} {:>8} {:>23} {:>7}".format(*head))
    for r in results.values():
        print(
            f"{r.name:>9} {1e3 * statistics.median(r.returning_ttft):>12.1f} "
            f"{1e3 * percentile(r.returning_ttft, 0.9):>8.1f} {r.prompt_tokens_computed:>23,} "
            f"{r.wall_s:>7.1f}"
        )
    p90 = {name: percentile(r.returning_ttft, 0.9) for name, r in results.items()}
    p50 = {name: statistics.median(r.returning_ttft) for name, r in results.items()}
    print(f"recomputed prompt tokens removed by the tier: {removed:.1%} (target >= 80%)")
    print(
        f"returning-turn TTFT p90: tier / infinite = {p90['tier'] / p90['infinite']:.2f}x "
        f"(target <= 1.5x), none / infinite = {p90['none'] / p90['infinite']:.2f}x"
    )
    print(
        f"returning-turn TTFT p50: tier / infinite = {p50['tier'] / p50['infinite']:.2f}x, "
        f"none / infinite = {p50['none'] / p50['infinite']:.2f}x"
    )
    print(f"tier: {tier.tier}")
    print(
        f"copying one conversation's {-(-final_tokens // BLOCK)} blocks: "
        f"store {copy_ms['store']:.2f} ms, load {copy_ms['load']:.2f} ms (median of 20)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "working_set_blocks": working_set,
                    "pool_blocks": pool,
                    "removed": removed,
                    "p90_ratio_tier_infinite": p90["tier"] / p90["infinite"],
                    "p50_ratio_tier_infinite": p50["tier"] / p50["infinite"],
                    "copy_ms": copy_ms,
                    "results": {k: vars(v) for k, v in results.items()},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
