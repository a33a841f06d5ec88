"""The fleet experiment: does cache-aware routing beat round-robin on a chat-shaped trace?

8 simulated engines (`pagefleet serve --simulate`: real scheduler, KV cache, metrics and KV
events; a step-time model instead of a GPU) on 127.0.0.1, and four policies in one run:
  round-robin         the client rotates over the engines (a Kubernetes Service);
  queue-only          the router, scoring queue depth only;
  approximate-prefix  the router, remembering what it sent where;
  precise-prefix      the router, following every engine's KV events.
The seeded trace is shaped like llm-d's: groups of users share a long system prompt, each
user holds a multi-turn conversation that resends its growing history, and new users arrive
at a rate ramped in stages. Reported per policy: prefix-cache hit rate (from the engines'
counters) and its fraction of an oracle's, TTFT p50/p90/p99, output tokens/s, and max/mean
running requests across pods. TTFT CDFs go to docs/router_fleet_ttft.png.

    .venv/bin/python benchmarks/router_fleet.py [--engines 8] [--users 96]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
from procs import wait_healthy

from pagefleet.common.block_hash import hash_blocks
from pagefleet.engine.cache import demo_checkpoint
from pagefleet.fleet.up import free_port

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
BLOCK = 16
# A slow engine (2k prompt tokens/s) so that uncached prefills saturate round-robin here.
PROFILE = {
    "step_overhead_s": 0.01,
    "prefill_s_per_token": 0.0005,
    "decode_s_per_seq": 0.0002,
    "decode_s_per_kv_token": 1e-7,
    "num_gpu_blocks": 800,
}
POLICIES = ("round-robin", "queue-only", "approximate-prefix", "precise-prefix", "precise-kv-cost")
# Scorer weights per router policy (None: the router's defaults).
POLICY_SCORERS = {
    "queue-only": {"queue": 1.0},
    "precise-kv-cost": {"kv-cost": 1.0},
    "precise-mixed": {"prefix": 3.0, "kv-cost": 3.0, "queue": 2.0, "kv-usage": 2.0},
}


def build_trace(args, rng: random.Random) -> list[dict]:
    """Users: start time, group, and their turns' prompts (token ids) with the history."""
    systems = [
        [rng.randrange(16, 500) for _ in range(args.prefix_tokens)] for _ in range(args.groups)
    ]
    users, t = [], 0.0
    rates = [float(r) for r in args.rates.split(",")]
    per_stage = args.users // len(rates)
    for rate in rates:
        for _ in range(per_stage):
            t += rng.expovariate(rate)
            group = rng.randrange(args.groups)
            history = list(systems[group])
            turns = []
            for _ in range(args.turns):
                history += [rng.randrange(16, 500) for _ in range(args.user_tokens)]
                turns.append(list(history))
                history += [rng.randrange(16, 500) for _ in range(args.output_tokens)]
            users.append({"start": t, "turns": turns})
    return users


