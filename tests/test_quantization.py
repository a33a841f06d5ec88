"""Quantized checkpoints served as stored: every format the engine loads, written by the
project's reference quantizer (engine/model/quant/reference.py) from a tiny random Qwen2
(q/k/v biases, tied embeddings), against its oracle, the dequantized float checkpoint run by
transformers; transformers on the quantized checkpoint itself where it reads the format, and
compressed-tensors' own packer; tensor-parallel shards against one rank; and the refusals
(a flag that disagrees, an unknown scheme, corrupt tensors), each naming what is wrong.

The kernels take bfloat16 or 8-bit activations (quant/cpu_kernels.py, quant/kernels.py), so
the engine's greedy tokens are compared as half precision is (hf_reference.
assert_top1_agrees): HF on the oracle, fed our tokens, picks each as its top-1 or within a
near-tie of it.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from hf_reference import assert_top1_agrees
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.linear import FloatLinearMethod, Linear, weight_bytes
from pagefleet.engine.model.loader import load_model, read_config
from pagefleet.engine.model.parallel import TPLayout
from pagefleet.engine.model.quant.reference import Spec, write_quantized
from pagefleet.engine.model.registry import model_config

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
W8A8_GAP = 0.1  # nats: 8-bit activations (per token or static) round more than bfloat16
FORMATS = {
    "ct-w4a16-g32-asym-actorder": Spec("ct-int", 4, 32, symmetric=False, act_order=True),
    "ct-w4a16-g32-sym": Spec("ct-int", 4, 32, symmetric=True),
    "ct-w8a16-channel-asym": Spec("ct-int", 8, None, symmetric=False),
    # compressed-tensors' ignore list: down_proj (a regex) stays float
    "ct-w8a16-g32-ignore-down": Spec("ct-int", 8, 32, ignore=("re:.*mlp.down_proj",)),
    "ct-fp8-channel-dynamic": Spec("ct-fp8"),
    "ct-fp8-tensor-static": Spec("ct-fp8", per_channel=False, static=True),
    "ct-int8-channel-dynamic": Spec("ct-int8"),
    "gptq-int4-g32-actorder": Spec("gptq", 4, 32, symmetric=False, act_order=True),
    "gptq-int8-g32-sym": Spec("gptq", 8, 32, symmetric=True),
    "awq-int4-g32": Spec("awq", 4, 32, symmetric=False),
    "fp8-static": Spec("fp8", static=True),
}


@dataclass(frozen=True)
class Written:
    quantized: str
    oracle: str


@pytest.fixture(scope="module")
def written(tiny_checkpoints, tmp_path_factory) -> dict[str, Written]:
    root = tmp_path_factory.mktemp("quantized")
    src = tiny_checkpoints["qwen2"]
    out = {}
    for name, spec in FORMATS.items():
        write_quantized(src, root / name, spec, oracle=root / f"{name}-oracle")
        out[name] = Written(str(root / name), str(root / f"{name}-oracle"))
    return out


@pytest.fixture(scope="module")
def float_linear_bytes(tiny_checkpoints) -> int:
    """What the float checkpoint's decoder linears take in the engine."""
    return _linear_bytes(load_model(tiny_checkpoints["qwen2"], torch.float32, CPU, 64))


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 17, 33, 9)]


def _linear_bytes(model) -> int:
    return sum(
        layer.weight_bytes()
        for name, layer in model.named_modules()
        if name.startswith("layers.") and hasattr(layer, "weight_bytes")
    )


