"""Linear layers on CPU: GFLOP/s of each layer's matmuls inside the engine's forward vs the same
shape in isolation, with plain weights (torch's MKL sgemm) and oneDNN-prepacked ones.

Model: the 57M-parameter Llama shape of offline_throughput.py (hidden 512, intermediate 1536,
8 heads, 2 KV heads, vocab 32000), float32. Rows: 1, 8 and 64 concurrent decodes (one row per
request per step) and one 512-token prefill. Both engines (unpacked, packed) run in this one
process; every figure on a line is measured in the same run, so ratios tolerate a shared box.

    .venv/bin/python benchmarks/cpu_linear.py [--threads 2] [--rows 1,8,64,512]

Sections: (1) per linear and row count: GFLOP/s in the forward vs isolated, for the plain and
the packed engine; (2) other ways to run the same shape in isolation (a pre-transposed
contiguous weight through torch.mm, MKL's packed sgemm); (3) the MLP + residual tail of a
layer with the old temporaries vs the in-place/fused form; (4) forward time per step.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import SHAPE

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model.packed import pack_weight, packed_linear, packed_linear_add
from pagefleet.engine.model.tiny import write_tiny_checkpoint

ROWS = "1,8,64,512"
ROUNDS = 3
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class TimedLinear(nn.Module):
    """Wraps a model's linear layer and books (rows, seconds) of every call under its name."""

    def __init__(self, inner: nn.Module, name: str, book: dict) -> None:
        super().__init__()
        self.inner, self.name, self.book = inner, name, book
        if hasattr(inner, "forward_add"):
            self.forward_add = self._timed_add

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = self.inner(x)
        self.book[(self.name, x.shape[0])].append(time.perf_counter() - start)
        return y

    def _timed_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = self.inner.forward_add(x, residual)
        self.book[(self.name, x.shape[0])].append(time.perf_counter() - start)
        return y


def instrument(model: nn.Module, book: dict) -> None:
    for layer in model.layers:
        for parent, names in ((layer.self_attn, LINEARS[:2]), (layer.mlp, LINEARS[2:4])):
            for name in names:
                setattr(parent, name, TimedLinear(getattr(parent, name), name, book))
    model.lm_head = TimedLinear(model.lm_head, "lm_head", book)


def shape_of(name: str) -> tuple[int, int]:
    """(in, out) features of a linear in SHAPE."""
    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    head_dim = h // SHAPE["num_heads"]
    return {
        "qkv_proj": (h, h + 2 * SHAPE["num_kv_heads"] * head_dim),
        "o_proj": (h, h),
        "gate_up_proj": (h, 2 * inter),
        "down_proj": (inter, h),
        "lm_head": (h, SHAPE["vocab_size"]),
    }[name]


def in_forward(path: str, rows: int, prepack: bool) -> tuple[dict, list[float]]:
    """Per-(linear, rows) call times inside the engine's forward, and the forward seconds of
    each step with exactly `rows` rows."""
    # A small pool (256 blocks hold every run here): the default 4 GiB one per engine would
    # crowd a shared machine.
    llm = LLM(
        path,
        linear_path="packed" if prepack else "plain",
        max_model_len=1024,
        max_num_seqs=rows,
        enable_prefix_caching=False,
        num_gpu_blocks_override=256,
    )
    book: dict = defaultdict(list)
    instrument(llm.engine.runner.model, book)
    steps: list[float] = []
    llm.engine.runner.execute = StepTimer(llm.engine.runner.execute, rows, steps)
    if rows == 512:  # prefills: 512-token prompts, one at a time
        batches, out_tokens = [[[7 + i] * 512] for i in range(4)], 1
    else:  # decodes: `rows` requests side by side
        batches, out_tokens = [[[11 + i] * 16 for i in range(rows)]], 24
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    for batch in batches:
        llm.generate(batch, params, use_tqdm=False)
    del llm
    gc.collect()  # the timer wrapper ties the runner in a cycle: free the engine now
    return book, steps


@dataclass
class StepTimer:
    """Wraps the runner's execute; books the seconds of the steps that ran exactly `rows` rows."""

    execute: object
    rows: int
    steps: list[float]

    def __call__(self, out):
        start = time.perf_counter()
        result = self.execute(out)
        if out.num_tokens == self.rows:
            self.steps.append(time.perf_counter() - start)
        return result


