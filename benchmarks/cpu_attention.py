"""Decode attention on CPU, per layer: the torch backend's gather-then-matmul path vs the
in-place paged kernel (numba backend) vs the bytes-read floor.

The kernel is timed twice: as the backend runs it, and with each (request, KV head) read
whole by one thread ("whole"), as it ran before steps with few requests cut their contexts
into runs of blocks shared over the threads.

Shape of benchmarks/offline_throughput.py's 57M model: 8 query heads, 2 KV heads (GQA 4:1,
"8:2"), head_dim 64, float32, block size 16. For each context length (1k, 4k) and number of
decode requests (1, 8, 64): scattered block tables grouped as the runner groups decode rows,
both paths timed alternately in one process (so load on a shared machine hits both alike),
and reported as microseconds per decode token (one layer). Each timed call reads a different
set of blocks, rotating over at least 256 MiB of pool, so keys and values come from memory as
in a real step (8 layers) rather than from the cache.

Floor: the K+V bytes a decode token must read / the machine's copy bandwidth (measured here
as in offline_throughput.py: bytes read + written per second by a large copy).

    .venv/bin/python benchmarks/cpu_attention.py [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from offline_throughput import memory_bandwidth

from pagefleet.engine.attention.backend import single_groups
from pagefleet.engine.attention.numba_paged import (
    NumbaAttentionBackend,
    decode_attention,
    group_lens,
)
from pagefleet.engine.attention.torch_ref import TorchAttentionBackend

NUM_HEADS, NUM_KV, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
ROTATION_BYTES = 256 << 20


def decode_groups(num_requests: int, context: int, first_block: int, rng: random.Random):
    """The runner's single-row groups for num_requests decodes of `context` tokens, whose
    blocks are a shuffled range starting at first_block."""
    need = -(-context // BLOCK_SIZE)
    blocks = list(range(first_block, first_block + need * num_requests))
    rng.shuffle(blocks)
    tables = [blocks[i * need : (i + 1) * need] for i in range(num_requests)]
    lens = torch.full((num_requests,), context, dtype=torch.int64)
    return single_groups(tables, lens, BLOCK_SIZE, torch.device("cpu"))


class WholeContexts(NumbaAttentionBackend):
    """The kernel with contexts never cut (one thread per (request, KV head))."""

    def _single(self, q, k_cache, v_cache, group, scale, kv_scale):
        tables, lens = group.block_tables, group_lens(group)
        return decode_attention(q, k_cache, v_cache, tables, lens, scale, parts=1)


def time_case(num_requests: int, context: int, repeats: int, rng: random.Random) -> dict:
    need = -(-context // BLOCK_SIZE) * num_requests
    kv_bytes = 2 * NUM_KV * need * BLOCK_SIZE * HEAD_DIM * 4
    sets = max(4, -(-ROTATION_BYTES // kv_bytes))
    pool = torch.randn(2, NUM_KV, need * sets, BLOCK_SIZE, HEAD_DIM)
    k_cache, v_cache = pool[0], pool[1]
    step_groups = [decode_groups(num_requests, context, s * need, rng) for s in range(sets)]
    q = torch.randn(num_requests, NUM_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    paths = {
        "torch": TorchAttentionBackend(),
        "kernel": NumbaAttentionBackend(),
        "whole": WholeContexts(),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(repeats + 1):
        for j, (name, backend) in enumerate(paths.items()):
            # Each timed call reads blocks no other call read lately (not the set the path
            # before it just pulled into the cache).
            groups = step_groups[(i * len(paths) + j) % sets]
            start = time.perf_counter()
            for g in groups:
                backend._single(q[g.start : g.end], k_cache, v_cache, g, scale, None)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    read = 2 * NUM_KV * context * HEAD_DIM * 4  # K+V bytes per decode token
    return {
        "requests": num_requests,
        "context": context,
        "bytes_per_token": read,
        **{f"{name}_us": statistics.median(t) / num_requests * 1e6 for name, t in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = memory_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {args.threads} threads")
    print(
        f"{'context':>7} {'reqs':>4} | {'torch us':>9} {'kernel us':>9} {'whole us':>9} "
        f"{'floor us':>8} | {'torch/kernel':>12} {'whole/kernel':>12} {'floor/kernel':>12}"
    )
    rng = random.Random(0)
    rows = []
    for context in (1024, 4096):
        for num_requests in (1, 8, 64):
            row = time_case(num_requests, context, args.repeats, rng)
            row["floor_us"] = row["bytes_per_token"] / bandwidth * 1e6
            rows.append(row)
            print(
                f"{context:>7} {num_requests:>4} | {row['torch_us']:>9.1f} "
                f"{row['kernel_us']:>9.1f} {row['whole_us']:>9.1f} {row['floor_us']:>8.1f} | "
                f"{row['torch_us'] / row['kernel_us']:>11.2f}x "
                f"{row['whole_us'] / row['kernel_us']:>11.2f}x "
                f"{row['floor_us'] / row['kernel_us']:>11.0%}"
            )
    if args.json:
        args.json.write_text(json.dumps({"bandwidth": bandwidth, "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
