"""FP8 (e4m3) KV cache (`--kv-cache-dtype fp8`): twice the tokens of a 16-bit cache in the same
memory; output close to the float32 cache's on the torch backend, on the Triton kernels
(interpreted on CPU, the CUDA-graph decode path included) and under tensor parallelism (it
cannot be greedy-equal: measured as top-1 agreement and mean |delta logprob| of the fp8 engine's
greedy tokens against the float32 cache scoring the same sequences, with the bound stated
here); calibrated per-layer scales read from the checkpoint under vLLM's names and used in the
cache's bytes; P/D peers refusing a KV dtype mismatch; bad flag values refused."""

from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch
import triton_interpret_cases as cases
from safetensors.torch import load_file, save_file
from test_kv_transfer_service import DictHeld, compat_of, make_pool, serving

from pagefleet.common.cli import build_parser
from pagefleet.common.kv_errors import IncompatiblePeer
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.kv_cache.fp8 import (
    FP8_KV_DTYPE,
    check_fp8_backend,
    dequantize,
    quantize,
    scales_from_entries,
)
from pagefleet.engine.kv_transfer.layout import CompatRecord
from pagefleet.engine.llm import LLM
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.server.serve import engine_args_from

# Measured on the tiny random checkpoints (old branch and this one: llama 0.90, mistral 0.95,
# qwen2 0.98, qwen3 0.94 agreement; |delta| 0.018-0.037): random weights give near-flat
# distributions, so near-ties flip more often than on a trained model. The bound leaves room
# for that, not for a broken cache (a cache read with the wrong scale or layout agrees on a few
# percent of tokens).
MIN_TOP1_AGREEMENT = 0.85
MAX_MEAN_ABS_DELTA_LOGPROB = 0.06
ENGINE = dict(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, kv_cache_memory=1 / 64)


def fp8_agreement(fp8: LLM, reference: LLM, prompts: int = 3, tokens: int = 100):
    """(top-1 agreement, mean |delta logprob|) of the fp8 engine's greedy tokens against the
    reference engine scoring the same sequences (teacher-forced, through prompt logprobs)."""
    rng = random.Random(0)
    agree, total, delta = 0, 0, 0.0
    greedy = SamplingParams(max_tokens=tokens, temperature=0, logprobs=0, ignore_eos=True)
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    for _ in range(prompts):
        prompt = [rng.randrange(100) for _ in range(20)]
        out = fp8.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        scored = reference.generate([prompt + out.token_ids], score, use_tqdm=False)[0]
        for i, token in enumerate(out.token_ids):
            ref = scored.prompt_logprobs[len(prompt) + i]
            top = min(ref.items(), key=lambda item: item[1].rank)[0]
            agree += top == token
            delta += abs(ref[token].logprob - out.logprobs[i][token].logprob)
            total += 1
    return agree / total, delta / total


def assert_within_bound(agreement: float, delta: float) -> None:
    assert agreement >= MIN_TOP1_AGREEMENT, agreement
    assert 0 < delta <= MAX_MEAN_ABS_DELTA_LOGPROB, delta  # > 0: the values were quantised


def test_fp8_cache_stays_close_to_the_float32_cache(tiny_checkpoints):
    """300 greedy tokens (3 prompts x 100) on the torch backend; llama has the lowest
    agreement of the four tiny checkpoints (benchmarks/fp8_kv.py and docs/benchmarks.md give
    all four)."""
    path = tiny_checkpoints["llama"]
    fp8 = LLM(path, kv_cache_dtype="fp8", **ENGINE)
    assert fp8.engine.runner.kv_pool.dtype == FP8_KV_DTYPE
    assert fp8.engine.runner.kv_cache_dtype == "float8_e4m3fn"
    assert_within_bound(*fp8_agreement(fp8, LLM(path, **ENGINE)))


