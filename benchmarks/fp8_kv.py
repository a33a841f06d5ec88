"""FP8 KV cache against a 16-bit and a float32 cache, in one process, on offline_throughput.py's
57M-parameter checkpoint (float32 weights and the torch backend on CPU; with --device cuda,
bfloat16 weights, the Triton backend and CUDA graphs):
  capacity: KV tokens in the same memory (--kv-cache-memory on CPU, --gpu-memory-utilization on
            a GPU), from each engine's own start-up figures (the blocks it logs and schedules);
  step time: median decode step of a full batch, fp8 vs bfloat16 (and float32) cache, the
             engines taking turns over --rounds rounds;
  accuracy: top-1 agreement and mean |delta logprob| of the fp8 engine's greedy tokens against
            the float32 cache scoring the same sequences (teacher-forced), 3 x 100 tokens.

    .venv/bin/python benchmarks/fp8_kv.py [--threads 1] [--device cuda] [--json F]
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
    sched = engine.scheduler
    while engine.has_unfinished_requests():
        # Decode-only steps of the full batch: every request running and past its prompt.
        decode_only = len(sched.running) == batch and all(
            r.num_computed_tokens >= prompt for r in sched.running
        )
        start = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        if decode_only:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def startup_capacity(path: str, kv: str, common: dict) -> dict:
    """An engine's start-up capacity, alone in the process (a GPU engine sizes its pool from
    the memory left): the blocks it logs ("KV cache size: N tokens") and schedules, and the
    bytes of its pool. The engine is freed after."""
    llm = LLM(path, kv_cache_dtype=kv, **common)
    engine = llm.engine
    capacity = {
        "kv_tokens": engine.scheduler.kv_cache.num_blocks * engine.args.block_size,
        "pool_bytes": engine.runner.kv_pool.nbytes,
    }
    engine.close()
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return capacity


def interleaved_step_times(engines: dict[str, LLM], args: argparse.Namespace) -> dict[str, float]:
    """Median decode step of each engine over --rounds rounds, the engines taking turns within
    a round, so a change of load on a shared machine falls on all of them alike."""
    times: dict[str, list[float]] = {kv: [] for kv in engines}
    for _ in range(args.rounds):
        for kv, llm in engines.items():
            times[kv].append(decode_step_time(llm, args.batch, args.prompt, args.steps))
    return {kv: sorted(t)[len(t) // 2] for kv, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # One thread by default: on a shared 2-core box, two OpenMP threads spend most of a step
    # waiting at barriers for a descheduled sibling (measured: 870 ms decode steps, 38 ms alone).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB on CPU (0.25)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="(0.3)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
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
            results[kv] = startup_capacity(path, kv, common)
        # Step times: the engines side by side, with pools of the same (small) block count.
        blocks = args.batch * -(-(args.prompt + args.steps + 8) // 16) + 16
        # No prefix caching: each round prefills its prompts again, as the first did.
        stepping = dict(common, num_gpu_blocks_override=blocks, enable_prefix_caching=False)
        engines = {kv: LLM(path, kv_cache_dtype=kv, **stepping) for kv in kinds}
        for llm in engines.values():
            decode_step_time(llm, 2, 64, 4)  # warm-up (and Triton compilation on a GPU)
        for kv, step in interleaved_step_times(engines, args).items():
            results[kv]["step_s"] = step
        for llm in engines.values():
            llm.engine.close()
        del engines
        gc.collect()
        small = dict(common, max_num_batched_tokens=64, max_num_seqs=8, dtype="float32")
        reference = LLM(path, **small)
        for kv in ("bfloat16", "fp8"):  # bfloat16 measured the same way, for scale
            agreement, delta = fp8_agreement(
                LLM(path, kv_cache_dtype=kv, **small), reference, 3, 100
            )
            results[kv].update(top1_agreement=agreement, mean_abs_delta_logprob=delta)
    fp8, half = results["fp8"], results["bfloat16"]
    memory = f"{args.gpu_memory_utilization} of the GPU" if gpu else f"{args.kv_cache_memory} GiB"
    print(f"KV tokens at {memory} (engine start-up figures):")
    for kv in kinds:
        r = results[kv]
        print(f"  {kv:>8}: {r['kv_tokens']:,} tokens in {r['pool_bytes'] / 2**30:.3f} GiB")
    print(f"  fp8 / bfloat16 = {fp8['kv_tokens'] / half['kv_tokens']:.2f}x")
    print(
        f"decode step (median of {args.rounds} rounds x {args.steps} steps), {args.batch} "
        f"sequences of {args.prompt} tokens ({args.device}):"
    )
    for kv in kinds:
        print(f"  {kv:>8}: {1e3 * results[kv]['step_s']:.1f} ms")
    print(f"  fp8 / bfloat16 = {fp8['step_s'] / half['step_s']:.2f}x")
    print("against the float32 cache over 300 greedy tokens (teacher-forced):")
    for kv in ("bfloat16", "fp8"):
        r = results[kv]
        print(
            f"  {kv:>8}: top-1 agreement {r['top1_agreement']:.1%}, "
            f"mean |delta logprob| {r['mean_abs_delta_logprob']:.4f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
