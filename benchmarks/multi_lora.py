"""Multi-LoRA throughput: one engine serving requests spread over 1, 4 and 16 LoRA adapters in
the same steps, against the same requests on the base model alone (the baseline, measured in
the same run).

CPU, float32, the 57M-parameter random Llama-style checkpoint of offline_throughput.py (hidden
512, intermediate 1536, 8 layers). Adapters are random PEFT adapters written with `peft`
(rank 8 by default, all seven projections, B random so every adapter changes the output).
Every adapter is resident (`--max-loras` = the number of adapters): the cost measured is the
batched shrink/expand of each step, not adapter swapping. Requests are seeded, greedy and
`ignore_eos`; request i uses adapter i mod k. Prints output tokens/s per case and its ratio
to the base model's.

Then the LoRA delta alone (engine/lora/ops.py) on one q/k/v-shaped layer of that model: the
CPU path (`segments`: a GEMM pair per adapter in the step) and the reference (`gathered`:
each row's weights gathered, batched matrix-vector products), against the layer's own GEMM.

Then the fleet trace (benchmarks/lora_fleet_sim.py: the router's scoring pipeline over
simulated engines; seconds, no model): per-tenant adapters routed with and without the
lora-affinity scorer, with and without a per-tenant shared system prompt; hit rate, adapter
loads, TTFT p50/p90.

    .venv/bin/python benchmarks/multi_lora.py [--threads 2] [--requests 48] [--max-tokens 48]
        [--fleet-only]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from lora_fleet_sim import FleetParams, run_fleet

from pagefleet.engine import LLM, LoRARequest, SamplingParams
from pagefleet.engine.lora.ops import KERNELS, LoRABatch
from pagefleet.engine.model.tiny import write_tiny_checkpoint

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    vocab_size=32000,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_COUNTS = (1, 4, 16)


def write_adapters(base: str, root: Path, count: int, rank: int) -> list[str]:
    """`count` random PEFT adapters of `base`, saved by peft itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    paths = []
    for i in range(count):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_pretrained(base)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
        )
        folder = root / f"adapter{i}"
        get_peft_model(model, config).save_pretrained(str(folder))
        paths.append(str(folder))
    return paths


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 32000) for _ in range(rng.randint(32, 128))] for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, names: list[str | None]) -> float:
    """Output tokens/s of one generate() over every prompt (after a short warm-up)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    loras = [None if n is None else LoRARequest(n, 0, "") for n in names]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), False, loras[:2])
    start = time.perf_counter()
    outs = llm.generate(prompts, params, False, loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def engine(base: str, **lora) -> LLM:
    return LLM(base, max_model_len=512, max_num_seqs=64, max_num_batched_tokens=2048, **lora)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--fleet-only", action="store_true", help="only the fleet trace")
    args = parser.parse_args()
    results = {} if args.fleet_only else {**throughput(args), **delta_kernels(args.rank)}
    for shared in (32, 0):
        print(f"fleet trace: 4 pods, 2 slots each, 16 tenants, 10 req/s, {shared} shared blocks")
        fleet = run_fleet(FleetParams(rate=10.0, max_loras=2, system_blocks=shared))
        results.update({f"fleet {shared} {k}": vars(v) for k, v in fleet.items()})
    print(f"load average: {Path('/proc/loadavg').read_text().strip()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _best_of(fn, repeats: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def delta_kernels(rank: int, rows: int = 64) -> dict:
    """Seconds of one layer's LoRA delta (shrink + expand) for `rows` decode rows spread over
    k adapters, per kernel, and the ratio to the layer's base GEMM (q/k/v fused: 512 -> 768)."""
    hidden, out, parts = SHAPE["hidden_size"], 768, 3
    width = parts * rank
    slots = max(ADAPTER_COUNTS)
    x, w = torch.randn(rows, hidden), torch.randn(out, hidden)
    a, b = torch.randn(slots * width, hidden), torch.randn(out, slots * width)
    base = _best_of(lambda: x @ w.t())
    results = {}
    present = [True] * slots
    for k in ADAPTER_COUNTS:
        batch = LoRABatch.build([i % k for i in range(rows)], x.device)
        for name, kernels in KERNELS.items():

            def delta(kernels=kernels, batch=batch):
                y = torch.zeros(rows, out)
                t = kernels.shrink(x, a, batch, width, present)
                kernels.expand(t, b, batch, width, present, y)

            seconds = _best_of(delta)
            results[f"delta {name} {k}"] = seconds
            print(
                f"LoRA delta, {k:2d} adapters over {rows} rows, {name}: {seconds * 1e6:.0f} us "
                f"({seconds / base:.2f}x the layer's base GEMM, {base * 1e6:.0f} us)",
                flush=True,
            )
    return results


def throughput(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    prompts = workload(args.requests)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "base")
        write_tiny_checkpoint(base, **SHAPE)
        adapters = write_adapters(base, Path(tmp), max(ADAPTER_COUNTS), args.rank)
        base_rates = []

        def base_alone() -> None:
            llm = engine(base)
            try:
                base_rates.append(run(llm, prompts, args.max_tokens, [None] * len(prompts)))
            finally:
                llm.engine.close()
            print(f"base model alone: {base_rates[-1]:.1f} tok/s", flush=True)

        base_alone()  # and again after the adapters: the better of the two is the baseline
        for k in ADAPTER_COUNTS:
            modules = [f"a{i}={adapters[i]}" for i in range(k)]
            llm = engine(
                base,
                enable_lora=True,
                max_loras=k,
                max_lora_rank=args.rank,
                lora_modules=modules,
            )
            try:
                names = [f"a{i % k}" for i in range(len(prompts))]
                results[f"{k} adapters"] = run(llm, prompts, args.max_tokens, names)
            finally:
                llm.engine.close()
            print(f"{k:2d} adapters mixed: {results[f'{k} adapters']:.1f} tok/s", flush=True)
        base_alone()
    results["base"] = max(base_rates)
    for k in ADAPTER_COUNTS:
        rate = results[f"{k} adapters"]
        print(f"{k:2d} adapters mixed / base alone: {rate / results['base']:.2f}x")
    return results


if __name__ == "__main__":
    main()
