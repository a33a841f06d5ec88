"""Decode step time of a TP=2 engine against TP=1 on this CPU, and the share of rank 0's step
spent in collectives (all-reduces, the logits gather, the step broadcast).

Both engines serve the same random Llama-shaped checkpoint (4 layers, hidden 512, 8 heads, 2 KV
heads, vocab 32000) in float32. TP=1 runs with every core; TP=2 runs two ranks of
cores / 2 threads each (gloo). For each decode batch, the requests' prompts are prefilled
first, then `--steps` decode steps are timed. Also the cost of encoding one step's inputs for
the broadcast (a decode batch of 64), which replaces pickling.

    .venv/bin/python benchmarks/tp_overhead.py [--steps 40] [--batches 1,8,32,64]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.distributed.group import CollectiveTimer
from pagefleet.engine.distributed.step_codec import encode_step
from pagefleet.engine.model.tiny import write_tiny_checkpoint

PROMPT_LEN = 64
SHAPE = {
    "num_layers": 4,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_heads": 8,
    "num_kv_heads": 2,
    "vocab_size": 32000,
}


def _prefill(llm: LLM, batch: int, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(5, 30000) for _ in range(PROMPT_LEN)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.num_waiting
    ):
        engine.step()


def measure(llm: LLM, batch: int, steps: int) -> tuple[float, CollectiveTimer | None]:
    """Mean decode step seconds over `steps`, and rank 0's collective time (TP>1)."""
    engine = llm.engine
    _prefill(llm, batch, steps + 8, seed=batch)
    for _ in range(3):  # warm-up decode steps
        engine.step()
    group = getattr(engine.runner, "group", None)
    timer = CollectiveTimer() if group is not None else None
    if group is not None:
        group.timer = timer
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    if group is not None:
        group.timer = None
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps, timer


def encode_cost(llm: LLM, batch: int = 64, repeats: int = 200) -> float:
    """Microseconds to encode one decode step of `batch` rows for the broadcast (leaves the
    engine mid-step: call it last)."""
    engine = llm.engine
    _prefill(llm, batch, 4, seed=99)
    out = engine.scheduler.schedule()
    inputs = engine.runner.prepare(out)
    start = time.perf_counter()
    for _ in range(repeats):
        encode_step(inputs.input_ids, inputs.positions, inputs.meta, inputs.sample_rows)
    return (time.perf_counter() - start) / repeats * 1e6  # the engine is not stepped again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batches", default="1,8,32,64")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cores = os.cpu_count() or 1
    engine_args = {"max_model_len": 512, "num_gpu_blocks_override": 1024, "max_num_seqs": 64}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(tmp, "LlamaForCausalLM", **SHAPE))
        torch.set_num_threads(cores)
        one = LLM(path, **engine_args)
        tp1 = {b: measure(one, b, args.steps)[0] for b in batches}
        torch.set_num_threads(max(1, cores // 2))  # rank 0's share; rank 1 takes the rest
        two = LLM(path, tensor_parallel_size=2, **engine_args)
        try:
            tp2 = {b: measure(two, b, args.steps) for b in batches}
            encode_us = encode_cost(one)
        finally:
            two.engine.close()
    print(f"cores: {cores}; TP=1 {cores} threads, TP=2 {max(1, cores // 2)} per rank")
    print(
        "| decode batch | TP=1 step ms | TP=2 step ms | TP=2 / TP=1 | collectives share | "
        "all-reduce ms | gather ms | broadcast ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        step2, timer = tp2[b]
        per = {k: v / args.steps * 1e3 for k, v in timer.seconds.items()}
        share = timer.total() / args.steps / step2
        print(
            f"| {b} | {tp1[b] * 1e3:.2f} | {step2 * 1e3:.2f} | {step2 / tp1[b]:.2f} | "
            f"{share:.0%} | {per.get('all_reduce', 0):.2f} | {per.get('gather', 0):.2f} | "
            f"{per.get('broadcast', 0):.2f} |"
        )
    print(f"encoding a decode step of 64 rows for the broadcast: {encode_us:.0f} µs")


if __name__ == "__main__":
    main()
