"""Capacity of mixture-of-experts models: every expert's weights count and the parameters a
token runs through are reported (Qwen3-30B-A3B's and Mixtral-8x7B's published totals and
active counts); expert parallelism's fullest GPU holds ceil(experts / ranks) experts; the
engine's shards, `pagefleet plan` and the operator's admission agree."""

from __future__ import annotations

import pytest
import torch
from test_capacity import H100, _plan_json, _write
from test_operator_admission import _spec, _verdict

from pagefleet.common.capacity import (
    GB,
    model_shape,
    parameters_per_gpu,
    plan_on_gpu,
)
from pagefleet.engine.model.experts import FusedExperts
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.loader import read_config
from pagefleet.engine.model.parallel import TPLayout
from pagefleet.engine.model.registry import family_of, model_config

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("config", "total", "active"),
    [(QWEN3_30B_A3B, 30.53, 3.35), (MIXTRAL_8X7B, 46.70, 12.88)],
    ids=["qwen3-30b-a3b", "mixtral-8x7b"],
)
def test_every_expert_counts_and_active_parameters_are_reported(
    tmp_path, capsys, config, total, active
):
    """The model cards' figures (30.5B / 3.3B activated; 46.7B / 12.9B per token), from the
    config alone; `pagefleet plan` prints them."""
    shape = model_shape(config)
    assert round(shape.num_parameters / 1e9, 2) == total
    assert round(shape.num_active_parameters / 1e9, 2) == active
    text = main_plan(tmp_path, capsys, config)
    experts = config.get("num_experts") or config["num_local_experts"]
    assert f"{experts} experts, {config['num_experts_per_tok']} per token" in text
    assert f"{total:.2f}B parameters ({active:.2f}B active per token)" in text


def main_plan(tmp_path, capsys, config: dict, *flags: str) -> str:
    from pagefleet.common.cli import main

    assert main(["plan", _write(tmp_path, config), *flags]) == 0
    return capsys.readouterr().out


def test_expert_parallel_weights_per_gpu_are_the_fullest_ranks(tmp_path, capsys):
    """Mixtral's 8 experts over 3 GPUs: tensor parallel gives every GPU a third of each
    expert; expert parallel gives the fullest GPU 3 whole experts (3/8 > 1/3), so less KV."""
    shape = model_shape(MIXTRAL_8X7B)
    experts, rest = shape.num_expert_parameters, shape.num_parameters - shape.num_expert_parameters
    tp = parameters_per_gpu(shape.num_parameters, 3, shape, expert_parallel=False)
    ep = parameters_per_gpu(shape.num_parameters, 3, shape, expert_parallel=True)
    assert tp == pytest.approx(shape.num_parameters / 3)
    assert ep == pytest.approx(rest / 3 + experts * 3 / 8)
    split = _plan_json(capsys, _write(tmp_path, MIXTRAL_8X7B), "--tp", "3")["plans"][0]
    whole = _plan_json(
        capsys, _write(tmp_path, MIXTRAL_8X7B), "--tp", "3", "--enable-expert-parallel"
    )["plans"][0]
    assert whole["expert_parallel"] and not split["expert_parallel"]
    assert whole["weights_bytes"] == int(ep * 2) and split["weights_bytes"] == int(tp * 2)
    assert whole["kv_tokens"] < split["kv_tokens"]


def test_the_operator_admits_with_the_plans_weights(tmp_path, capsys):
    """A pool of 4 GPUs with --enable-expert-parallel: the operator's verdict quotes the
    weights per GPU `pagefleet plan --enable-expert-parallel` computes."""
    capacity = {"modelConfig": MIXTRAL_8X7B, "gpu": "H100-80GB", "overheadGB": 5}
    pool = {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 4}}}
    for ep in (False, True):
        args = {"max-model-len": 32768, **({"enable-expert-parallel": True} if ep else {})}
        verdict = _verdict(_spec(args, capacity, pool))
        flags = ["--tp", "4", "--overhead-gb", "5", *(["--enable-expert-parallel"] * ep)]
        (row,) = _plan_json(capsys, _write(tmp_path, MIXTRAL_8X7B), *flags)["plans"]
        assert verdict.status == "True"
        assert f"bfloat16 weights {row['weights_bytes'] / GB:.1f} GB per GPU" in verdict.message
        plan = plan_on_gpu(
            model_shape(MIXTRAL_8X7B),
            H100,
            weights_format="bfloat16",
            kv_format="bfloat16",
            tensor_parallel_size=4,
            expert_parallel=ep,
        )
        assert plan.weights_bytes == row["weights_bytes"]


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "qwen3_5_moe"])
def test_the_engines_shards_hold_the_experts_capacity_counts(
    moe_checkpoints, case, expert_parallel
):
    """Each rank's experts, as the engine builds them (5 and 3 experts over 2 ranks), hold the
    parameters the capacity module gives the fullest rank; every expert in the checkpoint is
    counted once (exact count from the safetensors headers), and only what the engine loads
    (Qwen3.5-MoE's multimodal checkpoint: not its vision tower)."""
    path = moe_checkpoints[case]
    shape = model_shape(path)
    hf = read_config(path)
    cfg = model_config(hf)
    family, _ = family_of(hf)
    held = []
    for rank in range(2):
        layout = TPLayout.of(cfg, rank, 2, expert_parallel)
        with torch.device("meta"):
            model = family.build(cfg, 64, TPParts(layout, None))
        held.append(
            sum(
                p.numel()
                for m in model.modules()
                if isinstance(m, FusedExperts)
                for p in m.parameters()
            )
        )
    with torch.device("meta"):
        one = family.build(model_config(read_config(path)), 64, None)
    assert shape.num_parameters == sum(p.numel() for p in one.parameters())
    assert sum(held) == shape.num_expert_parameters
    expected = parameters_per_gpu(shape.num_expert_parameters, 2, shape, expert_parallel)
    assert max(held) == pytest.approx(expected)