class ExactKernel:
    """A stand-in for the kernels: x times the loaded weight, dequantized, in float32 (the
    kernels' own precision is tests/test_quant_kernels.py's subject)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ self.weight.t()
        return y if bias is None else y + bias


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_loads_its_oracles_weights(written, float_linear_bytes, name, monkeypatch):
    """Every linear of a decoder layer, loaded as stored (codes, scales, zero points,
    act-order, per-tensor scales of fused parts), is the dequantized oracle's projection,
    exactly; with the real kernels it holds the format's bytes, not float32's."""
    from hf_reference import hf_model
    from pagefleet.engine.model.quant import kernels

    monkeypatch.setattr(kernels, "int_kernel", lambda w: ExactKernel(w.dequantize()))
    monkeypatch.setattr(
        kernels, "scaled8_kernel", lambda w, s, i: ExactKernel(w.float() * s[:, None])
    )
    model = load_model(written[name].quantized, torch.float32, CPU, 64)
    hf = hf_model(written[name].oracle).model.layers[1]
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, model.config.hidden_size, generator=gen)
    mid = torch.randn(5, model.config.intermediate_size, generator=gen)
    heads = torch.randn(5, attn.q_size, generator=gen)
    with torch.no_grad():
        qkv = [hf.self_attn.q_proj(x), hf.self_attn.k_proj(x), hf.self_attn.v_proj(x)]
        assert_close(attn.qkv_proj(x), torch.cat(qkv, -1))
        assert_close(attn.o_proj(heads), hf.self_attn.o_proj(heads))
        assert_close(mlp.gate_up_proj(x), torch.cat([hf.mlp.gate_proj(x), hf.mlp.up_proj(x)], -1))
        assert_close(mlp.down_proj(mid), hf.mlp.down_proj(mid))
    monkeypatch.undo()
    model = load_model(written[name].quantized, torch.float32, CPU, 64)
    float_layers = {
        n.split(".", 2)[2]
        for n, layer in model.named_modules()
        if n.startswith("layers.") and isinstance(layer, Linear)
        if isinstance(layer.method, FloatLinearMethod)
    }
    assert float_layers == ({"mlp.down_proj"} if FORMATS[name].ignore else set())
    float_bytes = float_linear_bytes
    # 4-bit: codes are 1/8 of float32, plus tinygemm's bfloat16 scale/zero pairs per group of
    # 32 (1/32) and the float32 scales and offsets the fused one-row layers read (1/16).
    spec = FORMATS[name]
    bound = 0.23 if spec.bits == 4 and spec.kind in ("ct-int", "gptq", "awq") else 0.32
    bound = 0.6 if spec.ignore else bound  # a third of the linears' weights stay float
    assert _linear_bytes(model) <= bound * float_bytes


# One engine per family of kernels (the other formats share their paths past the loader).
ENGINE_FORMATS = [
    "ct-w4a16-g32-asym-actorder",
    "ct-fp8-tensor-static",
    "ct-int8-channel-dynamic",
    "gptq-int8-g32-sym",
    "awq-int4-g32",
]


@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_greedy_output_is_the_oracles_up_to_near_ties(written, name):
    """The engine on the quantized checkpoint: greedy tokens HF on the oracle, fed them,
    picks as its top-1 or within a near-tie of it."""
    llm = LLM(written[name].quantized, num_gpu_blocks_override=64, max_model_len=128)
    prompts = _prompts()
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    # W8A8 quantizes activations as part of the scheme (the oracle does not): wider ties.
    w8a8 = FORMATS[name].kind in ("ct-fp8", "ct-int8", "fp8")
    gap = W8A8_GAP if w8a8 else 0.05
    assert_top1_agrees(written[name].oracle, torch.float32, prompts, outputs, 0.9, gap)


# Weight-only formats whose single-stream steps run the fused layers on their codes a byte each
# (model/one_row_decode.py, quant/row_codes.py); act-order columns and W8A8 stay op by op.
FUSED_FORMATS = [
    "ct-w4a16-g32-sym",
    "ct-w8a16-channel-asym",
    "ct-w8a16-g32-ignore-down",  # float down_proj beside coded linears in one layer
    "gptq-int8-g32-sym",
    "awq-int4-g32",
]


@pytest.mark.parametrize("name", [*FUSED_FORMATS, "gptq-int4-g32-actorder"])
def test_single_stream_fuses_the_layers_on_codes_as_the_oracle_picks(written, name, monkeypatch):
    from pagefleet.engine.model.one_row_decode import OneRowDecoder

    steps = []
    run = OneRowDecoder.__call__
    monkeypatch.setattr(
        OneRowDecoder, "__call__", lambda self, x, *a: steps.append(1) or run(self, x, *a)
    )
    llm = LLM(
        written[name].quantized,
        max_num_seqs=1,
        attention_backend="numba",
        num_gpu_blocks_override=64,
        max_model_len=128,
    )
    prompts = _prompts()[:2]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    fused = name in FUSED_FORMATS
    assert len(steps) == (2 * (GREEDY.max_tokens - 1) if fused else 0)
    assert_top1_agrees(written[name].oracle, torch.float32, prompts, outputs, 0.9, 0.05)


def test_a_prompt_step_on_4_bit_tiles_is_the_oracles_up_to_near_ties(
    written, monkeypatch, tile_calls
):
    """With --linear-path auto a step of many rows takes the 4-bit tiles where they measured
    faster (quant/int4_tiles.py; from 128 rows here, whatever this machine measured): greedy
    tokens as HF on the oracle picks them, act-order included; decode steps stay on
    tinygemm."""
    from pagefleet.engine.model.quant import int4_tiles

    if int4_tiles.tinygemm_block() is None:
        return  # this torch build's layout is not one the tiles read: tinygemm everywhere
    monkeypatch.setattr(int4_tiles, "cached_timings", lambda *args: ([], "not measured"))
    monkeypatch.setattr(int4_tiles, "tile_rows", lambda timings, paths: (128, "from 128 rows"))
    name = "ct-w4a16-g32-asym-actorder"
    llm = LLM(written[name].quantized, num_gpu_blocks_override=64, max_model_len=128)
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (41, 57, 36)]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert tile_calls and set(tile_calls) == {sum(map(len, prompts))}  # the prompt step only
    assert_top1_agrees(written[name].oracle, torch.float32, prompts, outputs, 0.9, 0.05)


def test_online_fp8_quantizes_a_float_checkpoint_at_load(written, tiny_checkpoints):
    """--quantization fp8 on the float checkpoint: per-channel e4m3, as the reference's
    per-channel FP8 checkpoint (whose oracle is therefore its oracle too)."""
    path = tiny_checkpoints["qwen2"]
    llm = LLM(path, quantization="fp8", num_gpu_blocks_override=64, max_model_len=128)
    prompts = _prompts()
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    oracle = written["ct-fp8-channel-dynamic"].oracle
    assert_top1_agrees(oracle, torch.float32, prompts, outputs, 0.9, W8A8_GAP)
    stored = load_model(written["ct-fp8-channel-dynamic"].quantized, torch.float32, CPU, 64)
    online = llm.engine.runner.model
    x = torch.randn(3, online.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(online.layers[1].mlp.gate_up_proj(x), stored.layers[1].mlp.gate_up_proj(x))


def test_transformers_reads_the_reference_checkpoints_as_their_oracles(written):
    """The second oracle: transformers with compressed-tensors decompresses the reference's
    symmetric W4A16 checkpoint into exactly the oracle's weights."""
    from transformers import AutoModelForCausalLM

    w = written["ct-w4a16-g32-sym"]
    ids = torch.tensor([_prompts()[1]])
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(w.quantized, dtype=torch.float32)(ids)
        oracle = AutoModelForCausalLM.from_pretrained(w.oracle, dtype=torch.float32)(ids)
    assert torch.equal(theirs.logits, oracle.logits)


