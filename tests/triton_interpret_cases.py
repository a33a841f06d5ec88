"""Work run by tests/test_triton_attention.py in a separate process with TRITON_INTERPRET=1.

Triton picks interpreter or compiler when a kernel is decorated, i.e. when the kernel module is
first imported, so this module imports nothing of Triton at the top: `enable_interpreter` runs
first in the worker process, then the cases import the kernels. Cases return tensors and token
ids; the assertions stay in the test module.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass, field

import torch


def enable_interpreter() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    _round_float8_as_gpus_do()


def _round_float8_as_gpus_do() -> None:
    """Triton's interpreter (3.9, interpreter._convert_float) casts float32 to e4m3 without the
    carry of a rounded-up mantissa into the exponent (0.49 becomes 0.25 where a GPU's
    cvt.rn.satfinite gives 0.5: ~0.1% of values), which would test the interpreter, not the
    kernels. float32 -> e4m3 casts go through torch's round-to-nearest-even instead."""
    from triton.runtime import interpreter

    interpreter._convert_float = functools.partial(_convert_exactly, interpreter._convert_float)


def _convert_exactly(convert, data, input_dtype, output_dtype, rounding_mode):
    import numpy as np
    import triton.language as tl

    if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
        values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
        return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return convert(data, input_dtype, output_dtype, rounding_mode)


@dataclass(frozen=True)
class StepSpec:
    """One attention step: per request (tokens cached before the step, tokens computed now)."""

    requests: list[tuple[int, int]]
    num_heads: int
    num_kv_heads: int
    head_dim: int = 16
    block_size: int = 16
    num_blocks: int = 64
    # Requests whose single row is a full prefix hit: its keys are already cached, not written.
    prefix_hit: list[int] = field(default_factory=list)
    kv_dtype: torch.dtype = torch.float32
    seed: int = 0
    # An fp8 pool's (k_scale, v_scale) for the layer (kv_dtype float8_e4m3fn).
    kv_scale: tuple[float, float] | None = None


def _runner(spec: StepSpec):
    """A model runner over a one-layer model shaped by the spec (prepare() builds metadata)."""
    from pagefleet.engine.attention.torch_ref import TorchAttentionBackend
    from pagefleet.engine.model import llama
    from pagefleet.engine.model.config import ModelConfig
    from pagefleet.engine.runner import ModelRunner

    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=spec.num_heads * spec.head_dim,
        intermediate_size=8,
        num_layers=1,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        rope={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None,
        bos_token_id=None,
    )
    model = llama.build(cfg, 4096)
    return ModelRunner(
        model,
        spec.block_size,
        spec.num_blocks,
        TorchAttentionBackend(),
        torch.device("cpu"),
        spec.kv_dtype,
    )


