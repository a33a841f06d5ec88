"""Mixed workload, colocated vs disaggregated: do long prompts make ongoing streams stutter?

Two engines either way, on 127.0.0.1, behind the router, with the offline benchmark's 57M
checkpoint: (a) colocated, two `both` engines; (b) disaggregated, one prefill and one decode
engine (KV over NIXL or TCP). Load: `--chats` short chats streaming long answers all the time,
plus a long prompt every `--long-every` seconds. Prints TTFT (short and long requests) and
inter-token latency of the chats (p50/p90/p99), and the ratio of ITL p99 colocated /
disaggregated (the issue's target: disaggregated better under long-prompt pressure).

    .venv/bin/python benchmarks/pd_latency.py [--connector nixl] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import SHAPE
from router_fleet import _wait_healthy, free_port

from pagefleet.engine.model.tiny import write_tiny_checkpoint

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")


# The fleet secret the router and the engines share (as `pagefleet up` gives them one).
FLEET_ENV = {**os.environ, "PAGEFLEET_FLEET_SECRET": "benchmark-fleet-secret-0123456789"}


@contextlib.contextmanager
def processes(commands: list[list[str]]):
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=FLEET_ENV)
        for cmd in commands
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)


def engine_cmd(model: str, port: int, kv: dict | None) -> list[str]:
    cmd = [PAGEFLEET, "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--max-model-len", "2048", "--kv-cache-memory", "1"]
    if kv:
        cmd += ["--kv-transfer-config", json.dumps({**kv, "kv_port": free_port()})]
    return cmd


@contextlib.contextmanager
def fleet(model: str, mode: str, connector: str):
    ports = [free_port(), free_port()]
    if mode == "colocated":
        kvs, roles = [None, None], ["", ""]
    else:
        kvs = [
            {"kv_connector": connector, "kv_role": "kv_producer"},
            {"kv_connector": connector, "kv_role": "kv_consumer"},
        ]
        roles = ["@prefill", "@decode"]
    router_port = free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    endpoints = ",".join(u + r for u, r in zip(urls, roles, strict=True))
    with processes([engine_cmd(model, p, kv) for p, kv in zip(ports, kvs, strict=True)]):
        for u in urls:
            _wait_healthy(u, 300)
        router = [PAGEFLEET, "router", "--endpoints", endpoints, "--host", "127.0.0.1"]
        router += ["--port", str(router_port), "--pd-threshold-tokens", "256"]
        with processes([router]):
            base = f"http://127.0.0.1:{router_port}"
            _wait_healthy(base, 120)
            time.sleep(0.5)
            yield base


async def stream(client, base: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    stamps = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    if stamps:
        out["ttft"].append(stamps[0] - started)
        out["itl"].extend(b - a for a, b in itertools.pairwise(stamps))


async def run(base: str, args) -> dict:
    rng = random.Random(0)
    chats = {"ttft": [], "itl": []}
    longs = {"ttft": [], "itl": []}
    deadline = time.perf_counter() + args.seconds
    async with httpx.AsyncClient(timeout=600) as client:

        async def chat_user(i: int) -> None:
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(100, 30000) for _ in range(32)]
                await stream(client, base, prompt, args.chat_tokens, chats)

        async def long_prompts() -> None:
            tasks = []
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(100, 30000) for _ in range(args.long_tokens)]
                tasks.append(asyncio.ensure_future(stream(client, base, prompt, 16, longs)))
                await asyncio.sleep(args.long_every)
            await asyncio.gather(*tasks)

        await asyncio.gather(long_prompts(), *(chat_user(i) for i in range(args.chats)))
    return {"chats": chats, "longs": longs}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(int(p / 100 * len(values)), len(values) - 1)] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connector", default="nixl", choices=["nixl", "tcp"])
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--chats", type=int, default=6)
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=1536)
    parser.add_argument("--long-every", type=float, default=2.0)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(Path(tmp) / "bench", "LlamaForCausalLM", **SHAPE))
        for mode in ("colocated", "disaggregated"):
            with fleet(model, mode, args.connector) as base:
                rows[mode] = asyncio.run(run(base, args))
            r = rows[mode]
            print(
                f"{mode:<14} chats: TTFT p50/p99 {pct(r['chats']['ttft'], 50):.3f}/"
                f"{pct(r['chats']['ttft'], 99):.3f} s, ITL p50/p90/p99 "
                f"{pct(r['chats']['itl'], 50) * 1e3:.1f}/{pct(r['chats']['itl'], 90) * 1e3:.1f}/"
                f"{pct(r['chats']['itl'], 99) * 1e3:.1f} ms ({len(r['chats']['itl'])} gaps); "
                f"long prompts: {len(r['longs']['ttft'])}, TTFT p50/p99 "
                f"{pct(r['longs']['ttft'], 50):.3f}/{pct(r['longs']['ttft'], 99):.3f} s",
                flush=True,
            )
    co, dis = rows["colocated"]["chats"]["itl"], rows["disaggregated"]["chats"]["itl"]
    print(
        f"chat ITL p99 colocated / disaggregated: {pct(co, 99) / pct(dis, 99):.2f}x "
        f"(> 1 means disaggregation smooths streams under long prompts)"
    )


if __name__ == "__main__":
    main()
