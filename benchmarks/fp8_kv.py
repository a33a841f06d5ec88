"""FP8 KV cache against a 16-bit and a float32 cache, in one process, on offline_throughput.py's
57M-parameter checkpoint (float32 weights and the torch backend on CPU; with --device cuda,
bfloat16 weights, the Triton backend and CUDA graphs):
  capacity: KV tokens in the same memory (--kv-cache-memory on CPU, --gpu-memory-utilization on
            a GPU), from each engine's own start-up figures (the blocks it logs and schedules);
  step time: median decode step of a full batch, fp8 vs bfloat16 (and float32) cache;
  accuracy: top-1 agreement and mean |delta logprob| of the fp8 engine's greedy tokens against
            the float32 cache scoring the same sequences (teacher-forced), 3 x 100 tokens.

    .venv/bin/python benchmarks/fp8_kv.py [--threads 2] [--device cuda] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model.tiny import write_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import SHAPE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_fp8_kv_cache import fp8_agreement


def decode_step_time(llm: LLM, batch: int, prompt: int, steps: int) -> float:
    """Median seconds of a decode step once `batch` requests of `prompt` tokens are running."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine = llm.engine
    for _ in range(batch):
        engine.add_request(None, [rng.randrange(10, 32000) for _ in range(prompt)], params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        if all(r.num_computed_tokens >= prompt for r in engine.scheduler.running):
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def measure(path: str, kv: str, args: argparse.Namespace, common: dict) -> dict:
    """One engine's start-up capacity and decode step time; the engine is freed after."""
    llm = LLM(path, kv_cache_dtype=kv, **common)
    engine = llm.engine
    blocks = engine.scheduler.kv_cache.num_blocks  # what "KV cache size: N tokens" logs
    result = {
        "kv_tokens": blocks * engine.args.block_size,
        "pool_bytes": engine.runner.kv_pool.nbytes,
    }
    decode_step_time(llm, 2, 64, 4)  # warm-up (and Triton compilation on a GPU)
    result["step_s"] = decode_step_time(llm, args.batch, args.prompt, args.steps)
    engine.close()
    del llm, engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB on CPU (0.25)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gpu = args.device == "cuda"
    common = dict(
        device=args.device,
        dtype="bfloat16" if gpu else "float32",
        max_model_len=1024,
        max_num_seqs=args.batch,
        max_num_batched_tokens=2048,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=not gpu,
    )
    kinds = ("bfloat16", "fp8") if gpu else ("float32", "bfloat16", "fp8")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(f"{tmp}/ckpt", "LlamaForCausalLM", **SHAPE))
        for kv in kinds:
            results[kv] = measure(path, kv, args, common)
        small = dict(common, max_num_batched_tokens=64, max_num_seqs=8, dtype="float32")
        agreement, delta = fp8_agreement(
            LLM(path, kv_cache_dtype="fp8", **small), LLM(path, **small), 3, 100
        )
    results["fp8"].update(top1_agreement=agreement, mean_abs_delta_logprob=delta)
    fp8, half = results["fp8"], results["bfloat16"]
    memory = f"{args.gpu_memory_utilization} of the GPU" if gpu else f"{args.kv_cache_memory} GiB"
    print(f"KV tokens at {memory} (engine start-up figures):")
    for kv in kinds:
        r = results[kv]
        print(f"  {kv:>8}: {r['kv_tokens']:,} tokens in {r['pool_bytes'] / 2**30:.3f} GiB")
    print(f"  fp8 / bfloat16 = {fp8['kv_tokens'] / half['kv_tokens']:.2f}x")
    print(f"decode step, {args.batch} sequences of {args.prompt} tokens ({args.device}):")
    for kv in kinds:
        print(f"  {kv:>8}: {1e3 * results[kv]['step_s']:.1f} ms")
    print(f"  fp8 / bfloat16 = {fp8['step_s'] / half['step_s']:.2f}x")
    print(
        f"fp8 vs float32 cache over 300 greedy tokens: top-1 agreement {agreement:.1%}, "
        f"mean |delta logprob| {delta:.4f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
