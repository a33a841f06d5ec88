"""The model's fused linear layouts compute the checkpoint's separate projections.

q|k|v and gate|up are concatenated into one weight each at load time, and on a float32 CPU
model every linear then runs on a oneDNN-prepacked weight with the residual add fused into
o_proj and down_proj. Against HF's own modules, layer by layer, for every architecture we load
(plus a Llama with o_proj/MLP biases): a wrong concatenation order, a bias dropped or put in
the wrong part, a packed weight read transposed or a residual added twice fails here; and per
tensor-parallel rank, a wrong head or column slice fails too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.testing import assert_close

from hf_reference import ARCH_CASES, hf_model, randomise_biases
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.linear import linear_add
from pagefleet.engine.model.loader import load_model, read_config
from pagefleet.engine.model.parallel import TPLayout
from pagefleet.engine.model.registry import model_config

ROWS = 5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("biased") / "llama-biased",
        "LlamaForCausalLM",
        attention_bias=True,
        mlp_bias=True,
    )
    randomise_biases(path / "model.safetensors")
    return {**tiny_checkpoints, "llama-biased": str(path)}


@dataclass
class IdentityGroup:
    """A rank's collectives with the reduction left to the test (it sums the ranks itself)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]


def _inputs(width: int, seed: int) -> torch.Tensor:
    return torch.randn(ROWS, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("linear_path", ["plain", "packed"])
@pytest.mark.parametrize("name", [*ARCH_CASES, "llama-biased"])
def test_fused_layers_equal_separate_projections(checkpoints, name, linear_path):
    path = checkpoints[name]
    ours = load_model(path, torch.float32, CPU, max_positions=64, linear_path=linear_path)
    hf = hf_model(path)
    assert (getattr(ours.lm_head, "packed", None) is not None) == (linear_path == "packed")
    x = _inputs(ours.config.hidden_size, 0)
    residual = _inputs(ours.config.hidden_size, 1)
    with torch.no_grad():
        for layer, ref in zip(ours.layers, hf.model.layers, strict=True):
            attn = layer.self_attn
            q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            assert_close(q, ref.self_attn.q_proj(x))
            assert_close(k, ref.self_attn.k_proj(x))
            assert_close(v, ref.self_attn.v_proj(x))
            heads_out = _inputs(attn.q_size, 2)
            assert_close(
                linear_add(attn.o_proj, heads_out, residual.clone()),
                residual + ref.self_attn.o_proj(heads_out),
            )
            assert_close(layer.mlp(x, residual=residual.clone()), residual + ref.mlp(x))
        assert_close(ours.compute_logits(x), hf.lm_head(x))


@pytest.mark.parametrize("linear_path", ["plain", "packed"])
@pytest.mark.parametrize("name", ["llama-biased", "mistral", "qwen2"])
def test_tp_shards_of_fused_layers_equal_slices_of_separate_projections(
    checkpoints, name, linear_path
):
    """Two ranks (mistral: one KV head, replicated; qwen2: q/k/v biases): each rank's q|k|v
    and gate|up are its slices of HF's outputs; the row-parallel o_proj and down_proj partial
    sums add up to HF's output with the bias counted once."""
    path = checkpoints[name]
    cfg = model_config(read_config(path))
    hf_layer = hf_model(path).model.layers[0]
    x = _inputs(cfg.hidden_size, 0)
    heads_out = _inputs(cfg.num_heads * cfg.head_dim, 2)
    mlp_in = _inputs(cfg.intermediate_size, 3)
    o_sum, down_sum = 0.0, 0.0
    with torch.no_grad():
        for rank in range(2):
            layout = TPLayout.of(cfg, rank, 2)
            tp = TPParts(layout, IdentityGroup(rank, 2))
            ours = load_model(
                path, torch.float32, CPU, max_positions=64, tp=tp, linear_path=linear_path
            )
            attn, mlp = ours.layers[0].self_attn, ours.layers[0].mlp
            q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            kv = slice(
                layout.first_kv_head * cfg.head_dim,
                layout.first_kv_head * cfg.head_dim + attn.kv_size,
            )
            assert_close(
                q, hf_layer.self_attn.q_proj(x)[:, rank * attn.q_size : (rank + 1) * attn.q_size]
            )
            assert_close(k, hf_layer.self_attn.k_proj(x)[:, kv])
            assert_close(v, hf_layer.self_attn.v_proj(x)[:, kv])
            cols = slice(rank * mlp.intermediate, (rank + 1) * mlp.intermediate)
            gate, up = mlp.gate_up_proj(x).split(mlp.intermediate, dim=-1)
            assert_close(gate, hf_layer.mlp.gate_proj(x)[:, cols])
            assert_close(up, hf_layer.mlp.up_proj(x)[:, cols])
            o_sum = o_sum + attn.o_proj(heads_out[:, rank * attn.q_size : (rank + 1) * attn.q_size])
            down_sum = down_sum + mlp.down_proj(mlp_in[:, cols])
        o_bias = hf_layer.self_attn.o_proj.bias
        down_bias = hf_layer.mlp.down_proj.bias
        # Each rank added the bias after its (identity) reduction: count it once.
        o_sum = o_sum if o_bias is None else o_sum - o_bias
        down_sum = down_sum if down_bias is None else down_sum - down_bias
        assert_close(o_sum, hf_layer.self_attn.o_proj(heads_out))
        assert_close(down_sum, hf_layer.mlp.down_proj(mlp_in))