@contextlib.contextmanager
def engines(n: int, events: bool, timeout: float = 120.0):
    procs, urls, kv = [], [], []
    model = str(demo_checkpoint())
    try:
        for _ in range(n):
            port = free_port()
            flags = [
                "--simulate",
                "--simulate-profile",
                json.dumps(PROFILE),
                "--max-model-len",
                "4096",
                "--max-num-seqs",
                "64",
                "--served-model-name",
                "sim",
                "--log-stats-interval",
                "0",
            ]
            if events:
                ev = free_port()
                kv.append(f"tcp://127.0.0.1:{ev}")
                flags += [
                    "--kv-events-config",
                    json.dumps(
                        {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{ev}"}
                    ),
                ]
            procs.append(
                subprocess.Popen(
                    [PAGEFLEET, "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_healthy(url, timeout=timeout)
        yield urls, kv
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


@contextlib.contextmanager
def router(urls: list[str], kv: list[str], policy: str, tmp: Path):
    port = free_port()
    flags = ["--endpoints", ",".join(urls), "--host", "127.0.0.1", "--port", str(port)]
    if policy in POLICY_SCORERS:
        cfg = tmp / f"{policy}.yaml"
        cfg.write_text(json.dumps({"scorers": POLICY_SCORERS[policy]}))
        flags += ["--config", str(cfg)]
    if policy.startswith("precise"):
        flags += ["--prefix-index", "precise", "--kv-events-endpoints", ",".join(kv)]
    proc = subprocess.Popen(
        [PAGEFLEET, "router", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=120.0)
        time.sleep(0.5)  # a few scrapes
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def replay(users, targets: list[str], output_tokens: int, think: float):
    """Run the trace; returns per-request (send time, ttft, tokens) and running samples."""
    results, order = [], []
    rr = [0]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:

        async def request(prompt):
            url = targets[rr[0] % len(targets)]
            rr[0] += 1
            body = {
                "model": "sim",
                "prompt": prompt,
                "max_tokens": output_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            sent = time.perf_counter()
            order.append(prompt)
            ttft, tokens = None, 0
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"text"' in line:
                        tokens += 1
                        if ttft is None:
                            ttft = time.perf_counter() - sent
            results.append(
                (sent, ttft if ttft is not None else float("nan"), tokens, time.perf_counter())
            )

        async def user(u, t0):
            await asyncio.sleep(max(u["start"] - (time.perf_counter() - t0), 0))
            for prompt in u["turns"]:
                await request(prompt)
                await asyncio.sleep(think)

        t0 = time.perf_counter()
        await asyncio.gather(*(user(u, t0) for u in users))
    return results, order


async def sample_running(urls, stop: asyncio.Event, samples: list):
    async with httpx.AsyncClient(timeout=5) as c:
        while not stop.is_set():
            values = []
            for url in urls:
                with contextlib.suppress(httpx.HTTPError):
                    text = (await c.get(f"{url}/metrics")).text
                    for line in text.splitlines():
                        if line.startswith("vllm:num_requests_running{"):
                            values.append(float(line.rsplit(" ", 1)[1]))
            if len(values) == len(urls) and sum(values) >= len(values):
                samples.append(values)
            await asyncio.sleep(0.25)


def hit_rate(before: list[dict], after: list[dict]) -> float:
    """The engines' prefix-cache hit rate between two scrapes of every engine."""
    hits = queries = 0.0
    for a, b in zip(after, before, strict=True):
        hits += a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
        queries += a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
    return hits / max(queries, 1)


def oracle_hit_rate(order: list[list[int]], engines: int, capacity: int) -> float:
    """Every request to the pod holding its longest cached prefix (capacity as LRU)."""
    pods = [OrderedDict() for _ in range(engines)]
    hits = queries = 0
    for prompt in order:
        hashes = hash_blocks(prompt, BLOCK)
        best, best_len = 0, -1
        for i, pod in enumerate(pods):
            n = next((k for k, h in enumerate(hashes) if h not in pod), len(hashes))
            if n > best_len or (n == best_len and len(pod) < len(pods[best])):
                best, best_len = i, n
        hits += min(best_len * BLOCK, len(prompt))
        queries += len(prompt)
        pod = pods[best]
        for h in hashes:
            pod[h] = None
            pod.move_to_end(h)
        while len(pod) > capacity:
            pod.popitem(last=False)
    return hits / queries


def pct(values, p):
    values = sorted(v for v in values if v == v)
    return values[min(int(p / 100 * len(values)), len(values) - 1)] if values else float("nan")


def run_policy(policy: str, users, args, tmp: Path) -> dict:
    with engines(args.engines, events=policy.startswith("precise")) as (urls, kv):
        before = [scrape(u) for u in urls]
        ctx = router(urls, kv, policy, tmp) if policy != "round-robin" else contextlib.nullcontext()
        with ctx as router_url:
            targets = [router_url] if router_url else urls

            async def main():
                stop, samples = asyncio.Event(), []
                sampler = asyncio.ensure_future(sample_running(urls, stop, samples))
                results, order = await replay(users, targets, args.output_tokens, args.think)
                stop.set()
                await sampler
                return results, order, samples

            results, order, samples = asyncio.run(main())
        after = [scrape(u) for u in urls]
    ttfts = [r[1] for r in results]
    span = max(r[3] for r in results) - min(r[0] for r in results)
    return {
        "policy": policy,
        "hit_rate": hit_rate(before, after),
        "oracle_hit_rate": oracle_hit_rate(order, args.engines, PROFILE["num_gpu_blocks"]),
        "ttft_p50": pct(ttfts, 50),
        "ttft_p90": pct(ttfts, 90),
        "ttft_p99": pct(ttfts, 99),
        "output_tok_s": sum(r[2] for r in results) / span,
        # Over samples with at least one running request per pod on average: instantaneous
        # (sum of the busiest pod's running over sum of the mean pod's, load-weighted) and
        # over the run (the busiest pod's average running over the average pod's).
        "max_over_mean_running": sum(max(s) for s in samples)
        / max(sum(sum(s) / len(s) for s in samples), 1e-9),
        "run_max_over_mean_running": _run_balance(samples),
        "requests": len(results),
        "ttfts": ttfts,
    }


def _run_balance(samples: list[list[float]]) -> float:
    if not samples:
        return float("nan")
    per_pod = [sum(col) / len(samples) for col in zip(*samples, strict=True)]
    return max(per_pod) / max(sum(per_pod) / len(per_pod), 1e-9)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        values = sorted(v for v in row["ttfts"] if v == v)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=row["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF, 8 simulated engines, shared-prefix multi-turn trace")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--users", type=int, default=160)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rates", default="2,4,6,8", help="new users/s, one stage each")
    parser.add_argument("--think", type=float, default=0.5, help="seconds between turns")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="docs/router_fleet_ttft.png")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    users = build_trace(args, random.Random(args.seed))
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            row = run_policy(policy, users, args, Path(tmp))
            rows.append(row)
            print(
                f"{policy:<19} hit {row['hit_rate']:6.1%} "
                f"({row['hit_rate'] / row['oracle_hit_rate']:6.1%} of oracle "
                f"{row['oracle_hit_rate']:.1%})  TTFT p50/p90/p99 {row['ttft_p50']:.3f}/"
                f"{row['ttft_p90']:.3f}/{row['ttft_p99']:.3f} s  {row['output_tok_s']:7.1f} tok/s  "
                f"max/mean running {row['max_over_mean_running']:.2f} (instant) "
                f"{row['run_max_over_mean_running']:.2f} (run)",
                flush=True,
            )
    base = next((r for r in rows if r["policy"] == "round-robin"), None)
    if base:
        for r in rows:
            print(
                f"{r['policy']:<19} TTFT p90 x{base['ttft_p90'] / r['ttft_p90']:.1f} better "
                f"than round-robin; tokens/s x{r['output_tok_s'] / base['output_tok_s']:.2f}"
            )
    if args.plot:
        plot(rows, Path(args.plot))
    if args.json:
        Path(args.json).write_text(
            json.dumps([{k: v for k, v in r.items() if k != "ttfts"} for r in rows], indent=2)
        )


if __name__ == "__main__":
    main()
