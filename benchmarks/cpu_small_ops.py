"""A float32 CPU step's small per-layer ops: torch's against the numba kernels the layers now
call (model/numba_ops.py), and the paged kernel's call planned per layer against once per step.

Per op, microseconds per call (one layer's worth), both sides alternated in rounds in one
process (a neighbour's burst falls on both) and the median of rounds kept:

- RMSNorm of the rows: `F.rms_norm` against the numba kernel;
- the rotary rotation of q and k, given as the strided views of a fused q/k/v output: the
  torch formula (swap the halves, two products, a sum; twice) against the numba kernel;
- the decode attention call of single-token rows: the kernel planned at each call (block
  tables and lengths converted, threads and context cuts worked out) against a plan made
  once for the step's layers (attention/numba_paged.py's `plan_kernel`).

At SmolLM2-135M's shape (hidden 576, 9 query heads and 3 KV heads of 64) and a Llama-3-8B
shape (4096, 32 and 8 of 128), at 1, 16, 64 and 512 rows (attention: 1, 16 and 64 decode
rows of 128 tokens each). "before" is torch's op (for the attention call: planned at each
call), "after" the kernel (planned once); the speed-up is before / after.

    .venv/bin/python benchmarks/cpu_small_ops.py [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagefleet.engine.attention.numba_paged import (
    NumbaAttentionBackend,
    decode_attention,
    plan_kernel,
    run_kernel,
)
from pagefleet.engine.cpu_choice.measure import cpu_model
from pagefleet.engine.model import numba_ops
from pagefleet.engine.model.rope import RotaryEmbedding, _rotate

SHAPES = {"SmolLM2-135M": (576, 9, 3, 64), "Llama-3-8B": (4096, 32, 8, 128)}
ROWS = (1, 16, 64, 512)
DECODE_ROWS = (1, 16, 64)
CONTEXT, BLOCK = 128, 16


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def alternate(old, new, rounds: int) -> tuple[float, float]:
    """Median microseconds per call of each, timed in alternating rounds after a warm-up."""
    calls = 1
    while per_call(old, calls) * calls < 20_000:  # ~20 ms a round
        calls *= 2
    per_call(new, calls)
    olds, news = [], []
    for _ in range(rounds):
        olds.append(per_call(old, calls))
        news.append(per_call(new, calls))
    return statistics.median(olds), statistics.median(news)


def norm_case(hidden: int, rows: int):
    x, weight = torch.randn(rows, hidden), torch.randn(hidden)
    return (
        lambda: F.rms_norm(x, (hidden,), weight, 1e-5),
        lambda: numba_ops.rms_norm(x, weight, 1e-5),
    )


def rotation_case(heads: int, kv_heads: int, head_dim: int, rows: int):
    params = {"rope_type": "default", "rope_theta": 10000.0}
    rotation = RotaryEmbedding(head_dim, 4096, params).at(torch.arange(rows), torch.float32)
    cos, sin = rotation.cos, rotation.sin
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    return (
        lambda: (_rotate(q, cos, sin), _rotate(k, cos, sin)),
        lambda: numba_ops.rotate(q, k, cos, sin),
    )


def attention_case(heads: int, kv_heads: int, head_dim: int, rows: int):
    per_row = CONTEXT // BLOCK
    k_cache = torch.randn(kv_heads, rows * per_row, BLOCK, head_dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(rows * per_row).view(rows, per_row)
    lens = torch.full((rows,), CONTEXT, dtype=torch.int64)
    q = torch.randn(rows, heads, head_dim)
    plan = plan_kernel(tables, lens, kv_heads)
    return (
        lambda: decode_attention(q, k_cache, v_cache, tables, lens, 0.125),
        lambda: run_kernel(q, k_cache, v_cache, plan, 0.125),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    NumbaAttentionBackend(torch.float32)  # compiles (or loads) the attention kernel
    numba_ops.warm_up()
    print(f"{cpu_model()}, {args.threads} threads, median of {args.rounds} rounds")
    print("| shape | op | rows | before us | after us | speed-up |")
    print("|---|---|---:|---:|---:|---:|")
    for name, (hidden, heads, kv_heads, head_dim) in SHAPES.items():
        cases = [("RMSNorm", rows, norm_case(hidden, rows)) for rows in ROWS]
        cases += [
            ("rotary q, k", rows, rotation_case(heads, kv_heads, head_dim, rows)) for rows in ROWS
        ]
        cases += [
            ("attention call", rows, attention_case(heads, kv_heads, head_dim, rows))
            for rows in DECODE_ROWS
        ]
        for op, rows, (old, new) in cases:
            before, after = alternate(old, new, args.rounds)
            print(
                f"| {name} | {op} | {rows} | {before:.1f} | {after:.1f} | {before / after:.2f}x |"
            )


if __name__ == "__main__":
    main()
