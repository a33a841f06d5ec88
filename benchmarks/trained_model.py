"""Offline throughput on the trained demo model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to
float32: 30 layers, hidden 576, GQA 9/3 heads, vocabulary 49,152) against HF transformers
loading the same GGUF, in one run.

Both sides get the same seeded requests (random token prompts of 32-256 tokens, 32-128 output
tokens, ignore_eos, greedy). pagefleet runs them all at once through `LLM.generate`; the
baseline is HF `generate` on static left-padded batches, the best of a few batch sizes on a cut
of the workload. Throughput is useful output tokens per second. The model comes from `make
demo-model` (pagefleet's cache); nothing is downloaded.

    .venv/bin/python benchmarks/trained_model.py [--threads 2] [--requests 64] [--hf-cut 16]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from offline_throughput import hf_generate, run_engine

from pagefleet.common.demo_model import SMOLLM2, cache_dir, demo_model_path


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(32, 256))], rng.randint(32, 128))
        for _ in range(n)
    ]


def load_hf(path: Path):
    """transformers' own GGUF loading (gguf's dequantization), float32, with gguf's tensor-name
    map built once (transformers rebuilds that pure map per tensor: minutes on 2 cores)."""
    import gguf
    from transformers import AutoModelForCausalLM

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    finally:
        gguf.get_tensor_name_map = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-cut", type=int, default=16, help="requests per HF measurement")
    parser.add_argument("--hf-batch-sizes", default="4,8,16")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = demo_model_path(cache_dir())
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `make demo-model` first")
    requests = workload(args.requests, 49152)
    load_start = time.perf_counter()
    ours = run_engine(str(path), requests, max_num_seqs=args.requests, kv_cache_memory=1.0)
    print(f"pagefleet: {ours['tok_s']:.1f} tok/s ({ours['tokens']} tokens, {ours['wall_s']:.1f} s)")
    hf_load = time.perf_counter()
    model = load_hf(path)
    hf_load = time.perf_counter() - hf_load
    cut = requests[: args.hf_cut]
    hf_runs = [hf_generate(model, cut, int(b)) for b in args.hf_batch_sizes.split(",")]
    hf = max(hf_runs, key=lambda r: r["tok_s"])
    for run in hf_runs:
        print(f"HF batch {run['batch_size']}: {run['tok_s']:.1f} tok/s")
    speedup = ours["tok_s"] / hf["tok_s"]
    print(
        f"{SMOLLM2.served_name} ({len(requests)} requests): pagefleet {ours['tok_s']:.1f} tok/s, "
        f"HF best {hf['tok_s']:.1f} tok/s (batch {hf['batch_size']}, {len(cut)} requests) "
        f"-> x{speedup:.2f} (HF load {hf_load:.1f} s; run {time.perf_counter() - load_start:.0f} s)"
    )
    if args.json:
        result = {"ours": ours, "hf": hf, "hf_all": hf_runs, "speedup": speedup}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