def test_compressed_tensors_packs_as_the_reference_writes(written):
    """compressed-tensors' own packer, given the reference's codes, scales and zero points,
    writes the same weight_packed and weight_zero_point bytes the engine reads."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    path = Path(written["ct-w4a16-g32-sym"].quantized)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    ours = load_file(path / "model.safetensors")
    oracle = load_file(Path(written["ct-w4a16-g32-sym"].oracle) / "model.safetensors")
    prefix = "model.layers.1.mlp.down_proj"
    scheme = QuantizationScheme(**config["config_groups"]["group_0"])
    theirs = PackedQuantizationCompressor.compress(
        {
            "weight": oracle[f"{prefix}.weight"],
            "weight_scale": ours[f"{prefix}.weight_scale"],
            "weight_zero_point": torch.zeros_like(ours[f"{prefix}.weight_scale"], dtype=torch.int8),
        },
        scheme,
    )
    assert torch.equal(theirs["weight_packed"], ours[f"{prefix}.weight_packed"])


@dataclass
class IdentityGroup:
    """A rank's collectives with the reduction left to the test (it sums the ranks itself)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]


@pytest.mark.parametrize("name", list(FORMATS))
def test_tp_shards_of_quantized_layers_equal_one_rank(written, name):
    """Two ranks' shards (column slices of q|k|v and gate|up, row slices of o_proj and
    down_proj with their groups, scales, zero points and act-order indices) compute one
    rank's outputs."""
    path = written[name].quantized
    cfg = model_config(read_config(path))
    whole = load_model(path, torch.float32, CPU, 64).layers[1]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, cfg.hidden_size, generator=gen)
    heads_out = torch.randn(4, cfg.num_heads * cfg.head_dim, generator=gen)
    mlp_in = torch.randn(4, cfg.intermediate_size, generator=gen)
    qkv, gate_up, o_sum, down_sum = [], [], 0.0, 0.0
    with torch.no_grad():
        for rank in range(2):
            tp = TPParts(TPLayout.of(cfg, rank, 2), IdentityGroup(rank, 2))
            shard = load_model(path, torch.float32, CPU, 64, tp=tp).layers[1]
            attn, mlp = shard.self_attn, shard.mlp
            qkv.append(attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], -1))
            gate_up.append(mlp.gate_up_proj(x).split(mlp.intermediate, -1))
            cols = slice(rank * attn.q_size, (rank + 1) * attn.q_size)
            o_sum = o_sum + attn.o_proj(heads_out[:, cols])
            cols = slice(rank * mlp.intermediate, (rank + 1) * mlp.intermediate)
            down_sum = down_sum + mlp.down_proj(mlp_in[:, cols])
        attn, mlp = whole.self_attn, whole.mlp
        want = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        tol = {"atol": 0.05, "rtol": 0.02}  # bf16 / 8-bit activations, summed in another order
        for i in range(3):
            assert_close(torch.cat([r[i] for r in qkv], -1), want[i], **tol)
        want = mlp.gate_up_proj(x).split(mlp.intermediate, -1)
        for i in range(2):
            assert_close(torch.cat([r[i] for r in gate_up], -1), want[i], **tol)
        assert_close(o_sum, attn.o_proj(heads_out), **tol)
        assert_close(down_sum, mlp.down_proj(mlp_in), **tol)


