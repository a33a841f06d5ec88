"""Cost of one routing decision: tokenize + hash + prefix lookup + score, 64 pods, 32k tokens.

The router is built in-process (no network): 64 pods with scraped-looking load, a precise
prefix index where some pods hold parts of the prompts, and the demo tokenizer. Prints
p50/p99 of the whole decision and of its parts, against the target p99 < 2 ms.

    .venv/bin/python benchmarks/router_decision.py [--pods 64] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagefleet.block_hash import hash_blocks
from pagefleet.cache import demo_checkpoint
from pagefleet.engine.model.loader import load_tokenizer
from pagefleet.kv_events import BlockStored
from pagefleet.router.app import Router, RouterConfig
from pagefleet.router.pods import PodRegistry
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scoring import Pipeline, Pod

WORDS = "cache block token page pool model serve request router engine queue".split()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(p / 100 * len(ordered)), len(ordered) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--decisions", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    tokenizer = load_tokenizer(demo_checkpoint())
    # Prompts of about --tokens tokens: shared system text, then a distinct tail.
    system = " ".join(rng.choice(WORDS) for _ in range(args.tokens // 2))
    prompts = []
    for i in range(args.prompts):
        tail = " ".join(rng.choice(WORDS) for _ in range(args.tokens // 2))
        prompts.append(f"{system} user{i} {tail}")
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    pods = [
        Pod(
            f"pod-{i}",
            f"http://10.0.0.{i}:8000",
            waiting=rng.randint(0, 8),
            kv_usage=rng.random(),
            inflight=rng.randint(0, 16),
        )
        for i in range(args.pods)
    ]
    registry = PodRegistry()
    registry.set_pods(pods)
    for st in registry.status.values():
        st.scraped_at = time.monotonic() + 1e9  # never stale during the run
    index = PrefixIndex("precise")
    for prompt in prompts:  # each prompt cached (in part) on a few pods
        hashes = hash_blocks(tokenizer.encode(prompt), 16)
        for pod in rng.sample(pods, 3):
            index.apply(
                pod.name, [BlockStored(hashes[: rng.randint(1, len(hashes))], None, [], 16)]
            )
    router = Router(registry, index, Pipeline.from_config(), RouterConfig(), tokenizer)
    parts = {"tokenize": [], "hash": [], "match": [], "total": []}
    for k in range(args.decisions):
        body = {"model": "m", "prompt": prompts[k % len(prompts)]}
        t0 = time.perf_counter()
        ids = router.prompt_tokens("/v1/completions", body)
        t1 = time.perf_counter()
        hashes = hash_blocks(ids, 16)
        t2 = time.perf_counter()
        index.match(hashes, time.monotonic())
        t3 = time.perf_counter()
        router.rank("/v1/completions", body)
        t4 = time.perf_counter()
        parts["tokenize"].append(t1 - t0)
        parts["hash"].append(t2 - t1)
        parts["match"].append(t3 - t2)
        parts["total"].append(t4 - t3)
    print(
        f"{args.pods} pods, prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"{args.decisions} decisions"
    )
    for name, values in parts.items():
        print(
            f"  {name:<9} p50 {statistics.median(values) * 1e3:7.3f} ms   "
            f"p99 {pct(values, 99) * 1e3:7.3f} ms"
        )
    total = parts["total"]
    print(
        f"decision p99 {pct(total, 99) * 1e3:.3f} ms (target < 2 ms): "
        f"{'met' if pct(total, 99) < 2e-3 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
