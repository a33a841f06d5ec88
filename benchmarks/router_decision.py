"""Cost of one routing decision: tokenize + hash + prefix lookup + score, 64 pods, 32k tokens.

The router is built in-process (no network): 64 pods with scraped-looking load, a precise
prefix index where some pods hold parts of the prompts, and the demo tokenizer. Two cases:
`continuing` (each prompt is an earlier prompt plus a new ~100-token turn: chats resend their
history, users share system prompts; the router's prompt cache tokenizes only the new part)
and `cold` (a 32k-token text never seen before: the tokenizer runs over all of it). Prints
p50/p99 of `Router.decide` (the whole decision) against the target p99 < 2 ms.

    .venv/bin/python benchmarks/router_decision.py [--pods 64] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagefleet.common.block_hash import hash_blocks
from pagefleet.common.kv_events import BlockStored
from pagefleet.common.tokenizer import load_tokenizer
from pagefleet.engine.cache import demo_checkpoint
from pagefleet.router.core import Router, RouterConfig
from pagefleet.router.pods import PodRegistry
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scoring import Pipeline, Pod

WORDS = "cache block token page pool model serve request router engine queue".split()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(p / 100 * len(ordered)), len(ordered) - 1)]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_router(args, tokenizer, rng) -> Router:
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
        st.ready = True  # as after a good scrape
    return Router(
        registry, PrefixIndex("precise"), Pipeline.from_config(), RouterConfig(), tokenizer
    )


def timed(router: Router, prompts: list[str]) -> list[float]:
    out = []
    for prompt in prompts:
        t0 = time.perf_counter()
        router.decide("/v1/completions", {"model": "m", "prompt": prompt})
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--decisions", type=int, default=400)
    parser.add_argument("--cold", type=int, default=30)
    args = parser.parse_args()
    rng = random.Random(0)
    tokenizer = load_tokenizer(demo_checkpoint())
    router = build_router(args, tokenizer, rng)
    # Conversations of ~--tokens tokens: a shared system text, then each its own history.
    system = words(rng, args.tokens // 2)
    convs = [f"{system} user{i} {words(rng, args.tokens // 2)}" for i in range(args.conversations)]
    pods = list(router.registry.status)
    for conv in convs:  # each conversation cached (in part) on a few pods, as events say
        hashes = hash_blocks(tokenizer.encode(conv), 16)
        for pod in rng.sample(pods, 3):
            router.index.apply(
                pod, [BlockStored(hashes[: rng.randint(1, len(hashes))], None, [], 16)]
            )
        router.decide("/v1/completions", {"model": "m", "prompt": conv})  # the router saw it
    continuing = []
    for k in range(args.decisions):  # each decision: a conversation grows by one turn
        i = k % len(convs)
        convs[i] = f"{convs[i]}\nuser: {words(rng, 60)}\nassistant: {words(rng, 40)}"
        continuing.append(convs[i])
    length = len(tokenizer.encode(continuing[-1]))
    warm = timed(router, continuing)
    cold = timed(router, [words(random.Random(100 + k), args.tokens) for k in range(args.cold)])
    print(f"{args.pods} pods, prompts of ~{length} tokens, precise index, default scorers")
    for name, values in (("continuing", warm), ("cold", cold)):
        p50, p99 = statistics.median(values) * 1e3, pct(values, 99) * 1e3
        print(f"  {name:<10} {len(values):4d} decisions  p50 {p50:7.3f} ms   p99 {p99:7.3f} ms")
    cache = router.prompt_cache
    print(f"prompt cache: {cache.hits}/{cache.lookups} lookups reused earlier text")
    p99 = pct(warm, 99)
    print(f"decision p99 {p99 * 1e3:.3f} ms (target < 2 ms): {'met' if p99 < 2e-3 else 'NOT met'}")


if __name__ == "__main__":
    main()
