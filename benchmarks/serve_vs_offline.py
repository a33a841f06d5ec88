"""Throughput through HTTP (`pagefleet serve` + streaming clients) vs the offline `LLM`.

The same seeded workload both ways, at concurrency 64: 256 requests of 128 random prompt
tokens and 128 output tokens (greedy, ignore_eos), on the 57M-parameter random Llama-style
checkpoint of benchmarks/offline_throughput.py. Offline: `LLM(max_num_seqs=64).generate`.
HTTP: a server with max_num_seqs=64 on 127.0.0.1 and 64 concurrent streaming completions
clients. Prints both output-token rates and their ratio (target >= 0.85).

    .venv/bin/python benchmarks/serve_vs_offline.py [--requests 256] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
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
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model.tiny import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import SHAPE


def workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 32000) for _ in range(prompt_len)] for _ in range(n)]


def offline(path: str, prompts, output_len: int, concurrency: int) -> float:
    llm = LLM(path, max_model_len=1024, max_num_seqs=concurrency, kv_cache_memory=1)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


async def _clients(base: str, prompts, output_len: int, concurrency: int) -> tuple[int, float]:
    limit = asyncio.Semaphore(concurrency)
    tokens = 0
    async with httpx.AsyncClient(
        base_url=base, timeout=600, limits=httpx.Limits(max_connections=None)
    ) as client:

        async def one(prompt):
            nonlocal tokens
            body = {
                "model": "bench",
                "prompt": prompt,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with limit, client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens += usage["completion_tokens"]

        await one(prompts[0])  # warm-up
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return tokens, time.perf_counter() - start


def through_http(path: str, prompts, output_len: int, concurrency: int, port: int) -> float:
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "pagefleet"),
            "serve",
            path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "bench",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            str(concurrency),
            "--kv-cache-memory",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        tokens, wall = asyncio.run(_clients(base, prompts, output_len, concurrency))
        return tokens / wall
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    torch.set_num_threads(2)
    prompts = workload(args.requests, args.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(Path(tmp) / "bench", "LlamaForCausalLM", **SHAPE))
        off = offline(path, prompts, args.output_len, args.concurrency)
        http = through_http(path, prompts, args.output_len, args.concurrency, args.port)
    print(
        f"{args.requests} requests x {args.output_len} output tokens, concurrency "
        f"{args.concurrency}: offline {off:.1f} tok/s, HTTP {http:.1f} tok/s, "
        f"ratio {http / off:.3f}"
    )


if __name__ == "__main__":
    main()