def build_step(spec: StepSpec):
    """Requests in the state the spec describes (random, distinct blocks) and their step."""
    from pagefleet.engine.request import Request
    from pagefleet.engine.sampling_params import SamplingParams
    from pagefleet.engine.scheduler import SchedulerOutput

    rng = random.Random(spec.seed)
    bs = spec.block_size
    free = list(range(spec.num_blocks))
    rng.shuffle(free)
    scheduled = []
    for i, (cached, new) in enumerate(spec.requests):
        total = cached + new
        req = Request(
            f"r{i}", [rng.randrange(32) for _ in range(total)], SamplingParams(), block_size=bs
        )
        req.num_computed_tokens = cached
        if i in spec.prefix_hit:
            req.num_cached_tokens = total  # the recomputed last token is already cached
        req.block_ids = [free.pop() for _ in range(-(-total // bs))]
        scheduled.append((req, new))
    return SchedulerOutput(scheduled=scheduled, num_tokens=sum(n for _, n in spec.requests))


def attention_case(spec: StepSpec, num_splits: int | None = None) -> dict[str, torch.Tensor]:
    """The Triton and torch backends on the same step from the same random pool: outputs and
    the pools after their writes."""
    from pagefleet.engine.attention.torch_ref import TorchAttentionBackend
    from pagefleet.engine.attention.triton_backend import TritonAttentionBackend

    runner = _runner(spec)
    meta = runner.prepare(build_step(spec)).meta
    gen = torch.Generator().manual_seed(spec.seed)
    rows = sum(n for _, n in spec.requests)
    q = torch.randn(rows, spec.num_heads, spec.head_dim, generator=gen)
    k = torch.randn(rows, spec.num_kv_heads, spec.head_dim, generator=gen)
    v = torch.randn(rows, spec.num_kv_heads, spec.head_dim, generator=gen)
    # New keys/values exactly representable in the pool's dtype: the interpreter rounds
    # float32 -> bfloat16 toward zero where GPUs (and torch) round to nearest even.
    if spec.kv_scale is None:
        k, v = k.to(spec.kv_dtype).float(), v.to(spec.kv_dtype).float()
    pool = torch.randn(runner.kv_pool.shape, generator=gen).to(spec.kv_dtype)
    ref_pool, ours_pool = pool.clone(), pool.clone()
    scale = spec.head_dim**-0.5
    ref = TorchAttentionBackend().forward(
        q, k, v, ref_pool[0, 0], ref_pool[0, 1], meta, scale, spec.kv_scale
    )
    backend = TritonAttentionBackend(num_sms=1, num_splits=num_splits)
    ours = backend.forward(q, k, v, ours_pool[0, 0], ours_pool[0, 1], meta, scale, spec.kv_scale)
    return {"ours": ours, "ref": ref, "ours_pool": ours_pool, "ref_pool": ref_pool}


def greedy_case(
    path: str, prompts: list[list[int]], max_tokens: int, static_decode: bool = False, **engine_args
) -> tuple[list[list[int]], int]:
    """Greedy token ids of the offline engine with the Triton backend, and how many steps the
    decode-graph path served (static_decode: that path, run eagerly, as on CPU it must)."""
    tokens, served, _ = speculative_greedy_case(
        path, prompts, max_tokens, static_decode, **engine_args
    )
    return tokens, served


def speculative_greedy_case(
    path: str, prompts: list[list[int]], max_tokens: int, static_decode: bool = False, **engine_args
) -> tuple[list[list[int]], int, int]:
    """greedy_case, and the draft tokens accepted (0 without speculative_config)."""
    from pagefleet.engine import LLM, SamplingParams

    llm = LLM(path, attention_backend="triton", **engine_args)
    runner = llm.engine.runner
    served = []
    if static_decode:
        runner.capture_decode_graphs(
            llm.engine._max_decode_rows(), engine_args["max_model_len"], use_graphs=False
        )
        graphs = runner.decode_graphs
        run = graphs.run

        def counting_run(*args):
            hidden = run(*args)
            served.append(hidden is not None)
            return hidden

        graphs.run = counting_run
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    counters = llm.engine.spec_counters
    accepted = counters.snapshot().num_accepted_tokens if counters else 0
    return [o.outputs[0].token_ids for o in outputs], sum(served), accepted


def fp8_agreement_case(
    path: str, prompts: int, tokens: int, static_decode: bool = False, **engine_args
) -> tuple[float, float, str, bool]:
    """(top-1 agreement, mean |delta logprob|, pool dtype, whether the static decode path
    served steps) of an fp8 engine on the Triton
    backend against a float32 cache on the torch backend (test_fp8_kv_cache.fp8_agreement);
    static_decode: decode steps through the CUDA-graph path's static buffers, run eagerly."""
    from test_fp8_kv_cache import fp8_agreement

    from pagefleet.engine import LLM

    fp8 = LLM(path, attention_backend="triton", kv_cache_dtype="fp8", **engine_args)
    runner = fp8.engine.runner
    if static_decode:
        runner.capture_decode_graphs(
            engine_args["max_num_seqs"], engine_args["max_model_len"], use_graphs=False
        )
    reference = LLM(path, attention_backend="torch", **engine_args)
    agreement, delta = fp8_agreement(fp8, reference, prompts, tokens)
    # The static buffers keep the last decode they served (zeros if they served none).
    static_served = static_decode and bool(runner.decode_graphs.buffers.seq_lens.any())
    return agreement, delta, str(runner.kv_pool.dtype), static_served


@dataclass(frozen=True)
class LinearStepSpec:
    """One linear-attention step: single-token sequences' slots, then prompt chunks as
    (slot, tokens, snapshots (offset, destination slot)); `runs` (verifications, shaped as
    chunks) sit between the first single row and the others; the layer's shape."""

    singles: list[int]
    chunks: list[tuple[int, int, list[tuple[int, int]]]]
    runs: list[tuple[int, int, list[tuple[int, int]]]] = field(default_factory=list)
    key_heads: int = 2
    value_heads: int = 4
    key_dim: int = 12
    value_dim: int = 20
    conv_width: int = 3
    state_dtype: torch.dtype = torch.float32
    seed: int = 0


def linear_attn_case(spec: LinearStepSpec) -> dict[str, tuple[torch.Tensor, ...]]:
    """The conv and the delta rule of one step by the torch and the Triton kernels, from the
    same random inputs and slots: (conv out, rule out, conv states, recurrent states) each."""
    from pagefleet.engine.linear_attn.kernels import TorchKernels
    from pagefleet.engine.linear_attn.state import StateChunk, StatePool, StepStates
    from pagefleet.engine.linear_attn.triton_ops import TritonKernels
    from pagefleet.engine.model.config import SequenceStateShape

    gen = torch.Generator().manual_seed(spec.seed)
    hk, hv, dk, dv = spec.key_heads, spec.value_heads, spec.key_dim, spec.value_dim
    shape = SequenceStateShape(1, 2 * hk * dk + hv * dv, spec.conv_width, hv, dk, dv)
    spans = spec.runs + spec.chunks
    num_slots = 1 + max([*spec.singles, *(s for s, _, _ in spans)])
    num_slots = max(num_slots, 1 + max((d for _, _, saves in spans for _, d in saves), default=0))
    chunks, single_rows, row = [], [0], 1  # the first single, the runs, the other singles
    for slot, n, saves in spec.runs:
        chunks.append(StateChunk(row, n, slot, tuple(saves)))
        row += n
    single_rows += list(range(row, row + len(spec.singles) - 1))
    row += len(spec.singles) - 1
    for slot, n, saves in spec.chunks:
        chunks.append(StateChunk(row, n, slot, tuple(saves)))
        row += n
    rows = single_rows if spec.runs else None

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen)

    conv0 = rand(1, num_slots, shape.conv_channels, spec.conv_width).to(spec.state_dtype)
    ssm0 = (rand(1, num_slots, hv, dk, dv) * 0.3).to(spec.state_dtype)
    x, weight = rand(row, shape.conv_channels), rand(shape.conv_channels, spec.conv_width + 1)
    q, k, v = rand(row, hk, dk), rand(row, hk, dk), rand(row, hv, dv)
    g = -torch.rand(row, hv, generator=gen) * 0.5
    beta = torch.rand(row, hv, generator=gen)
    results = {}
    for kernels in (TorchKernels(), TritonKernels()):
        pool = StatePool(shape, num_slots, spec.state_dtype, torch.device("cpu"))
        pool.conv.copy_(conv0)
        pool.ssm.copy_(ssm0)
        states = StepStates(
            len(spec.singles),
            torch.tensor(spec.singles),
            chunks,
            list(spec.singles),
            single_rows=rows,
            pool=pool,
        )
        conv = kernels.conv(x, weight, states, 0)
        out = kernels.delta_rule(q, k, v, g, beta, states, 0)
        results[kernels.name] = (conv, out, pool.conv.float(), pool.ssm.float())
    return results
