"""The mixture-of-experts layer on its own: our block equals HF transformers' block (the oracle)
for Qwen3-MoE, Mixtral and Qwen3.5-MoE (its shared expert and gate), on a random batch and on
batches where every token picks the same experts (the others get none); its shards over two
ranks (gloo, one thread per rank) sum to the one-rank block, with experts split by columns
(tensor parallel) or placed whole, unevenly (expert parallel, both dispatches); a checkpoint of
all-expert tensors loads as per-expert ones do; Qwen3.5-MoE's checkpoint names (multimodal or
text-only) reach the hybrid and the MoE parameters; parallel sizes the experts cannot take are
refused; the load counters summarise."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import pytest
import torch
from torch.testing import assert_close

from hf_reference import hf_model
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.distributed import group as group_module
from pagefleet.engine.distributed.group import RankGroup
from pagefleet.engine.model.config import MoESpec
from pagefleet.engine.model.expert_load import summarise
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.loader import load_model, read_config
from pagefleet.engine.model.moe import SparseMoeBlock
from pagefleet.engine.model.parallel import TPLayout, expert_ranges
from pagefleet.engine.model.registry import model_config

CPU = torch.device("cpu")
TOKENS = 7
CASES = ["qwen3_moe", "mixtral", "qwen3_5_moe"]
# The decoder layers holding experts in each MOE_CASES checkpoint.
SPARSE_LAYERS = {"qwen3_moe": [0, 2], "mixtral": [0, 1], "qwen3_5_moe": [0, 1, 2]}


def batches(block: SparseMoeBlock, hidden: int) -> dict[str, torch.Tensor]:
    """A random batch; a skewed one: every token a positive multiple of the router row of
    largest norm, so every token ranks the experts alike (the same top-k, the rest idle); and
    one token (under all-to-all dispatch one rank has no token of its own)."""
    g = torch.Generator().manual_seed(0)
    router = block.gate.weight if hasattr(block.gate, "weight") else None
    assert router is not None, "the block-level tests run on an unpacked model"
    favourite = router[router.norm(dim=1).argmax()]
    scales = torch.linspace(0.5, 3.0, TOKENS).unsqueeze(1)
    return {
        "random": torch.randn(TOKENS, hidden, generator=g),
        "skewed": scales * favourite / favourite.norm(),
        "one-token": torch.randn(1, hidden, generator=g),
    }


def sparse_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]


@torch.no_grad()
def block_outputs(model) -> dict[tuple[int, str], torch.Tensor]:
    """Each sparse layer's block output (residual 0) on each batch."""
    out = {}
    for i in sparse_layers(model):
        block = model.layers[i].mlp
        for name, x in batches(block, model.config.hidden_size).items():
            out[(i, name)] = block(x.clone(), torch.zeros_like(x))
    return out


@pytest.mark.parametrize("case", CASES)
def test_block_equals_hf_including_batches_that_leave_experts_idle(moe_checkpoints, case):
    """Fails for: a router that renormalises when it should not (or not when it should), a
    wrong expert loaded into a slot (w1/w3 swapped, experts out of order), a grouping that
    drops or double-counts pairs when experts get no token or all of them, a shared expert
    missing, ungated or loaded from the wrong tensors."""
    path = moe_checkpoints[case]
    ours = load_model(path, torch.float32, CPU, max_positions=64, linear_path="plain")
    hf = hf_model(path)
    outputs = block_outputs(ours)
    assert sparse_layers(ours) == SPARSE_LAYERS[case]
    skew_idle = 0
    with torch.no_grad():
        for (i, name), got in outputs.items():
            x = batches(ours.layers[i].mlp, ours.config.hidden_size)[name]
            assert_close(got, hf.model.layers[i].mlp(x.unsqueeze(0))[0], rtol=1e-5, atol=1e-6)
            if name == "skewed":
                _, ids = torch.topk(ours.layers[i].mlp.gate(x), 2, dim=-1)
                assert len(set(map(tuple, ids.sort(dim=1).values.tolist()))) == 1
                skew_idle += ours.config.moe.num_experts - 2
    assert skew_idle > 0


def run_ranks(path: str, size: int, expert_parallel: bool, backend: str, work):
    """`work(model)` on every rank of a gloo group, one thread per rank; the results by rank."""
    store = torch.distributed.HashStore()
    results: list = [None] * size
    errors: list[BaseException] = []
    cfg = model_config(read_config(path))

    def rank_main(rank: int) -> None:
        group = RankGroup(store, rank, size, "gloo", CPU, "127.0.0.1")
        try:
            layout = TPLayout.of(cfg, rank, size, expert_parallel)
            tp = TPParts(layout, group, backend)
            model = load_model(
                path, torch.float32, CPU, max_positions=64, tp=tp, linear_path="plain"
            )
            results[rank] = work(model)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)
        finally:
            group.close()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