def test_fp8_holds_twice_the_tokens_of_a_16_bit_cache(tiny_checkpoints):
    """At the same --kv-cache-memory, from the engine's own figures (its pool and the
    scheduler's block count): twice the blocks, in the same bytes."""
    path = tiny_checkpoints["llama"]
    common = dict(kv_cache_memory=1 / 1024, max_model_len=256)
    half = LLM(path, kv_cache_dtype="bfloat16", **common).engine
    fp8 = LLM(path, kv_cache_dtype="fp8_e4m3", **common).engine  # vLLM's other name
    assert fp8.scheduler.kv_cache.num_blocks == 2 * half.scheduler.kv_cache.num_blocks
    assert fp8.runner.kv_pool.element_size() == 1
    assert fp8.runner.kv_pool.nbytes == half.runner.kv_pool.nbytes
    assert fp8.runner.kv_pool.shape[3] == fp8.scheduler.kv_cache.num_blocks


def _scaled_checkpoint(source: str, dest, extra: dict[str, float]) -> str:
    shutil.copytree(source, dest)
    weights = load_file(dest / "model.safetensors")
    weights.update({name: torch.tensor(value) for name, value in extra.items()})
    save_file(weights, dest / "model.safetensors")
    return str(dest)


def _prompt_cache(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The pool after a prompt's prefill (one step: the prompt fits the budget)."""
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return llm.engine.runner.kv_pool.clone()


def test_calibrated_scales_are_read_from_the_checkpoint_and_used(tiny_checkpoints, tmp_path):
    """vLLM's names (`model.layers.N.self_attn.k_scale`, and under `.attn.`) are cache scales,
    not weights: the loader skips them (an unknown tensor would fail the load) and the cache
    stores value / scale. Fails for scales read but not applied on write (layer 0's key bytes
    would equal the unscaled engine's), applied on write but not on read (the output would leave
    the bound), or applied to the wrong layer or to values (layer 0's value bytes would differ)."""
    plain = tiny_checkpoints["llama"]
    path = _scaled_checkpoint(
        plain,
        tmp_path / "scaled",
        {"model.layers.0.self_attn.k_scale": 0.25, "model.layers.1.self_attn.attn.v_scale": 2.0},
    )
    fp8 = LLM(path, kv_cache_dtype="fp8", **ENGINE)
    assert fp8.engine.runner.kv_scales == [(0.25, 1.0), (1.0, 2.0)]
    prompt = list(range(3, 40))
    scaled = _prompt_cache(fp8, prompt)
    unscaled = _prompt_cache(LLM(plain, kv_cache_dtype="fp8", **ENGINE), prompt)
    as_bytes = scaled.view(torch.uint8), unscaled.view(torch.uint8)
    assert not torch.equal(as_bytes[0][0, 0], as_bytes[1][0, 0])  # layer 0 keys: scaled
    assert torch.equal(as_bytes[0][0, 1], as_bytes[1][0, 1])  # layer 0 values: same inputs
    # Read back with their scales, layer 0's keys are the same values to fp8 precision.
    torch.testing.assert_close(
        dequantize(scaled[0, 0], 0.25, torch.float32),
        dequantize(unscaled[0, 0], 1.0, torch.float32),
        rtol=0.07,
        atol=0.02,
    )
    assert_within_bound(*fp8_agreement(fp8, LLM(path, **ENGINE), 1, 100))


def test_scale_names_and_bad_scales():
    """vLLM's deprecated `kv_scale` sets both, ModelOpt's `k_proj.output_scale` the key's; a
    scale that is not positive and finite, or names a missing layer, is refused."""
    scales = scales_from_entries(
        [
            ("model.layers.0.self_attn.kv_scale", 0.5),
            ("model.layers.1.self_attn.v_proj.output_scale", 3.0),
            ("model.layers.1.mlp.down_proj.weight_scale", 9.0),  # a weight's: not the cache's
        ],
        2,
    )
    assert scales == [(0.5, 0.5), (1.0, 3.0)]
    for name, value in [
        ("model.layers.0.self_attn.k_scale", 0.0),
        ("model.layers.0.self_attn.v_scale", float("nan")),
        ("model.layers.5.self_attn.k_scale", 1.0),
    ]:
        with pytest.raises(ValueError, match="not a usable KV-cache scale"):
            scales_from_entries([(name, value)], 2)


def test_a_bad_checkpoint_scale_is_refused_at_load(tiny_checkpoints, tmp_path):
    path = _scaled_checkpoint(
        tiny_checkpoints["llama"], tmp_path / "bad", {"model.layers.1.self_attn.k_scale": -1.0}
    )
    with pytest.raises(ValueError, match=r"k_scale=-1\.0 is not a usable KV-cache scale"):
        LLM(path, kv_cache_dtype="fp8", **ENGINE)


def test_quantize_saturates_instead_of_making_nan():
    x = torch.tensor([1e6, -1e6, 0.3])
    q = quantize(x, 1.0)
    assert not torch.isnan(q.float()).any()
    assert dequantize(q, 2.0, torch.float32).tolist()[:2] == [896.0, -896.0]


def test_dequantize_reads_every_finite_e4m3_code_exactly():
    """The CPU read path moves e4m3 bits into a float16 instead of casting: each of the 254
    finite codes (NaN, 0x7f and 0xff, is never stored) reads back as torch's cast, scaled."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(FP8_KV_DTYPE)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(codes, 1.0, dtype), codes.to(dtype))
    assert torch.equal(dequantize(codes, 0.25, torch.float32), codes.float() * 0.25)


def test_bad_kv_cache_dtype_values_are_refused():
    with pytest.raises(ValueError, match=r"--kv-cache-dtype.*e5m2 is not supported"):
        EngineArgs(model="m", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        LLM("unused", kv_cache_dtype="int8")
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--kv-cache-dtype", "fp8_e5m2"])
    for value in ("fp8", "fp8_e4m3"):
        args = parser.parse_args(["serve", "m", "--kv-cache-dtype", value])
        assert engine_args_from(args).kv_cache_dtype == value


def test_triton_fp8_is_refused_on_gpus_it_cannot_compile_for():
    """Triton compiles e4m3 for compute capability 8.9+ only: an A100 (8.0) or A10G (8.6)
    is refused at start-up with the way out, not at its first step; H100/L4 and the torch
    backend (and CPU) pass."""
    for capability in [(8, 0), (8, 6)]:
        with pytest.raises(ValueError, match=r"capability 8\.9 .*--attention-backend torch"):
            check_fp8_backend("triton", capability)
    for backend, capability in [("triton", (8, 9)), ("triton", (9, 0)), ("torch", (8, 0))]:
        check_fp8_backend(backend, capability)
    check_fp8_backend("triton", None)  # the interpreter on CPU


# ---------------------------------------------------------------- P/D


def test_kv_transfer_refuses_a_kv_dtype_mismatch_at_the_handshake():
    """A decode engine with a bfloat16 cache is refused by an fp8 prefill engine (blocks move
    as bytes: e4m3 bytes read as bfloat16 would be garbage), with both dtypes and the flag named,
    as the TP handshake names both sizes."""
    pool = make_pool(0, dtype=FP8_KV_DTYPE)
    fp8 = CompatRecord.from_pool_shape("tiny", "bfloat16", "float8_e4m3fn", pool.shape)
    bf16 = dataclasses.replace(fp8, kv_dtype="bfloat16")
    with serving(DictHeld({}), pool, compat=fp8) as (_, client):
        with pytest.raises(IncompatiblePeer) as err:
            client.handshake(bf16, "decode-0")
        assert client.handshake(fp8, "decode-1").compat == fp8  # the same dtype is met
    assert (
        "kv_dtype differs: the prefill engine's KV cache is float8_e4m3fn, the decode engine's "
        "bfloat16 (both need the same --kv-cache-dtype)"
    ) in str(err.value)
    assert compat_of(make_pool(0)).mismatches(bf16) == []  # the bfloat16 peers agree


# ---------------------------------------------------------------- Triton kernels (interpreted)


FP8_STEPS = {
    # Decodes, a fresh chunk and a chunk after a cached prefix (GQA 4), scales 1.0.
    "mixed-gqa4": cases.StepSpec(
        [(3, 1), (33, 1), (0, 21), (16, 9)], 8, 2, kv_dtype=FP8_KV_DTYPE, kv_scale=(1.0, 1.0)
    ),
    # Calibrated scales (and values that saturate at 448 x scale), head_dim 32, a prefix hit.
    "scaled-d32": cases.StepSpec(
        [(31, 1), (20, 1), (9, 14)],
        4,
        2,
        head_dim=32,
        prefix_hit=[0],
        kv_dtype=FP8_KV_DTYPE,
        kv_scale=(0.004, 0.5),
        seed=4,
    ),
}


@pytest.mark.parametrize("name", list(FP8_STEPS))
def test_triton_fp8_attention_and_cache_writes_match_torch_reference(interpreter, name):
    """The kernels quantise on store (divide by the scale, clamp to +-448) and dequantise on
    load exactly as the torch backend does: the same pool bytes, the same outputs."""
    result = interpreter(cases.attention_case, FP8_STEPS[name])
    assert result["ours_pool"].dtype == FP8_KV_DTYPE
    assert torch.equal(result["ours_pool"].view(torch.uint8), result["ref_pool"].view(torch.uint8))
    torch.testing.assert_close(result["ours"], result["ref"], rtol=1e-5, atol=1e-5)


def test_triton_fp8_split_kv_matches_torch_reference(interpreter):
    spec = cases.StepSpec(
        [(300, 1), (129, 1), (60, 7)],
        4,
        1,
        num_blocks=48,
        kv_dtype=FP8_KV_DTYPE,
        kv_scale=(0.5, 2.0),
        seed=5,
    )
    result = interpreter(cases.attention_case, spec, num_splits=2)
    assert torch.equal(result["ours_pool"].view(torch.uint8), result["ref_pool"].view(torch.uint8))
    torch.testing.assert_close(result["ours"], result["ref"], rtol=1e-5, atol=1e-5)


def test_triton_fp8_engine_stays_close_to_the_float32_cache(interpreter, tiny_checkpoints):
    """The engine on the Triton backend with an fp8 pool, decode steps through the CUDA-graph
    path's static buffers (run eagerly: the scales reach the kernels through the same
    per-layer caches a captured graph replays)."""
    agreement, delta, dtype, static_served = interpreter(
        cases.fp8_agreement_case,
        tiny_checkpoints["llama"],
        1,
        60,
        static_decode=True,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=2,
        num_gpu_blocks_override=16,
    )
    assert dtype == "torch.float8_e4m3fn" and static_served
    assert_within_bound(agreement, delta)


# ---------------------------------------------------------------- tensor parallelism


def test_fp8_under_tensor_parallelism_stays_close_to_the_float32_cache(tiny_checkpoints, tmp_path):
    """Two ranks (gloo on CPU), each an fp8 shard of every block with the checkpoint's per-layer
    scales (the same on every rank: they are per layer, not per head)."""
    path = _scaled_checkpoint(
        tiny_checkpoints["llama"], tmp_path / "tp", {"model.layers.0.self_attn.k_scale": 0.25}
    )
    llm = LLM(path, kv_cache_dtype="fp8", tensor_parallel_size=2, **ENGINE)
    try:
        runner = llm.engine.runner
        assert runner.kv_pool.dtype == FP8_KV_DTYPE and runner.kv_pool.shape[2] == 1
        assert runner.kv_scales == [(0.25, 1.0), (1.0, 1.0)]
        assert_within_bound(*fp8_agreement(llm, LLM(path, **ENGINE), 2, 100))
    finally:
        llm.engine.close()