def test_tp2_engine_on_act_order_gptq_equals_one_rank(written):
    """Real ranks (processes, gloo): act-order GPTQ split over two, greedy and logprobs as one
    rank's."""
    path = written["gptq-int4-g32-actorder"].quantized
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    want = LLM(path, num_gpu_blocks_override=64, max_model_len=128).generate(
        prompts, params, use_tqdm=False
    )
    llm = LLM(path, tensor_parallel_size=2, num_gpu_blocks_override=64, max_model_len=128)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.close()
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for token in x.keys() & y.keys():
                assert abs(x[token].logprob - y[token].logprob) < 0.02


# ---------------------------------------------------------------- refusals, each naming it


def _edit_config(src: str, dest: Path, edit) -> Path:
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _edit_tensors(src: str, dest: Path, edit) -> Path:
    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors")
    return dest


def test_a_flag_that_disagrees_with_the_checkpoint_names_both(written, tiny_checkpoints):
    with pytest.raises(ValueError, match=r"--quantization awq disagrees.*quant_method 'gptq'"):
        load_model(
            written["gptq-int8-g32-sym"].quantized, torch.float32, CPU, 64, quantization="awq"
        )
    with pytest.raises(ValueError, match=r"--quantization gptq needs a checkpoint quantized"):
        load_model(tiny_checkpoints["qwen2"], torch.float32, CPU, 64, quantization="gptq")
    with pytest.raises(
        ValueError, match=r"quantization='bitsandbytes' is invalid.*fp8, compressed-tensors"
    ):
        LLM(tiny_checkpoints["qwen2"], quantization="bitsandbytes")
    # vLLM's kernel-specific aliases name the same format
    load_model(
        written["gptq-int8-g32-sym"].quantized, torch.float32, CPU, 64, quantization="gptq_marlin"
    )


