"""Offline throughput: pagefleet's LLM vs HF transformers `generate`, and vs this machine's floor.

One run, float32 on CPU (2 threads by default), one random Llama-style checkpoint of ~57M
parameters (hidden 512, intermediate 1536, 8 layers, 8 heads, 2 KV heads, vocab 32000) and
the same seeded requests (ignore_eos, greedy) for both sides:
  (a) chat-like:     200 prompts of 32-512 tokens, 16-128 output tokens;
  (b) decode-heavy:  256 prompts of 16-128 tokens, 128-512 output tokens.
Baseline: HF `generate` on static left-padded batches (best of a few batch sizes), measured on
a cut of each workload to keep the run short; throughput is useful output tokens per second.
Floor: max(useful FLOPs / fp32 GEMM rate, bytes that must be read / memory bandwidth), with the
GEMM rate and the bandwidth measured in the same run.

    .venv/bin/python benchmarks/offline_throughput.py [--threads 2] [--hf-cut 48]
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

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.cpu_choice.measure import cpu_model
from pagefleet.engine.model.tiny import write_tiny_checkpoint

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    vocab_size=32000,
)


def workload(name: str, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if name == "a":
        n, prompt_range, out_range = 200, (32, 512), (16, 128)
    else:
        n, prompt_range, out_range = 256, (16, 128), (128, 512)
    return [
        (
            [rng.randrange(10, 32000) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*out_range),
        )
        for _ in range(n)
    ]


# ---------------------------------------------------------------- the machine's floor


def gemm_rate(seconds: float = 2.0) -> float:
    """fp32 FLOP/s of a large matmul, the best this machine does."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return n * 2 * 2048**3 / (time.perf_counter() - start)


def memory_bandwidth(seconds: float = 2.0) -> float:
    """Bytes/s read+written by a large copy (256 MiB, well beyond the caches)."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        dst.copy_(src)
        n += 1
    return n * 2 * src.numel() * 4 / (time.perf_counter() - start)


def useful_work(requests, cfg: dict) -> tuple[float, float]:
    """(FLOPs, bytes) a perfect engine must spend: matmuls for every prompt and output token
    (logits only where a token is sampled), attention over each token's context; weights read
    once per decode step of a full batch, KV written and read once per token."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_layers"]
    heads, kv_heads, vocab = cfg["num_heads"], cfg["num_kv_heads"], cfg["vocab_size"]
    d = h // heads
    per_layer = h * (h + 2 * kv_heads * d) + h * h + 3 * h * inter
    layer_params = layers * per_layer
    flops = 0.0
    kv_bytes = 0.0
    max_steps = 0
    for prompt, out in requests:
        tokens = len(prompt) + out - 1  # the last sampled token is never fed back
        flops += 2 * layer_params * tokens + 2 * h * vocab * out
        # attention: q.k and p.v over the causal context, every layer
        ctx_sum = tokens * (tokens + 1) / 2
        flops += layers * 4 * heads * d * ctx_sum
        kv_bytes += layers * 2 * kv_heads * d * 4 * (ctx_sum / max(tokens, 1)) * out
        max_steps = max(max_steps, out)
    weight_bytes = (layer_params + 2 * h * vocab) * 4
    return flops, weight_bytes * max_steps + kv_bytes


# ---------------------------------------------------------------- the two sides


def run_engine(path: str, requests, **engine_args) -> dict:
    llm = LLM(path, max_model_len=1024, **engine_args)
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    engine = llm.engine
    forward = [0.0]
    execute = engine.runner.execute

    def timed_execute(out):
        start = time.perf_counter()
        result = execute(out)
        forward[0] += time.perf_counter() - start
        return result

    engine.runner.execute = timed_execute
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    useful = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert useful == sum(m for _, m in requests)
    return {"wall_s": wall, "tokens": useful, "tok_s": useful / wall, "forward_s": forward[0]}


def run_hf(
    path: str, requests, batch_size: int, device=None, dtype: torch.dtype = torch.float32
) -> dict:
    """HF `generate` on static left-padded batches (greedy, no EOS)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device or "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return hf_generate(model, requests, batch_size)


def hf_generate(model, requests, batch_size: int) -> dict:
    """Throughput of a loaded HF model's `generate` over `requests` in static left-padded
    batches of `batch_size` (greedy, no EOS, pad id 0)."""
    from transformers import GenerationConfig

    device = model.device
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device
        )
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                generation_config=config,
                max_new_tokens=max(m for _, m in batch),
            )
        useful += sum(m for _, m in batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": useful, "tok_s": useful / wall, "batch_size": batch_size}


def decode_overhead(path: str, batch: int = 64) -> float:
    """Share of step time spent outside the model forward with `batch` concurrent decodes."""
    rng = random.Random(1)
    requests = [([rng.randrange(10, 32000) for _ in range(64)], 64) for _ in range(batch)]
    result = run_engine(path, requests, max_num_seqs=batch, max_num_batched_tokens=4096)
    return 1 - result["forward_s"] / result["wall_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-cut", type=int, default=48, help="requests per HF measurement")
    parser.add_argument("--hf-batch-sizes", default="8,16,32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--linear-path", default="auto", help="the engine's --linear-path")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gemm, bandwidth = gemm_rate(), memory_bandwidth()
    print(
        f"machine: {cpu_model()}, fp32 GEMM {gemm / 1e9:.1f} GFLOP/s, copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s, {args.threads} threads, --linear-path {args.linear_path}"
    )
    results = {"cpu": cpu_model(), "gemm_flops": gemm, "bandwidth": bandwidth, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(Path(tmp) / "bench", "LlamaForCausalLM", **SHAPE))
        for name in ("a", "b"):
            requests = workload(name)
            ours = run_engine(
                path,
                requests,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                linear_path=args.linear_path,
            )
            cut = requests[: args.hf_cut]
            hf_runs = [run_hf(path, cut, int(b)) for b in args.hf_batch_sizes.split(",")]
            hf = max(hf_runs, key=lambda r: r["tok_s"])
            flops, nbytes = useful_work(requests, SHAPE)
            floor = max(flops / gemm, nbytes / bandwidth)
            row = {
                "ours": ours,
                "hf": hf,
                "hf_all": hf_runs,
                "floor_s": floor,
                "speedup": ours["tok_s"] / hf["tok_s"],
                "of_floor": floor / ours["wall_s"],
            }
            results["workloads"][name] = row
            print(
                f"({name}) {len(requests)} requests, {ours['tokens']} output tokens: "
                f"pagefleet {ours['tok_s']:.1f} tok/s ({ours['wall_s']:.1f} s), "
                f"HF {hf['tok_s']:.1f} tok/s (batch {hf['batch_size']}, {len(cut)} requests) "
                f"-> x{row['speedup']:.2f}; floor {floor:.1f} s = "
                f"{row['of_floor']:.0%} of our wall time"
            )
        share = decode_overhead(path)
        results["outside_forward_share_64_decodes"] = share
        print(f"time outside the model forward at 64 concurrent decodes: {share:.1%}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
