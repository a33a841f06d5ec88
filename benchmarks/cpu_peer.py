"""pagefleet against llama.cpp's `llama-server` on the same GGUF file, through each one's
OpenAI API: the comparison CPU users make (issues 31 and 38).

Both servers load the same file with the same threads: an F32 file is float32 on both sides;
a Q8_0 or Q4_1 file keeps its codes on both (pagefleet's weight-only kernels, llama.cpp's
own). Each serves the same chat prompts, greedy, `max_tokens` N with `ignore_eos`, at each
concurrency, non-streaming; throughput is the output tokens over the round's wall time
(concurrency 1 is single-stream decode). Rounds interleave the servers (A then B, then B
then A) so a neighbour's burst falls on both, and each is idle while the other runs.

llama.cpp is not a project dependency: build `llama-server` from the sdist of
`llama-cpp-python` (it vendors llama.cpp; `cmake -B build && cmake --build build --target
llama-server -j 2`), and write an F32 file from a Hugging Face checkpoint with its
`convert_hf_to_gguf.py --outtype f32` (needs `sentencepiece`).

    .venv/bin/python benchmarks/cpu_peer.py --llama-server PATH/llama-server \\
        --gguf f32=smollm2-f32.gguf --gguf q4_1=SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import gemm_rate, memory_bandwidth
from procs import process, wait_healthy

from pagefleet.engine.cpu_choice.measure import cpu_model

TOPICS = (
    "the sea",
    "a lighthouse keeper",
    "bread",
    "a lost key",
    "autumn in a city",
    "a robot learning to paint",
    "the first snow",
    "a train at night",
)


def prompts(n: int) -> list[list[dict]]:
    """Distinct chat requests (beyond the template's shared prefix, no prefix-cache hits)."""
    return [
        [{"role": "user", "content": f"Write story {i} about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


def pagefleet_argv(gguf: str, port: int, slots: int, context: int, extra: str) -> list[str]:
    return [
        str(Path(sys.executable).parent / "pagefleet"),
        "serve",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "peer",
        "--max-num-seqs",
        str(slots),
        "--max-model-len",
        str(context),
        *extra.split(),
    ]


def llama_argv(binary: str, gguf: str, port: int, slots: int, context: int, threads: int):
    return [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * context),  # split evenly over the slots
        "--no-webui",
    ]


async def round_trip(url: str, chats: list[list[dict]], tokens: int, concurrency: int):
    """(output tokens, wall seconds) for `chats` sent `concurrency` at a time."""
    limit = asyncio.Semaphore(concurrency)
    produced = 0
    async with httpx.AsyncClient(
        base_url=url, timeout=1800, limits=httpx.Limits(max_connections=None)
    ) as client:

        async def one(messages: list[dict]) -> None:
            nonlocal produced
            body = {
                "model": "peer",
                "messages": messages,
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with limit:
                r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            got = r.json()["usage"]["completion_tokens"]
            if got != tokens:
                raise RuntimeError(f"{url} produced {got} tokens, not {tokens}")
            produced += got

        start = time.perf_counter()
        await asyncio.gather(*(one(m) for m in chats))
        return produced, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="path of the llama-server binary")
    parser.add_argument(
        "--gguf",
        action="append",
        required=True,
        metavar="NAME=FILE",
        help="a format's file, served by both (repeatable)",
    )
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--waves", type=int, default=2, help="requests = waves x concurrency")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--pagefleet-args", default="", help="more flags for pagefleet serve (one string)"
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    slots, context = max(levels), 128 + args.tokens
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, {args.threads} threads each; fp32 GEMM "
        f"{gemm_rate() / 1e9:.1f} GFLOP/s, copy {memory_bandwidth() / 1e9:.1f} GB/s",
        flush=True,
    )
    rows = []
    for spec in args.gguf:
        name, gguf = spec.split("=", 1)
        argvs = {
            "pagefleet": pagefleet_argv(gguf, 18301, slots, context, args.pagefleet_args),
            "llama.cpp": llama_argv(args.llama_server, gguf, 18302, slots, context, args.threads),
        }
        urls = {"pagefleet": "http://127.0.0.1:18301", "llama.cpp": "http://127.0.0.1:18302"}
        with contextlib.ExitStack() as stack:
            for who, argv in argvs.items():
                stack.enter_context(process(argv, stop_timeout=60, env=env))
                wait_healthy(urls[who], timeout=600)
                asyncio.run(round_trip(urls[who], prompts(2), 8, 2))  # warm-up
            rates: dict[tuple[str, int], list[float]] = {}
            for r in range(args.rounds):
                for c in levels:
                    order = list(urls) if (r + levels.index(c)) % 2 == 0 else list(urls)[::-1]
                    chats = prompts(max(c * args.waves, 3))
                    for who in order:
                        tokens, wall = asyncio.run(round_trip(urls[who], chats, args.tokens, c))
                        rate = tokens / wall
                        rates.setdefault((who, c), []).append(rate)
                        print(f"{name} round {r} c={c} {who}: {rate:.1f} tok/s", flush=True)
        for c in levels:
            ours, theirs = (max(rates[(who, c)]) for who in urls)
            rows.append((name, c, ours, theirs))
    print("\n| format | concurrency | pagefleet tok/s | llama.cpp tok/s | pagefleet / llama.cpp |")
    print("|---|---:|---:|---:|---:|")
    for name, c, ours, theirs in rows:
        print(f"| {name} | {c} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