MODES = {
    "tensor-parallel": (False, "allgather_reducescatter"),
    "expert-parallel": (True, "allgather_reducescatter"),
    "expert-parallel-alltoall": (True, "alltoall"),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one(moe_checkpoints, case, mode, monkeypatch):
    """Each rank's block output (after the combine) equals the one-rank block's, on every
    batch: catches a wrong column slice of an expert, experts placed on two ranks or none
    (5 and 3 experts over 2 ranks: 3+2 and 2+1), rows sent to the wrong rank or returned out of
    order, a rank with no token or no routed row, and the combine counting a partial twice."""
    monkeypatch.setattr(group_module, "OP_TIMEOUT", timedelta(seconds=60))
    path = moe_checkpoints[case]
    one = block_outputs(load_model(path, torch.float32, CPU, max_positions=64, linear_path="plain"))
    expert_parallel, backend = MODES[mode]

    def work(model):
        held = [layer.mlp.experts.shard for layer in model.layers if hasattr(layer.mlp, "experts")]
        return block_outputs(model), held[0]

    ranks = run_ranks(path, 2, expert_parallel, backend, work)
    shards = [shard for _, shard in ranks]
    num_experts = model_config(read_config(path)).moe.num_experts
    if expert_parallel:
        held = [e for s in shards for e in range(s.first, s.end)]
        assert held == list(range(num_experts))  # each expert on exactly one rank
        assert shards[0].count == shards[1].count + 1  # the uneven split
    else:
        assert all(s.count == num_experts for s in shards)
    for outputs, _ in ranks:
        assert outputs.keys() == one.keys()
        for key, want in one.items():
            assert_close(outputs[key], want, rtol=1e-5, atol=1e-6, msg=f"{key}")


def test_all_expert_tensors_load_as_per_expert_ones(moe_checkpoints, tmp_path):
    """Qwen3.5-MoE's checkpoints store every expert of a layer in one tensor
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]): rewritten so, the same
    model loads, whole and as an expert-parallel rank's share (only its experts read)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = moe_checkpoints["qwen3_moe"]
    fused_dir = tmp_path / "fused"
    shutil.copytree(path, fused_dir)
    weights = load_file(fused_dir / "model.safetensors")
    cfg = model_config(read_config(path))
    for layer in cfg.moe.sparse_layers:
        prefix = f"model.layers.{layer}.mlp.experts"

        def take(proj: str, prefix=prefix) -> list[torch.Tensor]:
            return [weights.pop(f"{prefix}.{e}.{proj}.weight") for e in range(5)]

        gate, up, down = take("gate_proj"), take("up_proj"), take("down_proj")
        weights[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
        )
        weights[f"{prefix}.down_proj"] = torch.stack(down)
    save_file(weights, fused_dir / "model.safetensors", metadata={"format": "pt"})
    want = load_model(path, torch.float32, CPU, max_positions=64)
    got = load_model(fused_dir, torch.float32, CPU, max_positions=64, linear_path="plain")
    x = torch.randn(4, cfg.hidden_size)
    with torch.no_grad():
        for layer in cfg.moe.sparse_layers:
            assert_close(got.layers[layer].mlp(x.clone(), 0 * x), want.layers[layer].mlp(x, 0 * x))
    # Rank 1 of 2 under expert parallelism: experts 3 and 4 only, taken from the 3-D tensors.
    layout = TPLayout.of(cfg, 1, 2, expert_parallel=True)
    rank1 = load_model(
        fused_dir, torch.float32, CPU, 64, tp=TPParts(layout, None), linear_path="plain"
    )
    w13 = rank1.layers[0].mlp.experts.w13
    assert_close(w13, weights["model.layers.0.mlp.experts.gate_up_proj"][3:5])


MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def _moe_config(experts: int, inter: int, shared: int = 0):
    cfg = model_config(MIXTRAL_CONFIG)
    spec = MoESpec(experts, 2, inter, True, tuple(range(cfg.num_layers)), shared)
    return dataclasses.replace(cfg, moe=spec)


@pytest.mark.parametrize(
    ("experts", "inter", "shared", "size", "expert_parallel", "error"),
    [
        (8, 30, 0, 4, False, "expert intermediate size \\(30\\)"),
        (8, 32, 6, 4, False, "shared expert's intermediate size \\(6\\)"),
        (3, 32, 0, 4, True, "at least one expert per rank; the model has 3"),
    ],
)
def test_parallel_sizes_the_experts_cannot_take_are_refused(
    experts, inter, shared, size, expert_parallel, error
):
    """Tensor parallelism splits every expert's columns: the size must divide them. Expert
    parallelism places whole experts: any count of at least one per rank is taken (uneven
    counts included, below), fewer experts than ranks is refused."""
    with pytest.raises(ValueError, match=error):
        TPLayout.of(_moe_config(experts, inter, shared), 0, size, expert_parallel)


@pytest.mark.parametrize(("experts", "size"), [(8, 2), (5, 2), (7, 4), (6, 4)])
def test_expert_parallel_places_every_expert_once_however_uneven(experts, size):
    layouts = [TPLayout.of(_moe_config(experts, 30), r, size, True) for r in range(size)]
    held = [e for t in layouts for e in range(t.experts.first, t.experts.end)]
    assert held == list(range(experts))
    counts = [t.experts.count for t in layouts]
    assert max(counts) - min(counts) <= 1 and all(t.experts.columns == 30 for t in layouts)
    assert [(t.experts.first, t.experts.count) for t in layouts] == expert_ranges(experts, size)


def test_qwen3_moe_sparse_layers_follow_the_step_and_the_dense_list():
    cfg = model_config(
        {
            **MIXTRAL_CONFIG,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_hidden_layers": 6,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert cfg.moe.sparse_layers == (1, 5)
    assert [cfg.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize("backend", ["pplx", "deepep_low_latency", "bogus"])
def test_all2all_backends_not_built_are_refused_by_name(backend):
    with pytest.raises(ValueError, match=f"all2all_backend='{backend}'.*allgather_reducescatter"):
        EngineArgs(model="m", all2all_backend=backend)


def test_load_summary_per_layer_and_per_rank():
    stats = summarise({3: [10, 0, 2, 0], 1: [3, 3, 3, 3]}, expert_ranges(4, 2))
    assert [layer.layer for layer in stats.layers] == [1, 3]
    busy = stats.layers[1]
    assert (busy.routed, busy.max_expert, busy.mean_expert) == (12, 10, 3.0)
    assert (busy.max_rank, busy.mean_rank) == (10, 6.0)
    assert busy.imbalance == pytest.approx(10 / 3)
    assert stats.layers[0].imbalance == 1.0


def test_quantized_expert_tensors_are_refused_by_name():
    """A GPTQ/AWQ/FP8 MoE checkpoint's expert tensors (qweight, weight_scale...) name the
    reason instead of `unexpected weight`; float expert weights map to the stacked ones."""
    from pagefleet.engine.model.registry import family_of

    family, _ = family_of(MIXTRAL_CONFIG)
    with torch.device("meta"):
        model = family.build(model_config(MIXTRAL_CONFIG), 64, None)
    name = "model.layers.1.block_sparse_moe.experts.2.w1"
    assert model.checkpoint_target(f"{name}.weight") == ("layers.1.mlp.experts.w13", (2, "gate"))
    for suffix in ("qweight", "weight_scale", "weight_packed"):
        with pytest.raises(ValueError, match="quantized experts are not supported yet"):
            model.checkpoint_target(f"{name}.{suffix}")


@pytest.mark.parametrize(
    ("prefix", "architecture"),
    [
        ("model.language_model.", "Qwen3_5MoeForConditionalGeneration"),
        ("model.", "Qwen3_5MoeForCausalLM"),
    ],
)
def test_qwen3_5_moe_names_reach_hybrid_and_expert_parameters(prefix, architecture):
    """Both checkpoint forms of Qwen3.5-MoE: the hybrid's names (fused in_proj, the vision
    tower skipped) and the experts' (per-expert, all-expert tensors, the shared expert and its
    gate) map to our parameters; every layer is sparse, the top-k always renormalised, and no
    dense MLP size is needed."""
    text = {
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 12,
    }
    hf = {"architectures": [architecture]}
    hf |= {"text_config": text} if "Conditional" in architecture else text
    cfg = model_config(hf)
    assert cfg.moe == MoESpec(3, 2, 8, True, (0, 1), 12)
    assert cfg.kv_layer_indices == (1,) and cfg.state_shape() is not None
    from pagefleet.engine.model.registry import family_of

    family, _ = family_of(hf)
    with torch.device("meta"):
        model = family.build(cfg, 64, None)
    layer = f"{prefix}layers.0."
    targets = {
        "linear_attn.in_proj_z.weight": ("layers.0.linear_attn.in_proj.weight", "z"),
        "mlp.gate.weight": ("layers.0.mlp.gate.weight", None),
        "mlp.experts.2.up_proj.weight": ("layers.0.mlp.experts.w13", (2, "up")),
        "mlp.experts.gate_up_proj": ("layers.0.mlp.experts.w13", (None, ("gate", "up"))),
        "mlp.shared_expert.up_proj.weight": (
            "layers.0.mlp.shared_expert.gate_up_proj.weight",
            "up",
        ),
        "mlp.shared_expert_gate.weight": ("layers.0.mlp.shared_expert.gate.weight", None),
    }
    for name, want in targets.items():
        assert model.checkpoint_target(layer + name) == want, name
    assert model.checkpoint_target("model.visual.blocks.0.attn.qkv.weight") is None
    params = dict(model.named_parameters())
    assert all(target in params for target, _ in targets.values())
