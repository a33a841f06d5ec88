"""Load a local Hugging Face checkpoint directory: config, safetensors shards, tokenizer.

Weights stream shard by shard into a model built without initialisation; q/k/v and gate/up
projections are concatenated on the way in (the model runs them as one matmul each). A
tensor-parallel rank reads only its slice of each tensor from the file (see model/parallel.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagefleet.engine.kv_cache.fp8 import (
    FP8_KV_DTYPE,
    LayerScales,
    is_fp8,
    is_kv_scale,
    read_kv_scales,
)
from pagefleet.engine.model.packed import prepack_supported
from pagefleet.engine.model.parallel import TPLayout
from pagefleet.engine.model.rope import RotaryEmbedding
from pagefleet.engine.model.transformer import CausalLM, ModelConfig, TPParts

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (--dtype): auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def kv_cache_format(
    kv_cache_dtype: str, dtype: torch.dtype, device: torch.device, path: str | Path
) -> tuple[torch.dtype, list[LayerScales] | None]:
    """The KV pool's dtype for --kv-cache-dtype (auto: the model's `dtype`) and, for fp8, the
    per-layer (k_scale, v_scale): the checkpoint's calibrated ones, 1.0 where it has none. Every
    tensor-parallel rank reads the same scales (they are per layer, not per head)."""
    if is_fp8(kv_cache_dtype):
        num_layers = ModelConfig.from_hf(read_config(path)).num_layers
        return FP8_KV_DTYPE, read_kv_scales(weight_files(Path(path)), num_layers)
    return (dtype if kv_cache_dtype == "auto" else resolve_dtype(kv_cache_dtype, device)), None


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    return json.loads(config_file.read_text())


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{path} lacks shards named in its index: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(
        f"{path} has no weights: expected model.safetensors or model.safetensors.index.json"
    )


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TPParts | None = None,
    prepack: bool = True,
) -> CausalLM:
    """The model (or with `tp`, this rank's shard of it) on `device`, in `dtype`; on a float32
    CPU model the linear layers then run on oneDNN-prepacked weights (model/packed.py) unless
    `prepack` is False (the benchmarks' and tests' unpacked reference)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = ModelConfig.from_hf(read_config(path))
    files = weight_files(path)
    layout = tp.layout if tp else None
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions, tp)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope).to(device)
    params = dict(model.named_parameters())
    # Each fused parameter is filled part by part; remember which parts arrived.
    loaded: set[str] = set()
    fused_parts: dict[str, set[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target, part = _target(name)
                if target is None or (cfg.tie_word_embeddings and target == "lm_head.weight"):
                    continue
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                dest = params[target]
                if layout is None:
                    tensor = f.get_tensor(name)
                else:
                    tensor = _read_slice(f, name, layout.checkpoint_slice(target, part, cfg))
                    dest = _vocab_rows(dest, target, layout)
                _copy(dest, tensor, part, _part_sizes(target, cfg, layout), target)
                loaded.add(target)
                if part is not None:
                    fused_parts.setdefault(target, set()).add(part)
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    incomplete = sorted(t for t, parts in fused_parts.items() if len(parts) < _num_parts(t))
    if missing or incomplete:
        raise ValueError(f"checkpoint {path} lacks weights: {missing + incomplete}")
    if prepack and prepack_supported(device, dtype):
        model.prepack()
    return model.eval()


def _target(name: str) -> tuple[str | None, int | None]:
    if name.endswith("rotary_emb.inv_freq") or is_kv_scale(name):
        return None, None  # KV scales belong to the cache (kv_cache_format), not the weights
    name = name.removeprefix("model.")
    for hf, (ours, part) in _FUSED.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), part
    return name, None


def _num_parts(target: str) -> int:
    return 3 if "qkv_proj" in target else 2


def _read_slice(f, name: str, piece: tuple[int, int, int] | None) -> torch.Tensor:
    """Only this rank's rows (dim 0) or columns (dim 1) of a tensor, read from the file."""
    if piece is None:
        return f.get_tensor(name)
    dim, start, length = piece
    lazy = f.get_slice(name)
    return lazy[start : start + length] if dim == 0 else lazy[:, start : start + length]


def _vocab_rows(param: torch.Tensor, target: str, layout: TPLayout) -> torch.Tensor:
    """The rows of a vocabulary slice the checkpoint fills; the padding past the vocabulary's
    end (last rank only) is zeroed, as no token reaches it."""
    if target not in ("embed_tokens.weight", "lm_head.weight"):
        return param
    rows = layout.vocab_end - layout.vocab_start
    with torch.no_grad():
        param[rows:].zero_()
    return param[:rows]


def _part_sizes(target: str, cfg: ModelConfig, layout: TPLayout | None) -> list[int]:
    """Rows of each checkpoint projection inside a fused parameter (of this rank's shard)."""
    if "qkv_proj" in target:
        heads = layout.num_heads if layout else cfg.num_heads
        kv_heads = layout.num_kv_heads if layout else cfg.num_kv_heads
        q, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
        return [q, kv, kv]
    return [layout.intermediate_size if layout else cfg.intermediate_size] * 2


@torch.no_grad()
def _copy(param, tensor, part: int | None, sizes: list[int], target: str) -> None:
    if part is None:
        if param.shape != tensor.shape:
            raise ValueError(f"{target}: checkpoint shape {tuple(tensor.shape)} != {param.shape}")
        param.copy_(tensor)
        return
    start = sum(sizes[:part])
    dest = param.narrow(0, start, sizes[part])
    if dest.shape != tensor.shape:
        raise ValueError(
            f"{target}[{part}]: checkpoint shape {tuple(tensor.shape)} != {dest.shape}"
        )
    dest.copy_(tensor)