def test_unsupported_schemes_are_named(written, tmp_path):
    def fp4(config):
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"

    path = _edit_config(written["ct-fp8-channel-dynamic"].quantized, tmp_path / "fp4", fp4)
    with pytest.raises(ValueError, match=r"self_attn\.q_proj: group_0: weights float 4-bit"):
        load_model(path, torch.float32, CPU, 64)

    def block(config):
        config["quantization_config"]["weight_block_size"] = [128, 128]

    path = _edit_config(written["fp8-static"].quantized, tmp_path / "block", block)
    with pytest.raises(ValueError, match=r"weight_block_size \[128, 128\].*not supported"):
        load_model(path, torch.float32, CPU, 64)

    def gs(config):
        config["quantization_config"]["group_size"] = 48

    path = _edit_config(written["gptq-int8-g32-sym"].quantized, tmp_path / "gs", gs)
    with pytest.raises(ValueError, match=r"qkv_proj \(gptq\): group size 48 does not divide"):
        load_model(path, torch.float32, CPU, 64)

    def gs64(config):  # divides the layers' 64 columns, not a rank's 32 of o_proj
        config["quantization_config"]["group_size"] = 64

    path = _edit_config(written["gptq-int8-g32-sym"].quantized, tmp_path / "gs64", gs64)
    tp = TPParts(TPLayout.of(model_config(read_config(path)), 1, 2), IdentityGroup(1, 2))
    with pytest.raises(ValueError, match=r"o_proj \(gptq\): group size 64 .* this rank's 32"):
        load_model(path, torch.float32, CPU, 64, tp=tp)

    def unknown(config):
        config["quantization_config"]["quant_method"] = "hqq"

    path = _edit_config(written["gptq-int8-g32-sym"].quantized, tmp_path / "hqq", unknown)
    with pytest.raises(ValueError, match=r"quantized with 'hqq', which is not supported"):
        load_model(path, torch.float32, CPU, 64)


