"""What the router adds to a request: the same requests sent straight to one engine and through
`pagefleet router --tokenizer`, in interleaved rounds (issue 23).

One `pagefleet serve --simulate` engine (default profile) on 127.0.0.1 and one router in front
of it with the demo model's tokenizer. Three load shapes, each run as rounds that alternate
direct / router (which goes first alternates too), so a load swing on this shared machine hits
both paths alike:
  poisson  completions at 40 req/s (Poisson), ~256-token random prompts, 64 output tokens;
  burst    64 completions sent at once;
  chat     streaming chat completions at 20 req/s;
  light    completions at 5 req/s (the router's own latency, little queueing).
Both paths get the same prompts, each with a path tag in front (so the second path's prompts
miss the engine's prefix cache exactly as the first's did). Reported per shape and path: TTFT
p50/p90/p99, ITL p50/p99, output tokens/s; then router - direct TTFT, router / direct ratios,
and CPU seconds per request of the router, the engine and this client (from /proc/<pid>/stat
and os.times), which shows what the machine's cores had left.

    .venv/bin/python benchmarks/router_overhead.py [--quick] [--json out.json]
    .venv/bin/python benchmarks/router_overhead.py --profile /tmp/router.prof --shapes burst

`--profile` runs the router's event-loop thread under cProfile (slower: for finding where the
time goes, not for the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
from procs import process, wait_healthy

from pagefleet.engine.cache import demo_checkpoint
from pagefleet.fleet.bench_serve import RequestResult, build_dataset, one_request
from pagefleet.fleet.up import free_port

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
PATHS = ("direct", "router")
# Run the router's CLI under cProfile, timing the event-loop thread's CPU (not wall time: on a
# loaded machine preemption would land on whatever ran). Uvicorn shuts down on SIGTERM, then
# raises it again with the handler it found: a handler that exits lets the stats be written.
PROFILED = (
    "import cProfile, signal, sys, time; from pagefleet.common.cli import main; "
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); out = sys.argv.pop(1); "
    "sys.argv[0] = 'pagefleet'; prof = cProfile.Profile(time.thread_time)\n"
    "try:\n    prof.runcall(main)\nexcept SystemExit:\n    pass\nprof.dump_stats(out)"
)


@dataclass(frozen=True)
class Shape:
    name: str
    endpoint: str  # chat | completions
    requests: int  # per path, over all rounds
    rate: float  # req/s; inf: all at once
    # Words of bench_serve's random text: the demo tokenizer makes ~2.6 tokens a word, so 98
    # words are ~256 prompt tokens, the prompts (256 words, ~660 tokens, saturate the
    # simulated engine at 40 req/s: its queue, not the router, then sets TTFT).
    input_len: int = 98
    output_len: int = 64


@dataclass
class PathStats:
    results: list[RequestResult] = field(default_factory=list)
    seconds: float = 0.0  # wall time of this path's rounds
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in its rounds


def shapes(quick: bool) -> list[Shape]:
    scale = 3 if quick else 1
    return [
        Shape("poisson", "completions", 300 // scale, 40.0),
        Shape("burst", "completions", 256 // scale, float("inf")),
        Shape("chat", "chat", 150 // scale, 20.0),
        # Light load (the engine mostly idle): the router's own latency, without the queueing
        # that 40 req/s builds in front of the simulated engine.
        Shape("light", "completions", 60 // scale, 5.0),
    ]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / CLOCK_TICK


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def engine_cmd(port: int) -> list[str]:
    cmd = [PAGEFLEET, "serve", str(demo_checkpoint()), "--host", "127.0.0.1", "--port", str(port)]
    return [*cmd, "--simulate", "--served-model-name", "sim", "--log-stats-interval", "0"]


def router_cmd(port: int, engine: str, profile: str | None) -> list[str]:
    head = [sys.executable, "-c", PROFILED, profile] if profile else [PAGEFLEET]
    args = ["router", "--endpoints", engine, "--host", "127.0.0.1", "--port", str(port)]
    return [*head, *args, "--tokenizer", str(demo_checkpoint())]


def tagged(batch: list[list[dict]], tag: str) -> list[list[dict]]:
    return [[{**m, "content": f"{tag} {m['content']}"} for m in conv] for conv in batch]


async def run_round(
    client: httpx.AsyncClient, shape: Shape, batch: list[list[dict]], gaps: list[float]
) -> tuple[list[RequestResult], float]:
    args = SimpleNamespace(model="sim", output_len=shape.output_len, endpoint=shape.endpoint)
    started = time.perf_counter()
    tasks = []
    for messages, gap in zip(batch, gaps, strict=True):
        tasks.append(asyncio.ensure_future(one_request(client, args, messages)))
        if gap:
            await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - started


async def run_shape(
    shape: Shape,
    urls: dict[str, str],
    pids: dict[str, int],
    rounds: int,
    seed,
    paths: tuple[str, ...] = PATHS,
):
    dataset = build_dataset(
        SimpleNamespace(
            dataset="random", num_prompts=shape.requests, input_len=shape.input_len, seed=seed
        )
    )
    convs = [[{"role": "user", "content": c.turns[0]}] for c in dataset]
    per_round = -(-len(convs) // rounds)
    rng = random.Random(seed + 1)
    stats = {p: PathStats() for p in paths}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(120.0, connect=30.0)
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            p: await stack.enter_async_context(
                httpx.AsyncClient(base_url=urls[p], timeout=timeout, limits=limits)
            )
            for p in paths
        }
        warm = convs[: min(16, len(convs))]
        for p in paths:  # open connections, warm the tokenizer and the prompt cache
            await run_round(clients[p], shape, tagged(warm, f"warm-{p}"), [0.0] * len(warm))
        for r in range(rounds):
            batch = convs[r * per_round : (r + 1) * per_round]
            if not batch:
                break
            if shape.rate == float("inf"):
                gaps = [0.0] * len(batch)
            else:
                gaps = [rng.expovariate(shape.rate) for _ in batch]
            order = paths if r % 2 == 0 else paths[::-1]
            for p in order:
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                client_before = own_cpu()
                results, seconds = await run_round(clients[p], shape, tagged(batch, p), gaps)
                s = stats[p]
                s.results += results
                s.seconds += seconds
                for name, pid in pids.items():
                    s.cpu[name] = s.cpu.get(name, 0.0) + cpu_seconds(pid) - before[name]
                s.cpu["client"] = s.cpu.get("client", 0.0) + own_cpu() - client_before
    return stats


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(round(p / 100 * (len(ordered) - 1)), len(ordered) - 1)]


def summarize(stats: PathStats) -> dict:
    ok = [r for r in stats.results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    n = len(stats.results)
    return {
        "requests": n,
        "failed": n - len(ok),
        "errors": sorted({r.error for r in stats.results if not r.ok})[:3],
        "ttft_ms": {f"p{p}": pct(ttft, p) * 1e3 for p in (50, 90, 99)},
        "itl_ms": {f"p{p}": pct(itl, p) * 1e3 for p in (50, 99)},
        "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / len(ok) if ok else 0,
        "output_tok_s": sum(r.output_tokens for r in ok) / stats.seconds if stats.seconds else 0,
        "cpu_ms_per_request": {k: v / n * 1e3 for k, v in stats.cpu.items()} if n else {},
        "cpu_cores_busy": {k: v / stats.seconds for k, v in stats.cpu.items()},
        "seconds": stats.seconds,
    }


def report(name: str, summary: dict[str, dict]) -> None:
    d, r = summary["direct"], summary["router"]
    print(f"\n== {name}: {d['requests']} requests a path ({d['failed']}/{r['failed']} failed)")
    for p in PATHS:
        s = summary[p]
        t, i = s["ttft_ms"], s["itl_ms"]
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in s["cpu_ms_per_request"].items())
        busy = sum(s["cpu_cores_busy"].values())
        print(
            f"  {p:>6}: TTFT p50/p90/p99 {t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f} ms; "
            f"ITL p50/p99 {i['p50']:.2f} / {i['p99']:.2f} ms; {s['output_tok_s']:.0f} tok/s; "
            f"prompt {s['prompt_tokens_mean']:.0f} tokens; "
            f"CPU ms/request: {cpu}; cores busy {busy:.2f}"
        )
        if s["errors"]:
            print(f"          errors: {s['errors']}")
    added = {k: r["ttft_ms"][k] - d["ttft_ms"][k] for k in d["ttft_ms"]}
    ratio = {k: r["ttft_ms"][k] / d["ttft_ms"][k] for k in d["ttft_ms"]}
    print(
        f"  router - direct TTFT p50/p90/p99: {added['p50']:+.1f} / {added['p90']:+.1f} / "
        f"{added['p99']:+.1f} ms; ratio {ratio['p50']:.2f} / {ratio['p90']:.2f} / "
        f"{ratio['p99']:.2f}x; throughput ratio {r['output_tok_s'] / d['output_tok_s']:.3f}x; "
        f"router CPU {net_router_cpu_ms(summary):.2f} ms/request (net of its idle scraping)"
    )
    summary["added_ttft_ms"], summary["ttft_ratio"] = added, ratio
    summary["throughput_ratio"] = r["output_tok_s"] / d["output_tok_s"]


def net_router_cpu_ms(summary: dict[str, dict]) -> float:
    """The router's CPU per routed request, less what it spends anyway (scraping the engine,
    measured while the direct rounds ran) over the router rounds' time."""
    d, r = summary["direct"], summary["router"]
    idle = d["cpu_cores_busy"].get("router", 0.0) * r["seconds"]
    return r["cpu_ms_per_request"].get("router", 0.0) - idle / r["requests"] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a third of the requests")
    parser.add_argument("--shapes", default="poisson,burst,chat,light")
    parser.add_argument("--rounds", type=int, default=None, help="per shape (poisson 6, else 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the summaries here")
    parser.add_argument("--profile", default=None, help="cProfile the router's loop into this")
    args = parser.parse_args()
    wanted = args.shapes.split(",")
    ports = {"engine": free_port(), "router": free_port()}
    urls = {p: f"http://127.0.0.1:{port}" for p, port in ports.items()}
    urls["direct"] = urls["engine"]
    out = {}
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores")
    with process(engine_cmd(ports["engine"])) as engine:
        wait_healthy(urls["engine"])
        with process(router_cmd(ports["router"], urls["engine"], args.profile)) as router:
            wait_healthy(urls["router"])
            time.sleep(0.5)  # a few scrapes
            pids = {"router": router.pid, "engine": engine.pid}
            for shape in shapes(args.quick):
                if shape.name not in wanted:
                    continue
                rounds = args.rounds or (6 if shape.name == "poisson" else 4)
                stats = asyncio.run(run_shape(shape, urls, pids, rounds, args.seed))
                out[shape.name] = {p: summarize(s) for p, s in stats.items()}
                report(shape.name, out[shape.name])
    print(f"load average {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
