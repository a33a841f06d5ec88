"""The checkpoint loader's refusals: a checkpoint that does not fit the model its family builds
is one error naming the tensor (or parameter and part), never a silently half-loaded model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefleet.engine.model.loader import load_model
from pagefleet.engine.model.registry import model_config, supported_architectures

CPU = torch.device("cpu")


def _edited(src: str, dest: Path, edit) -> Path:
    shutil.copytree(src, dest)
    file = dest / "model.safetensors"
    weights = load_file(file)
    edit(weights)
    save_file(weights, file, metadata={"format": "pt"})
    return dest


def test_a_missing_part_of_a_fused_projection_is_named(tiny_checkpoints, tmp_path):
    path = _edited(
        tiny_checkpoints["llama"],
        tmp_path / "no-k",
        lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"),
    )
    with pytest.raises(
        ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight \(parts \['k'\]\)"
    ):
        load_model(path, torch.float32, CPU, 64)


def test_a_missing_plain_weight_is_named(tiny_checkpoints, tmp_path):
    path = _edited(
        tiny_checkpoints["llama"],
        tmp_path / "no-norm",
        lambda w: w.pop("model.layers.0.post_attention_layernorm.weight"),
    )
    with pytest.raises(ValueError, match=r"lacks weights: \['layers\.0\.post_attention_layernorm"):
        load_model(path, torch.float32, CPU, 64)


def test_an_unexpected_tensor_and_a_wrong_shape_are_named(tiny_checkpoints, tmp_path):
    def extra(w):
        w["model.layers.0.mystery.weight"] = torch.zeros(2)

    path = _edited(tiny_checkpoints["llama"], tmp_path / "extra", extra)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.mystery\.weight'"):
        load_model(path, torch.float32, CPU, 64)

    def wrong(w):
        name = "model.layers.0.mlp.down_proj.weight"
        w[name] = torch.zeros(w[name].shape[0], w[name].shape[1] + 1)

    path = _edited(tiny_checkpoints["llama"], tmp_path / "wrong", wrong)
    with pytest.raises(ValueError, match=r"down_proj\.weight: checkpoint shape"):
        load_model(path, torch.float32, CPU, 64)


def test_an_unknown_architecture_lists_the_supported_ones(tiny_checkpoints):
    config = json.loads((Path(tiny_checkpoints["llama"]) / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM.*not supported") as err:
        model_config(config)
    for arch in supported_architectures():
        assert arch in str(err.value)