def test_corrupt_tensors_are_named(written, tmp_path):
    gptq = written["gptq-int4-g32-actorder"].quantized
    path = _edit_tensors(
        gptq, tmp_path / "no-scales", lambda t: t.pop("model.layers.0.self_attn.k_proj.scales")
    )
    with pytest.raises(
        ValueError, match=r"layers\.0\.self_attn\.qkv_proj\.scales \(parts \['k'\]\)"
    ):
        load_model(path, torch.float32, CPU, 64)

    def narrow(t):
        name = "model.layers.1.mlp.up_proj.qweight"
        t[name] = t[name][:, :-8].contiguous()

    path = _edit_tensors(gptq, tmp_path / "shape", narrow)
    with pytest.raises(ValueError, match=r"mlp\.up_proj\.qweight \(part up\): checkpoint shape"):
        load_model(path, torch.float32, CPU, 64)

    def shape(t):
        t["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([64, 96])

    ct = written["ct-w4a16-g32-sym"].quantized
    path = _edit_tensors(ct, tmp_path / "weight-shape", shape)
    with pytest.raises(ValueError, match=r"down_proj\.weight_shape: weight_shape \[64, 96\]"):
        load_model(path, torch.float32, CPU, 64)

    def act_order(t):
        t["model.layers.0.self_attn.v_proj.g_idx"] = t[
            "model.layers.0.self_attn.v_proj.g_idx"
        ].flip(0)

    path = _edit_tensors(gptq, tmp_path / "g_idx", act_order)
    with pytest.raises(ValueError, match=r"v_proj\.g_idx differs from the projections fused"):
        load_model(path, torch.float32, CPU, 64)


def test_weight_bytes_count_what_the_kernels_hold(written, tiny_checkpoints):
    """The startup log's figure (linear.weight_bytes): a float model's parameters once (tied
    embedding and LM head once, plus the LM head's packed copy), a quantized one less."""
    plain = load_model(tiny_checkpoints["qwen2"], torch.float32, CPU, 64, linear_path="plain")
    params = sum(p.numel() * 4 for p in plain.parameters())
    assert weight_bytes(plain) == params
    packed = load_model(tiny_checkpoints["qwen2"], torch.float32, CPU, 64)
    head = packed.config.vocab_size * packed.config.hidden_size * 4
    assert weight_bytes(packed) == params + head  # the tied head's oneDNN copy
    int4 = load_model(written["awq-int4-g32"].quantized, torch.float32, CPU, 64)
    assert weight_bytes(int4) < weight_bytes(packed) - 0.7 * _linear_bytes(packed)


@pytest.mark.parametrize("name", ["float", "gptq-int4-g32-actorder", "ct-fp8-channel-dynamic"])
def test_plan_weighs_the_checkpoint_as_the_engine_loads_it(written, tiny_checkpoints, name):
    """`pagefleet plan CHECKPOINT` (no --weights) names the format the engine loads and
    weighs it as stored, within the kernels' own scale layouts of the engine's count (no
    oneDNN copy of a tied head: what a GPU engine holds)."""
    from pagefleet.common.capacity import model_shape
    from pagefleet.common.cli import build_parser
    from pagefleet.common.plan_command import plan_report

    path = tiny_checkpoints["qwen2"] if name == "float" else written[name].quantized
    args = build_parser().parse_args(["plan", path, "--gpu", "L4"])
    (row,) = plan_report(args, model_shape(path))["plans"]
    engine = load_model(path, torch.float32, CPU, 64, linear_path="plain")
    assert (
        row["weights_format"]
        == engine.weights_format
        == {
            "float": "float32",
            "gptq-int4-g32-actorder": "int4",
            "ct-fp8-channel-dynamic": "fp8",
        }[name]
    )
    assert row["weights_bytes"] == pytest.approx(weight_bytes(engine), rel=0.1)


# ---------------------------------------------------------------- GGUF kept as codes

GGUF_TYPES = {  # every coded type; q|k|v and gate|up fuse projections of different types
    "q_proj": T.Q4_K,
    "k_proj": T.Q4_K,
    "v_proj": T.Q6_K,
    "o_proj": T.Q8_0,
    "gate_proj": T.Q4_0,
    "up_proj": T.Q4_1,
    "down_proj": T.Q5_K,
}


@pytest.fixture(scope="module")
def gguf_mixed(tmp_path_factory) -> Path:
    """A one-layer llama (q/k rows interleaved as llama.cpp stores them) wide enough for
    k-quant blocks of 256, each projection in its own type."""
    from gguf_files import write_gguf_of
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("gguf")
    hf = write_tiny_checkpoint(
        root / "hf", "LlamaForCausalLM", num_layers=1, hidden_size=256, intermediate_size=512
    )
    return write_gguf_of(hf, root / "mixed.gguf", types=GGUF_TYPES)


def test_gguf_blocks_load_as_codes_equal_to_transformers_dequantizing(gguf_mixed, monkeypatch):
    """Each layer keeps its codes (a fused layer the widest and the finest group of its
    parts); as weights they are transformers' own dequantization of the file, exactly."""
    from transformers import AutoModelForCausalLM

    from pagefleet.engine.model.quant import kernels

    monkeypatch.setattr(kernels, "int_kernel", lambda w: ExactKernel(w.dequantize()))
    model = load_model(gguf_mixed, torch.float32, CPU, 64)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert (attn.qkv_proj.method.bits, attn.qkv_proj.method.group) == (8, 16)  # Q6_K's v
    assert (mlp.gate_up_proj.method.bits, mlp.gate_up_proj.method.group) == (4, 32)
    hf = AutoModelForCausalLM.from_pretrained(
        gguf_mixed.parent, gguf_file=gguf_mixed.name, dtype=torch.float32
    ).model.layers[0]
    gen = torch.Generator().manual_seed(4)
    x, mid = torch.randn(3, 256, generator=gen), torch.randn(3, 512, generator=gen)
    with torch.no_grad():
        qkv = [hf.self_attn.q_proj(x), hf.self_attn.k_proj(x), hf.self_attn.v_proj(x)]
        assert_close(attn.qkv_proj(x), torch.cat(qkv, -1))
        assert_close(attn.o_proj(x), hf.self_attn.o_proj(x))
        assert_close(mlp.gate_up_proj(x), torch.cat([hf.mlp.gate_proj(x), hf.mlp.up_proj(x)], -1))
        assert_close(mlp.down_proj(mid), hf.mlp.down_proj(mid))


def test_quantization_none_dequantizes_a_gguf_file_and_nothing_else(gguf_mixed, written):
    """--quantization none serves a GGUF file on float weights (transformers' dequantization
    of it); a checkpoint stored quantized any other way is refused, naming how it is stored."""
    from transformers import AutoModelForCausalLM

    model = load_model(gguf_mixed, torch.float32, CPU, 64, quantization="none")
    down = model.layers[0].mlp.down_proj
    assert type(down.method).__name__ == "FloatLinearMethod", down.method
    hf = AutoModelForCausalLM.from_pretrained(
        gguf_mixed.parent, gguf_file=gguf_mixed.name, dtype=torch.float32
    ).model.layers[0]
    mid = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_close(down(mid), hf.mlp.down_proj(mid))
    with pytest.raises(ValueError, match=r"--quantization none dequantizes a GGUF.*as gptq"):
        path = written["gptq-int8-g32-sym"].quantized
        load_model(path, torch.float32, CPU, 64, quantization="none")


def test_gguf_codes_shard_over_ranks_and_stay_small(gguf_mixed):
    """Two ranks' rows (q/k rows put back in HF's rotary order per rank) and block-aligned
    columns compute one rank's outputs; the linears hold codes, not float32."""
    cfg = model_config(read_config(str(gguf_mixed)))
    whole = load_model(gguf_mixed, torch.float32, CPU, 64)
    gen = torch.Generator().manual_seed(5)
    x, mid = torch.randn(3, 256, generator=gen), torch.randn(3, 512, generator=gen)
    qkv, down = [], 0.0
    with torch.no_grad():
        for rank in range(2):
            tp = TPParts(TPLayout.of(cfg, rank, 2), IdentityGroup(rank, 2))
            shard = load_model(gguf_mixed, torch.float32, CPU, 64, tp=tp).layers[0]
            qkv.append(shard.self_attn.qkv_proj(x).split([128, 64, 64], -1))
            down = down + shard.mlp.down_proj(mid[:, rank * 256 : (rank + 1) * 256])
        want = whole.layers[0].self_attn.qkv_proj(x).split([256, 128, 128], -1)
        # bfloat16 kernels, whose sums run in another order at another width: ~2^-8 of scale
        for i in range(3):
            tol = 0.01 * want[i].abs().max().item()
            assert_close(torch.cat([r[i] for r in qkv], -1), want[i], atol=tol, rtol=0)
        want = whole.layers[0].mlp.down_proj(mid)
        assert_close(down, want, atol=0.01 * want.abs().max().item(), rtol=0)
    # 4-8 bit codes with their scales: well under float32's 4 bytes a weight
    params = sum(m.in_features * m.out_features for n, m in whole.named_modules()
                 if n.startswith("layers.") and isinstance(m, Linear))  # fmt: skip
    assert _linear_bytes(whole) < 0.45 * 4 * params