def quiet_mean(samples: list[float]) -> float:
    """Mean of the quicker half: on a shared machine the slow half is other processes' noise."""
    if not samples:
        return float("nan")
    quick = sorted(samples)[: max(1, len(samples) // 2)]
    return sum(quick) / len(quick)


def gflops(seconds: list[float], rows: int, name: str) -> float:
    k, n = shape_of(name)
    return 2 * rows * k * n / quiet_mean(seconds) / 1e9


def linear_share(book: dict, steps: list[float], rows: int) -> float:
    """Share of a step's forward time spent in the linear layers."""
    per_step = sum(
        quiet_mean(book[(name, rows)]) * (1 if name == "lm_head" else SHAPE["num_layers"])
        for name in LINEARS
        if (name, rows) in book
    )
    return per_step / quiet_mean(steps)


def seconds_per_call(fn, budget: float = 0.25) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def rate(fn, flops: float) -> float:
    return flops / seconds_per_call(fn) / 1e9


def isolated(rows: int, name: str) -> dict[str, float]:
    k, n = shape_of(name)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    w_t, packed = w.t().contiguous(), pack_weight(w)
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
    flops = 2 * rows * k * n
    ways = {
        "F.linear": lambda: F.linear(x, w),
        "mm(x, W^T contiguous)": lambda: torch.mm(x, w_t),
        "MKL packed": lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, rows),
        "oneDNN packed": lambda: packed_linear(x, packed),
    }
    best = dict.fromkeys(ways, 0.0)
    for _ in range(ROUNDS):  # interleaved rounds, best of each: load spikes hit all ways alike
        for way, fn in ways.items():
            best[way] = max(best[way], rate(fn, flops))
    return best


def mlp_tail(rows: int) -> tuple[float, float]:
    """µs of gate/up -> SiLU*up -> down -> + residual on packed weights: the old temporaries
    (silu(gate) * up, then x + out) vs in-place SiLU, one product, residual fused into down."""
    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    gate_up, down = pack_weight(torch.randn(2 * inter, h)), pack_weight(torch.randn(h, inter))
    x = torch.randn(rows, h)

    def old() -> torch.Tensor:
        gate, up = packed_linear(x, gate_up).split(inter, dim=-1)
        return x + packed_linear(F.silu(gate) * up, down)

    def new() -> torch.Tensor:
        gate, up = packed_linear(x, gate_up).split(inter, dim=-1)
        return packed_linear_add(torch.mul(F.silu(gate, inplace=True), up), down, None, x)

    times = [(seconds_per_call(old), seconds_per_call(new)) for _ in range(ROUNDS)]
    return min(t[0] for t in times) * 1e6, min(t[1] for t in times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default=ROWS, help="rows per step to measure (512: prefill)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads; GFLOP/s (higher is better); fwd = inside the engine's forward")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(Path(tmp) / "bench", "LlamaForCausalLM", **SHAPE))
        summary = []
        for rows in rows_list:
            runs = {False: (defaultdict(list), []), True: (defaultdict(list), [])}
            for _ in range(2):  # plain and packed engines alternate, samples pooled
                for prepack, (book, steps) in runs.items():
                    more, more_steps = in_forward(path, rows, prepack)
                    for key, samples in more.items():
                        book[key].extend(samples)
                    steps.extend(more_steps)
            summary.append((rows, runs))
            print_rows(rows, runs[False][0], runs[True][0])
        print("\n-- MLP + residual tail on packed weights (µs per call) --")
        for rows in rows_list:
            old, new = mlp_tail(rows)
            print(
                f"{rows:>4} rows: old temporaries {old:8.1f}  in-place/fused {new:8.1f}  "
                f"-> {old / new:.2f}x"
            )
        print("\n-- forward ms per step (steps with exactly that many rows), linears' share --")
        for rows, runs in summary:
            (plain, plain_steps), (packed, packed_steps) = runs[False], runs[True]
            a, b = quiet_mean(plain_steps), quiet_mean(packed_steps)
            share_a = linear_share(plain, plain_steps, rows)
            share_b = linear_share(packed, packed_steps, rows)
            print(
                f"{rows:>4} rows: plain {a * 1e3:8.2f} ms ({share_a:.0%} linears)  "
                f"packed {b * 1e3:8.2f} ms ({share_b:.0%} linears)  -> {a / b:.2f}x"
            )


def print_rows(rows: int, plain: dict, packed: dict) -> None:
    print(f"\n-- {rows} rows per step --")
    print(
        f"{'linear':<13} {'rows':>4} {'plain fwd':>9} {'plain iso':>9} {'packed fwd':>10} "
        f"{'packed iso':>10} {'mm W^T':>7} {'MKL pack':>8} {'packed/plain fwd':>16}"
    )
    for name in LINEARS:
        # The LM head of a prefill scores one row (the sampled one), not all 512.
        used = rows if (name, rows) in plain else 1
        iso = isolated(used, name)
        pf, kf = gflops(plain[(name, used)], used, name), gflops(packed[(name, used)], used, name)
        print(
            f"{name:<13} {used:>4} {pf:>9.1f} {iso['F.linear']:>9.1f} {kf:>10.1f} "
            f"{iso['oneDNN packed']:>10.1f} {iso['mm(x, W^T contiguous)']:>7.1f} "
            f"{iso['MKL packed']:>8.1f} {kf / pf:>15.2f}x"
        )


if __name__ == "__main__":
    main()
