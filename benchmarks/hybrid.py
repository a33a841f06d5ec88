"""Hybrid linear attention (Qwen3.5), in one process on CPU:

speed: prefill tokens/s and the median decode step at 1k and 8k tokens of context, pagefleet
       (torch kernels, one request) against HF transformers (its torch fallbacks) on the same
       float32 checkpoint (~60M parameters: 8 layers, 3 Gated DeltaNet to 1 gated attention);
memory per sequence at 4k / 32k / 128k tokens: the seed's Qwen3.5-27B (bf16) from the
       capacity module, KV (16 attention layers, growing) against linear-attention state (48
       layers, constant) and against the same model with every layer attention; and a running
       engine on a scaled-down config of the same pattern (8 layers, heads and dims / 8),
       measured from what its sequence holds (blocks x block bytes + its state slot's bytes)
       against the capacity module's figure for that config.

  .venv/bin/python benchmarks/hybrid.py [--threads 1] [--contexts 1024,8192] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from pagefleet.common.capacity import GiB, ModelShape
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model.tiny import write_tiny_checkpoint

PATTERN = ["linear_attention"] * 3 + ["full_attention"]
SPEED_SHAPE = {
    "num_layers": 8,
    "layer_types": PATTERN * 2,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_heads": 8,
    "num_kv_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
}
# The seed's 27B (seed 003), as tests/test_hybrid.py's SEED_27B, and the same pattern / 8.
SEED_27B = {
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 248320,
    "layer_types": PATTERN * 16,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "torch_dtype": "bfloat16",
}
SCALED_SHAPE = {
    "num_layers": 8,
    "layer_types": PATTERN * 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 3,
    "num_kv_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 40_000,
}
MEMORY_CONTEXTS = (4096, 32_768, 131_072)


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


# ---------------------------------------------------------------------------- speed


def ours_speed(path: str, context: int, steps: int) -> tuple[float, float]:
    """(prefill tokens/s, median decode step seconds) of one request of `context` tokens."""
    llm = LLM(path, dtype="float32", max_model_len=context + steps + 8, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request("r", tokens(context), params)
    start = time.perf_counter()
    req = engine.scheduler.requests["r"]
    while req.num_output_tokens == 0:
        engine.step()
    prefill = context / (time.perf_counter() - start)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return prefill, statistics.median(times)


@torch.no_grad()
def hf_speed(path: str, context: int, steps: int) -> tuple[float, float]:
    """HF transformers on the same checkpoint: one forward over the prompt (with cache), then
    one token at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([tokens(context)])
    start = time.perf_counter()
    out = model(ids, use_cache=True)
    prefill = context / (time.perf_counter() - start)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(token, cache=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    return prefill, statistics.median(times)


def speed(root: Path, contexts: list[int], steps: int) -> list[dict]:
    path = str(write_tiny_checkpoint(root / "speed", "Qwen3_5ForCausalLM", **SPEED_SHAPE))
    rows = []
    for context in contexts:
        ours_prefill, ours_step = ours_speed(path, context, steps)
        hf_prefill, hf_step = hf_speed(path, context, steps)
        rows.append(
            {
                "context": context,
                "ours_prefill_tok_s": ours_prefill,
                "hf_prefill_tok_s": hf_prefill,
                "prefill_ratio": ours_prefill / hf_prefill,
                "ours_decode_step_ms": ours_step * 1e3,
                "hf_decode_step_ms": hf_step * 1e3,
                "decode_speedup": hf_step / ours_step,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ---------------------------------------------------------------------------- memory


def seed_memory() -> list[dict]:
    """Per sequence, from the capacity module: KV of the 16 attention layers, state of the 48
    linear ones, and KV if all 64 layers were attention (the dense counterfactual)."""
    hybrid = ModelShape.from_hf_config(SEED_27B)
    dense = ModelShape.from_hf_config({**SEED_27B, "layer_types": ["full_attention"] * 64})
    state = hybrid.state_bytes_per_slot()
    rows = []
    for context in MEMORY_CONTEXTS:
        kv = context * hybrid.kv_bytes_per_token("bf16")
        rows.append(
            {
                "context": context,
                "kv_gib": kv / GiB,
                "state_gib": state / GiB,
                "hybrid_gib": (kv + state) / GiB,
                "all_attention_gib": context * dense.kv_bytes_per_token("bf16") / GiB,
                "state_share": state / (kv + state),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_memory(root: Path, contexts: list[int]) -> list[dict]:
    """A running engine's sequence on the scaled-down config: its blocks x the pool's bytes
    per block, plus its state slot (the state pool's bytes / slots), once its prompt is in,
    against the capacity module's arithmetic for the same config."""
    path = write_tiny_checkpoint(root / "scaled", "Qwen3_5ForCausalLM", **SCALED_SHAPE)
    shape = ModelShape.from_hf_config(json.loads((path / "config.json").read_text()))
    rows = []
    for context in contexts:
        llm = LLM(str(path), dtype="float32", max_model_len=context + 8, max_num_seqs=1)
        engine = llm.engine
        runner = engine.runner
        engine.add_request("r", tokens(context), SamplingParams(max_tokens=2, ignore_eos=True))
        req = engine.scheduler.requests["r"]
        while req.num_computed_tokens < context:
            engine.step()
        block_bytes = runner.kv_pool.nbytes // runner.kv_pool.shape[3]
        pool = runner.state_pool
        slot_bytes = (pool.conv.nbytes + pool.ssm.nbytes) // pool.num_slots
        measured = len(req.block_ids) * block_bytes + slot_bytes
        planned = -(-context // 16) * shape.kv_bytes_per_block(16, 4) + shape.state_bytes_per_slot()
        rows.append(
            {
                "context": context,
                "engine_bytes": measured,
                "capacity_bytes": planned,
                "kv_bytes": len(req.block_ids) * block_bytes,
                "state_bytes": slot_bytes,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--memory-contexts", default="4096,32768")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        report = {
            "threads": torch.get_num_threads(),
            "memory_27b": seed_memory(),
            "memory_engine": engine_memory(root, [int(c) for c in args.memory_contexts.split(",")]),
            "speed": speed(root, [int(c) for c in args.contexts.split(",")], args.steps),
            "loadavg": os.getloadavg(),
        }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
