"""A GGUF file as a checkpoint: its metadata as config.json's keys, its tensors under the Hugging
Face names the families already map (model/checkpoint.py dispatches here for `*.gguf`).

llama.cpp's names and conventions are undone here and nowhere else: `blk.N.attn_q.weight` is
`model.layers.N.self_attn.q_proj.weight`, a file without `output.weight` ties its LM head, and
for the `llama` architecture llama.cpp stored the rows of q/k interleaved per rotary pair (its
rope pairs neighbours; HF's rotates halves), which `read()` puts back.

Before anything is allocated the file is checked whole: a supported architecture, every tensor
of a supported type, named as the family expects and shaped as the metadata says. The model
the engine then builds is therefore no larger than the tensors the file really holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from pagefleet.common.gguf_file import GGUFError, GGUFHeader, TensorInfo, map_file, read_header
from pagefleet.engine.model.ggml_quants import SUPPORTED_TYPES, dequantize

# general.architecture -> the HF architecture its family serves.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MAX_CONTEXT = 1 << 22  # context_length sizes the rotary table: a file may not claim more
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_config(path: str | Path) -> dict:
    """The HF config.json this file's metadata describes, after checking the whole file."""
    return _checked(path)[1]


def _checked(path: str | Path) -> tuple[GGUFHeader, dict]:
    header = read_header(path)
    config = _config_of(header)
    _check_tensors(header, config)
    return header, config


def _config_of(header: GGUFHeader) -> dict:
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{header.path.name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    meta = header.metadata

    def key(name: str, default=None, kind=int):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{header.path.name}: metadata lacks {arch}.{name}")
        if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:
            raise GGUFError(f"{header.path.name}: {arch}.{name} = {value!r} is not usable")
        return value

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    embed = header.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise GGUFError(f"{header.path.name}: no 2-D token_embd.weight tensor")
    context = key("context_length")
    if context > MAX_CONTEXT:
        raise GGUFError(f"{header.path.name}: context_length {context} is more than {MAX_CONTEXT}")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "max_position_embeddings": context,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", kind=float),
        "rope_theta": key("rope.freq_base", 10000.0, kind=float),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = key("rope.scaling.factor", kind=float)
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling != "none":
        raise GGUFError(f"{header.path.name}: rope scaling {scaling!r} is not supported")
    for name in ("bos_token_id", "eos_token_id"):
        if isinstance(meta.get(f"tokenizer.ggml.{name}"), int):
            config[name] = meta[f"tokenizer.ggml.{name}"]
    return config


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (row-major) of every tensor the family needs (q/k/v biases and q/k
    norms are `_optional_shape`'s: the family decides by architecture whether it has them)."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"token_embd.weight": (config["vocab_size"], hidden), "output_norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (config["vocab_size"], hidden)
    per_layer = {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q, hidden),
        "attn_k.weight": (kv, hidden),
        "attn_v.weight": (kv, hidden),
        "attn_output.weight": (hidden, q),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def _optional_shape(name: str, config: dict) -> tuple[int, ...] | None:
    """The shape of an optional tensor the family accepts (q/k/v biases, q/k norms)."""
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    found = _LAYER_TENSOR.fullmatch(name)
    if found is None or int(found.group(1)) >= config["num_hidden_layers"]:
        return None
    return {
        "attn_q.bias": (q,),
        "attn_k.bias": (kv,),
        "attn_v.bias": (kv,),
        "attn_q_norm.weight": (hd,),
        "attn_k_norm.weight": (hd,),
    }.get(f"{found.group(2)}.{found.group(3)}")


def _check_tensors(header: GGUFHeader, config: dict) -> None:
    file = header.path.name
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(header.tensors))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise GGUFError(f"{file}: lacks tensors {', '.join(missing[:3])}{more}")
    for info in header.tensors.values():
        shape = expected.get(info.name) or _optional_shape(info.name, config)
        if shape is None:
            raise GGUFError(f"{file}: tensor {info.name!r} is not one a {config['model_type']} has")
        if info.shape != shape:
            raise GGUFError(f"{file}: tensor {info.name!r} has shape {info.shape}, not {shape}")
        if info.ggml_type not in SUPPORTED_TYPES:
            names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise GGUFError(
                f"{file}: tensor {info.name!r} has type {info.ggml_type.name}, which pagefleet "
                f"does not load (supported: {names})"
            )


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    found = _LAYER_TENSOR.fullmatch(gguf_name)
    if found is None or found.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"tensor {gguf_name!r} has no Hugging Face name")
    layer, part, kind = found.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


@dataclass
class GGUFTensorSource:
    """One GGUF tensor under its HF name (a `TensorSource`, model/weights.py). It keeps its ggml
    type and raw bytes, so a loader that keeps blocks quantized can take `raw()` as stored;
    `read()` dequantizes to float32 in HF's layout."""

    name: str
    info: TensorInfo
    file: memoryview  # the mapped file (copy-on-write, never written)
    rotary_heads: int | None = None  # llama's q/k: rows to put back in HF's rotary order

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        return self.info.ggml_type

    def raw(self) -> torch.Tensor:
        """The tensor's bytes as stored (uint8, 1-D), viewed in place."""
        return torch.frombuffer(
            self.file, dtype=torch.uint8, count=self.info.nbytes, offset=self.info.offset
        )

    def read(self) -> torch.Tensor:
        values = dequantize(self.raw(), self.ggml_type).reshape(self.shape)
        if self.rotary_heads is not None:
            values = undo_rotary_interleave(values, self.rotary_heads)
        return values

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.read().narrow(dim, start, length)


def undo_rotary_interleave(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reordered each head's rows from HF's halves [x0..x(d/2-1) |
    x(d/2)..x(d-1)] into pairs (x0, x(d/2)), (x1, x(d/2+1)), ...; this reads them back."""
    head_dim = rows.shape[0] // heads
    paired = rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:])
    return paired.transpose(1, 2).reshape(rows.shape).contiguous()


def tensor_types(path: str | Path) -> dict[str, GGMLQuantizationType]:
    """Every tensor's ggml type under its HF name (the quantized method chooses by them)."""
    header, _ = _checked(path)
    return {hf_name(info.name): info.ggml_type for info in header.tensors.values()}


def tensor_sources(path: str | Path) -> Iterator[GGUFTensorSource]:
    """Every tensor of the file under its HF name (after `read_config`'s checks)."""
    path = Path(path)
    header, config = _checked(path)
    file = map_file(path)
    interleaved = config["model_type"] == "llama"
    rotary = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    for info in header.tensors.values():
        heads = None
        found = _LAYER_TENSOR.fullmatch(info.name)
        if interleaved and found is not None:
            heads = rotary.get(found.group(2))
        yield GGUFTensorSource(hf_name(info.name), info, file, heads)
