"""`--linear-path` on the trained model: plain (MKL) vs packed (oneDNN) vs auto (per shape, by
the start-up measurement) through the offline engine, in one process (issue 38).

Model: SmolLM2-135M-Instruct as a float32 checkpoint (benchmarks/quantization.py makes it once
from the demo GGUF). For each concurrency (1: single-stream decode; 16, 64: decode batches),
`concurrency` requests of 128 greedy tokens (`ignore_eos`) on short prompts; output tokens per
second of the whole generate(). The three engines are loaded once and run alternately, round
by round, so a neighbour's burst hits all alike; each cell is the best of its rounds and its
ratio is against plain in the same run. The machine line names the CPU and what it measured.

    .venv/bin/python benchmarks/linear_path.py [--rounds 3] [--concurrency 1,16,64]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
from offline_throughput import gemm_rate, memory_bandwidth
from quantization import trained_float_checkpoint

from pagefleet.common.demo_model import cache_dir
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.cpu_choice.measure import cpu_model

PATHS = ("plain", "packed", "auto")
TOKENS = 128


def rate(llm: LLM, concurrency: int) -> float:
    prompts = [[1, 9690, 28, 4211 + i, 30, 198] for i in range(concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    print(
        f"machine: {cpu_model()}, {args.threads} threads; fp32 GEMM {gemm_rate() / 1e9:.1f} "
        f"GFLOP/s, copy {memory_bandwidth() / 1e9:.1f} GB/s",
        flush=True,
    )
    path = str(trained_float_checkpoint(Path(cache_dir()) / "quantization"))
    engines = {}
    for name in PATHS:
        engines[name] = LLM(
            path,
            linear_path=name,
            max_model_len=512,
            max_num_seqs=max(levels),
            num_gpu_blocks_override=10 * max(levels) + 16,  # 134 tokens = 9 blocks each
        )
        rate(engines[name], 2)  # warm-up
        gc.collect()
    best: dict[tuple[str, int], float] = {}
    for r in range(args.rounds):
        for c in levels:
            order = PATHS if (r + c) % 2 == 0 else PATHS[::-1]
            for name in order:
                got = rate(engines[name], c)
                best[(name, c)] = max(best.get((name, c), 0.0), got)
                print(f"round {r} c={c} {name}: {got:.1f} tok/s", flush=True)
    print("\n| concurrency | plain tok/s | packed tok/s | auto tok/s | packed/plain | auto/plain |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in levels:
        plain, packed, auto = (best[(name, c)] for name in PATHS)
        print(
            f"| {c} | {plain:.1f} | {packed:.1f} | {auto:.1f} | {packed / plain:.2f}x "
            f"| {auto / plain:.2f}x |"
        )


if __name__ == "__main__":
    main()
