"""KV capacity arithmetic shared by the engine's pool sizing and startup log, `pagefleet plan`
and the operator's admission check: pure Python over an HF config dict (no torch; reading a
local config.json or safetensors header is the only I/O).

KV bytes per token = 2 (K and V) x attention layers x KV heads per GPU x head dim x bytes per
value. Only layers that keep KV per token count; a hybrid model's linear-attention layers hold a
fixed state per sequence, reported apart. An engine keeps that state in slots (one per running
sequence plus prefix snapshots, `num_state_slots`) carved out of the same memory before the KV
pool: given the slots, a plan's pool is the engine's to the block. GB is 10^9 bytes (GPU
makers' unit), KiB 2^10.

Weights: every expert of a mixture-of-experts model counts (all are resident), and the
parameters one token runs through (active: its top-k experts in each sparse layer) are reported
beside them. Per GPU, tensor parallelism splits every expert; expert parallelism places whole
experts, the fullest rank holding ceil(experts / ranks) of them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagefleet.common.weight_formats import quantized_weights_format

GB = 10**9
GiB = 1 << 30
KiB = 1 << 10

# Bytes per value of a weight or KV format (int4: two values per byte).
FORMAT_BYTES: dict[str, float] = {
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
    "int4": 0.5,
}
# A bytes-per-value given as a number (the engine passes its torch dtype's element size).
ValueFormat = str | float

# Nominal memory of common GPUs in GB (the maker's sheet; a GB figure given by the user wins).
GPU_MEMORY_GB: dict[str, float] = {
    "L4": 24,
    "A10G": 24,
    "A100-40GB": 40,
    "A100-80GB": 80,
    "H100-80GB": 80,
    "H200": 141,
    "B200": 180,
}
# Other spellings: users' and GPU feature discovery's (the nvidia.com/gpu.product node label,
# e.g. NVIDIA-H100-80GB-HBM3), after the NVIDIA- prefix is dropped and the rest upper-cased.
_GPU_ALIASES = {
    "A100": "A100-80GB",
    "A100-40": "A100-40GB",
    "A100-80": "A100-80GB",
    "A100-SXM4-40GB": "A100-40GB",
    "A100-SXM4-80GB": "A100-80GB",
    "A100-PCIE-40GB": "A100-40GB",
    "A100-80GB-PCIE": "A100-80GB",
    "H100": "H100-80GB",
    "H100-80": "H100-80GB",
    "H100-SXM5-80GB": "H100-80GB",
    "H100-80GB-HBM3": "H100-80GB",
    "H100-PCIE": "H100-80GB",
    "H200-141GB": "H200",
    "H200-141GB-HBM3E": "H200",
    "B200-180GB": "B200",
    "A10G-24GB": "A10G",
}


def value_bytes(fmt: ValueFormat) -> float:
    """Bytes per value of a format name (bf16, fp8, int4...) or of a number given as is."""
    if isinstance(fmt, int | float) and not isinstance(fmt, bool):
        if fmt <= 0:
            raise ValueError(f"bytes per value must be > 0, not {fmt}")
        return float(fmt)
    key = str(fmt).lower().removeprefix("torch.")
    if key not in FORMAT_BYTES:
        raise ValueError(f"unknown format {fmt!r}: {', '.join(FORMAT_BYTES)}")
    return FORMAT_BYTES[key]


def gpu_key(gpu: str) -> str | None:
    """The table's name for a GPU type (None when unknown)."""
    key = gpu.strip().upper().removeprefix("NVIDIA-").removeprefix("NVIDIA ").replace(" ", "-")
    key = _GPU_ALIASES.get(key, key)
    known = {k.upper(): k for k in GPU_MEMORY_GB}
    return known.get(key)


def gpu_memory_bytes(gpu: str) -> int:
    """A GPU type's memory in bytes, from its name (L4, A10G, A100-40GB, H100-80GB, H200...)."""
    key = gpu_key(gpu)
    if key is None:
        raise ValueError(
            f"unknown GPU {gpu!r}: {', '.join(GPU_MEMORY_GB)} (or give its memory in GB)"
        )
    return int(GPU_MEMORY_GB[key] * GB)


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int = 1) -> int:
    """KV heads each rank keeps: split over the ranks, or one replicated head per rank when
    there are fewer heads than ranks (as model/parallel.py's TPLayout shards them)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, not {tensor_parallel_size}")
    return max(1, math.ceil(num_kv_heads / tensor_parallel_size))


def kv_bytes_per_token(
    attention_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_format: ValueFormat,
    tensor_parallel_size: int = 1,
) -> int:
    """Bytes one token's K and V take on each GPU (rank)."""
    heads = kv_heads_per_rank(num_kv_heads, tensor_parallel_size)
    return int(2 * attention_layers * heads * head_dim * value_bytes(kv_format))


# ---------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """What capacity depends on in a model's config."""

    num_layers: int
    num_attention_layers: int  # layers that keep K and V per token
    num_kv_heads: int
    head_dim: int
    dtype: str  # the checkpoint's torch_dtype
    max_position_embeddings: int | None = None
    # Estimated from the config (exact from safetensors headers when a checkpoint dir has them).
    num_parameters: int | None = None
    # Linear-attention layers: fixed state per sequence (conv + recurrent), at the model dtype.
    linear_state_bytes_per_sequence: int = 0
    # Mixture of experts: routed experts per sparse layer (0: dense), experts each token uses,
    # the parameters of all routed experts, and those one token runs through.
    num_experts: int = 0
    experts_per_token: int = 0
    num_expert_parameters: int = 0
    num_active_parameters: int | None = None
    # A quantized checkpoint's per-value format (int4, int8, fp8: its quantization_config);
    # None for a float one (its dtype).
    weights_format: str | None = None
    # The checkpoint's weight bytes as stored (codes, scales and all), from its safetensors
    # headers; None without them.
    weight_bytes: int | None = None

    @property
    def own_weights_format(self) -> str:
        """The format the engine loads this checkpoint's weights in, unless told otherwise."""
        return self.weights_format or self.dtype

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """KeyError when the config lacks a shape field, ValueError when one is not a whole
        number within SHAPE_LIMITS (the config may come from a user-given endpoint)."""
        cfg = _text_config(config)
        layers = _shape_int(cfg, "num_hidden_layers", required=True)
        heads = _shape_int(cfg, "num_attention_heads", required=True)
        kinds = _layer_kinds(cfg, layers)
        attention = sum(1 for k in kinds if k != "linear_attention")
        params = _estimate_parameters(cfg, kinds)
        experts = _experts(cfg, layers)
        return cls(
            num_layers=layers,
            num_attention_layers=attention,
            num_kv_heads=_shape_int(cfg, "num_key_value_heads") or heads,
            head_dim=_shape_int(cfg, "head_dim")
            or _shape_int(cfg, "hidden_size", required=True) // heads,
            dtype=(dtype := _config_dtype(cfg, config)),
            max_position_embeddings=_shape_int(cfg, "max_position_embeddings"),
            num_parameters=params.total if params else None,
            linear_state_bytes_per_sequence=int(
                (layers - attention) * _linear_state_values(cfg) * FORMAT_BYTES.get(dtype, 2)
            ),
            weights_format=quantized_weights_format(config),
            num_experts=experts.num_experts if experts else 0,
            experts_per_token=experts.top_k if experts else 0,
            num_expert_parameters=params.experts if params else 0,
            num_active_parameters=params.active if params else None,
        )

    def with_parameters(self, total: int) -> ModelShape:
        """This shape with an exact parameter count (safetensors headers): the experts' and
        the inactive ones' counts come from the config, exactly, so active = total - inactive."""
        inactive = (self.num_parameters or 0) - (self.num_active_parameters or 0)
        active = total - inactive if self.num_active_parameters is not None else None
        return ModelShape(
            **{**asdict(self), "num_parameters": total, "num_active_parameters": active}
        )

    def kv_bytes_per_token(self, kv_format: ValueFormat, tensor_parallel_size: int = 1) -> int:
        return kv_bytes_per_token(
            self.num_attention_layers,
            self.num_kv_heads,
            self.head_dim,
            kv_format,
            tensor_parallel_size,
        )

    def kv_bytes_per_block(
        self, block_size: int, kv_format: ValueFormat, tensor_parallel_size: int = 1
    ) -> int:
        return block_size * self.kv_bytes_per_token(kv_format, tensor_parallel_size)

    def state_bytes_per_slot(self, tensor_parallel_size: int = 1) -> int:
        """One sequence's linear-attention state on each rank (its heads are split)."""
        return self.linear_state_bytes_per_sequence // tensor_parallel_size


# The largest value a config's shape field may take: far above any real model's, low enough
# that the arithmetic stays small (a config of 10**12 layers would build a 10**12-entry list).
SHAPE_LIMITS: dict[str, int] = {
    "num_hidden_layers": 10_000,
    "num_attention_heads": 1 << 16,
    "num_key_value_heads": 1 << 16,
    "head_dim": 1 << 16,
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 24,
    "moe_intermediate_size": 1 << 24,
    "num_experts": 1 << 16,
    "num_local_experts": 1 << 16,
    "n_routed_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16,
    "shared_expert_intermediate_size": 1 << 24,
    "decoder_sparse_step": 10_000,
    "vocab_size": 1 << 27,
    "max_position_embeddings": 1 << 40,
    "full_attention_interval": 10_000,
    "linear_num_key_heads": 1 << 16,
    "linear_num_value_heads": 1 << 16,
    "linear_key_head_dim": 1 << 16,
    "linear_value_head_dim": 1 << 16,
    "linear_conv_kernel_dim": 1 << 16,
}


def _shape_int(cfg: dict[str, Any], key: str, *, required: bool = False) -> int | None:
    """A shape field: a whole number in 1..SHAPE_LIMITS[key]. Absent, null or 0 is None (the
    caller's default applies, as transformers' `or` does) unless required (KeyError when
    absent); anything else (a string, a bool, NaN, a fraction, out of range) is a ValueError."""
    if key not in cfg and required:
        raise KeyError(key)
    value = cfg.get(key)
    if not required and (value is None or (type(value) in (int, float) and value == 0)):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not 1 <= value <= SHAPE_LIMITS[key]:
        shown = repr(value) if type(value) is not int or value.bit_length() < 64 else "huge"
        raise ValueError(
            f"config field {key} must be a whole number from 1 to {SHAPE_LIMITS[key]:,}, "
            f"not {shown[:40]}"
        )
    return value


def _config_dtype(cfg: dict[str, Any], config: dict[str, Any]) -> str:
    """The checkpoint's dtype name (newer transformers write `dtype` where older ones wrote
    `torch_dtype`); bfloat16 when neither says."""
    dtype = next(
        (c[k] for c in (cfg, config) for k in ("torch_dtype", "dtype") if c.get(k)), "bfloat16"
    )
    if not isinstance(dtype, str) or len(dtype) > 32:
        raise ValueError(f"config field torch_dtype must be a dtype name, not {repr(dtype)[:40]}")
    return dtype


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Qwen3.5, Llama 4...) nest the language model's under text_config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) and "num_hidden_layers" in text else config


def _layer_kinds(cfg: dict[str, Any], layers: int) -> list[str]:
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == layers:
        return [str(k) for k in kinds]
    interval = _shape_int(cfg, "full_attention_interval")
    if interval:  # Qwen3-Next: every interval-th layer is full attention, the rest linear
        return [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    return ["full_attention"] * layers


def _linear_dims(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """Gated DeltaNet's key heads, value heads, key head dim, value head dim (0 without)."""
    return (
        _shape_int(cfg, "linear_num_key_heads") or 0,
        _shape_int(cfg, "linear_num_value_heads") or 0,
        _shape_int(cfg, "linear_key_head_dim") or 0,
        _shape_int(cfg, "linear_value_head_dim") or 0,
    )


def _linear_state_values(cfg: dict[str, Any]) -> int:
    """Values of one Gated DeltaNet layer's state per sequence: the causal conv's last
    (kernel - 1) inputs over q, k and v, plus the value heads' key x value matrices."""
    k_heads, v_heads, k_dim, v_dim = _linear_dims(cfg)
    kernel = _shape_int(cfg, "linear_conv_kernel_dim") or 0
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * max(kernel - 1, 0)
    return conv + v_heads * k_dim * v_dim


@dataclass(frozen=True)
class ExpertLayers:
    """The routed experts of a config: how many, how many a token uses, their MLP width,
    which layers hold them, and a shared expert's width (0: none)."""

    num_experts: int
    top_k: int
    intermediate: int
    sparse_layers: frozenset[int]
    shared_intermediate: int = 0


def _experts(cfg: dict[str, Any], layers: int) -> ExpertLayers | None:
    """Qwen3-MoE (num_experts; transformers 5 writes num_local_experts), Mixtral
    (num_local_experts), Qwen3.5-MoE (+ a shared expert), DeepSeek (n_routed_experts);
    None for a dense model."""
    experts = (
        _shape_int(cfg, "num_experts")
        or _shape_int(cfg, "num_local_experts")
        or _shape_int(cfg, "n_routed_experts")
    )
    if not experts:
        return None
    step = _shape_int(cfg, "decoder_sparse_step") or 1
    dense = _layer_list(cfg, "mlp_only_layers", layers)
    inter = _shape_int(cfg, "moe_intermediate_size") or _shape_int(cfg, "intermediate_size")
    return ExpertLayers(
        num_experts=experts,
        top_k=min(_shape_int(cfg, "num_experts_per_tok") or 1, experts),
        intermediate=inter or 4 * (_shape_int(cfg, "hidden_size") or 0),
        sparse_layers=frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        shared_intermediate=_shape_int(cfg, "shared_expert_intermediate_size") or 0,
    )


def _layer_list(cfg: dict[str, Any], key: str, layers: int) -> set[int]:
    """A config's list of layer indices (e.g. mlp_only_layers): whole numbers below `layers`."""
    value = cfg.get(key) or []
    if (
        not isinstance(value, list)
        or len(value) > layers
        or not all(type(i) is int and 0 <= i < layers for i in value)
    ):
        raise ValueError(f"config field {key} must be a list of layer indices below {layers}")
    return set(value)


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int  # what one token runs through: its top-k experts, not all
    experts: int  # every routed expert's parameters


def _estimate_parameters(cfg: dict[str, Any], kinds: list[str]) -> ParameterCount | None:
    """Parameters of a llama-style decoder from its config (norms and biases left out); None
    without hidden_size or vocab_size."""
    hidden = _shape_int(cfg, "hidden_size")
    vocab = _shape_int(cfg, "vocab_size")
    heads = _shape_int(cfg, "num_attention_heads", required=True)
    if hidden is None or vocab is None:
        return None
    head_dim = _shape_int(cfg, "head_dim") or hidden // heads
    kv_heads = _shape_int(cfg, "num_key_value_heads") or heads
    inter = _shape_int(cfg, "intermediate_size") or 4 * hidden
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    k_heads, v_heads, k_dim, v_dim = _linear_dims(cfg)
    linear = hidden * (2 * k_heads * k_dim + 2 * v_heads * v_dim) + v_heads * v_dim * hidden
    total = sum(linear if kind == "linear_attention" else attention for kind in kinds)
    total += vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    moe = _experts(cfg, len(kinds))
    sparse = moe.sparse_layers if moe else frozenset()
    total += (len(kinds) - len(sparse)) * 3 * hidden * inter  # dense MLPs
    active = total
    if moe is None:
        return ParameterCount(total, total, 0)
    expert = 3 * hidden * moe.intermediate
    # Per sparse layer: the router, a shared expert and its gate (Qwen3.5-MoE), the experts.
    always = hidden * moe.num_experts
    if moe.shared_intermediate:
        always += 3 * hidden * moe.shared_intermediate + hidden
    experts = len(sparse) * moe.num_experts * expert
    total += len(sparse) * always + experts
    active += len(sparse) * (always + moe.top_k * expert)
    return ParameterCount(total, active, experts)


def parameters_per_gpu(
    num_parameters: int,
    tensor_parallel_size: int = 1,
    shape: ModelShape | None = None,
    expert_parallel: bool = False,
) -> float:
    """Parameters the fullest rank holds: everything split over the ranks, except that under
    expert parallelism a rank holds whole experts, ceil(experts / ranks) of them."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, not {tensor_parallel_size}")
    share = 1 / tensor_parallel_size
    if shape is None or not shape.num_experts:
        return num_parameters * share
    experts = min(shape.num_expert_parameters, num_parameters)
    if expert_parallel:
        share = math.ceil(shape.num_experts / tensor_parallel_size) / shape.num_experts
    return (num_parameters - experts) / tensor_parallel_size + experts * share


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """An HF config from a checkpoint dir or a config.json file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no config.json there")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not JSON ({e})") from e
    except RecursionError:  # nested deeper than the parser goes: no config is
        raise ValueError(f"{file}: JSON nested too deeply for a config") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object")
    return config


# A safetensors header larger than this is not a header (the format caps it at 100 MB).
MAX_SAFETENSORS_HEADER = 100 * 10**6
# Tensors of a checkpoint the engine does not load (a multimodal checkpoint's vision tower, a
# multi-token-prediction head): their weights take no GPU memory, so they are not counted.
UNSERVED_PREFIXES = ("model.visual.", "mtp.")


# Bytes per element of a safetensors dtype (packed int32 words count as their 4 bytes).
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


def safetensors_parameters(path: str | Path) -> int | None:
    """Exact parameter count of the tensors the engine loads, from a checkpoint dir's
    safetensors headers (None without any)."""
    totals = safetensors_totals(path)
    return None if totals is None else totals[0]


def safetensors_totals(path: str | Path) -> tuple[int, int] | None:
    """(elements, bytes) of the tensors the engine loads in a checkpoint dir's safetensors
    files (None without any). For a quantized checkpoint the elements are packed words, not
    parameters."""
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    totals = [_safetensors_file_totals(file) for file in files]
    return sum(t[0] for t in totals), sum(t[1] for t in totals)


def _safetensors_file_totals(file: Path) -> tuple[int, int]:
    """(elements, bytes) one safetensors file holds, from its header (ValueError when it is
    not one)."""
    with file.open("rb") as f:
        head = f.read(8)
        (size,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
        if not 2 <= size <= MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{file}: not a safetensors file (header of {size} bytes)")
        try:
            header = json.loads(f.read(size))
            elements = bytes_ = 0
            for name, entry in header.items():
                if name == "__metadata__" or name.startswith(UNSERVED_PREFIXES):
                    continue
                count = math.prod(int(d) for d in entry["shape"])
                elements += count
                bytes_ += count * SAFETENSORS_DTYPE_BYTES.get(entry["dtype"], 4)
            return elements, bytes_
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{file}: not a safetensors header") from None


def model_shape(config: dict[str, Any] | str | Path) -> ModelShape:
    """The shape of an HF config dict, a local checkpoint dir or a config.json (parameters
    counted exactly when the dir holds safetensors)."""
    if isinstance(config, dict):
        return ModelShape.from_hf_config(config)
    try:
        shape = ModelShape.from_hf_config(read_hf_config(config))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{config}: the config lacks a shape field ({e})") from e
    totals = safetensors_totals(config)
    if totals is None:
        return shape
    elements, stored = totals
    # A quantized checkpoint's elements are packed words: its parameters stay estimated.
    if not shape.weights_format:
        shape = shape.with_parameters(elements)
    return ModelShape(**{**asdict(shape), "weight_bytes": stored})


def num_state_slots(
    max_num_seqs: int, num_snapshots: int | None = None, prefix_caching: bool = True
) -> int:
    """A hybrid engine's state slots: one per running sequence, plus prefix-cache snapshots
    (default: as many as sequences with prefix caching; without, one spare, the second slot a
    prefill pod's request needs while it writes its state for the decode pod)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, not {max_num_seqs}")
    if num_snapshots is None:
        num_snapshots = max_num_seqs if prefix_caching else 1
    if num_snapshots < 0:
        raise ValueError(f"state snapshots must be >= 0, not {num_snapshots}")
    return max_num_seqs + num_snapshots


# ---------------------------------------------------------------------------- pool capacity


@dataclass(frozen=True)
class CapacityPlan:
    """One configuration's capacity, per GPU (each rank holds its shard of every block)."""

    weights_format: str
    kv_format: str
    tensor_parallel_size: int
    block_size: int
    weights_bytes: int  # per GPU
    kv_bytes: int  # the KV pool per GPU
    bytes_per_token: int
    bytes_per_block: int
    kv_tokens: int  # whole tokens the pool's bytes hold
    kv_blocks: int
    # A hybrid model's state slots beside the pool (per GPU), paid from the same memory.
    state_slots: int = 0
    state_bytes: int = 0
    expert_parallel: bool = False

    @property
    def block_tokens(self) -> int:
        """Tokens in whole blocks: what the engine's pool can actually hand out."""
        return self.kv_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def sequences_at(self, context: int) -> int:
        """Sequences of `context` tokens that fit in the pool at once."""
        return self.kv_blocks // self.blocks_for(context)

    def holds_one(self, context: int) -> bool:
        return self.sequences_at(context) >= 1


def kv_pool_plan(
    per_token: int,
    kv_bytes: int,
    *,
    kv_format: ValueFormat,
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    weights_format: str = "",
    weights_bytes: int = 0,
    state_slots: int = 0,
    state_bytes: int = 0,
    expert_parallel: bool = False,
) -> CapacityPlan:
    """The capacity of a KV pool of `kv_bytes` (per GPU) at `per_token` bytes per token;
    `state_slots` taking `state_bytes` are reported beside it."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, not {block_size}")
    if per_token < 1:
        raise ValueError("the model keeps no KV per token (no attention layer)")
    kv_bytes = max(kv_bytes, 0)
    return CapacityPlan(
        weights_format=weights_format,
        kv_format=str(kv_format),
        tensor_parallel_size=tensor_parallel_size,
        block_size=block_size,
        weights_bytes=weights_bytes,
        kv_bytes=kv_bytes,
        bytes_per_token=per_token,
        bytes_per_block=per_token * block_size,
        kv_tokens=kv_bytes // per_token,
        kv_blocks=kv_bytes // (per_token * block_size),
        state_slots=state_slots,
        state_bytes=state_bytes,
        expert_parallel=expert_parallel,
    )


def cache_plan(
    per_token: int,
    cache_bytes: int,
    *,
    kv_format: ValueFormat,
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    state_slots: int = 0,
    state_bytes_per_slot: int = 0,
    weights_format: str = "",
    weights_bytes: int = 0,
    expert_parallel: bool = False,
) -> CapacityPlan:
    """`cache_bytes` (per GPU) for the whole cache: the state slots first, the rest the KV
    pool. The engine sizes its pool with this, and `plan` plans with it."""
    state = state_slots * state_bytes_per_slot
    return kv_pool_plan(
        per_token,
        cache_bytes - state,
        kv_format=kv_format,
        block_size=block_size,
        tensor_parallel_size=tensor_parallel_size,
        weights_format=weights_format,
        weights_bytes=weights_bytes,
        state_slots=state_slots,
        state_bytes=state,
        expert_parallel=expert_parallel,
    )


def pool_of_blocks(
    shape: ModelShape,
    num_blocks: int,
    *,
    kv_format: ValueFormat,
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    weights_format: str = "",
    state_slots: int = 0,
) -> CapacityPlan:
    """A pool of a given number of blocks (the engine's --num-gpu-blocks-override), and the
    state slots beside it."""
    per_token = shape.kv_bytes_per_token(kv_format, tensor_parallel_size)
    return kv_pool_plan(
        per_token,
        num_blocks * per_token * block_size,
        kv_format=kv_format,
        block_size=block_size,
        tensor_parallel_size=tensor_parallel_size,
        weights_format=weights_format or shape.own_weights_format,
        state_slots=state_slots,
        state_bytes=state_slots * shape.state_bytes_per_slot(tensor_parallel_size),
    )


def plan_in_memory(
    shape: ModelShape,
    cache_bytes: int,
    *,
    kv_format: ValueFormat,
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    weights_format: str = "",
    state_slots: int = 0,
) -> CapacityPlan:
    """A cache of `cache_bytes` per rank (the engine's --kv-cache-memory on CPU)."""
    return cache_plan(
        shape.kv_bytes_per_token(kv_format, tensor_parallel_size),
        cache_bytes,
        kv_format=kv_format,
        block_size=block_size,
        tensor_parallel_size=tensor_parallel_size,
        state_slots=state_slots,
        state_bytes_per_slot=shape.state_bytes_per_slot(tensor_parallel_size),
        weights_format=weights_format or shape.own_weights_format,
    )


def weights_bytes_per_gpu(
    num_parameters: int,
    weights_format: ValueFormat,
    tensor_parallel_size: int = 1,
    *,
    shape: ModelShape | None = None,
    expert_parallel: bool = False,
) -> int:
    """Weight bytes on the fullest GPU (`shape` tells a mixture of experts' experts apart)."""
    params = parameters_per_gpu(num_parameters, tensor_parallel_size, shape, expert_parallel)
    return int(params * value_bytes(weights_format))


@dataclass(frozen=True)
class GpuBudget:
    """How one replica uses its GPUs: memory per GPU, the share the engine takes, and what
    besides weights and KV it needs (activations, CUDA graphs, the runtime)."""

    gpu_memory: int  # bytes per GPU
    gpu_memory_utilization: float = 0.92
    overhead_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu memory utilization must be in (0, 1]")
        if self.gpu_memory <= 0 or self.overhead_bytes < 0:
            raise ValueError("GPU memory must be > 0 and the overhead >= 0")


def plan_on_gpu(
    shape: ModelShape,
    budget: GpuBudget,
    *,
    weights_format: str,
    kv_format: ValueFormat,
    tensor_parallel_size: int = 1,
    block_size: int = 16,
    num_parameters: int | None = None,
    state_slots: int = 0,
    expert_parallel: bool = False,
    weights_bytes: int | None = None,
) -> CapacityPlan:
    """Capacity of one replica over `tensor_parallel_size` GPUs: memory x utilisation, less
    this rank's weights (its experts' under expert parallelism) and the overhead, goes to the
    cache (state slots, then KV pool). `weights_bytes`: the replica's weights as stored (a
    checkpoint's own format), instead of parameters x bytes."""
    if weights_bytes is not None:
        weights = weights_bytes // tensor_parallel_size
    else:
        params = num_parameters if num_parameters is not None else shape.num_parameters
        if params is None:
            raise ValueError("the parameter count is unknown: give it (--params)")
        weights = weights_bytes_per_gpu(
            params,
            weights_format,
            tensor_parallel_size,
            shape=shape,
            expert_parallel=expert_parallel,
        )
    cache = int(budget.gpu_memory * budget.gpu_memory_utilization) - weights
    return cache_plan(
        shape.kv_bytes_per_token(kv_format, tensor_parallel_size),
        cache - budget.overhead_bytes,
        kv_format=kv_format,
        block_size=block_size,
        tensor_parallel_size=tensor_parallel_size,
        state_slots=state_slots,
        state_bytes_per_slot=shape.state_bytes_per_slot(tensor_parallel_size),
        weights_format=weights_format,
        weights_bytes=weights,
        expert_parallel=expert_parallel,
    )


# ---------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """N requests of P prompt + O output tokens whose first S prompt tokens are identical."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.prompt_tokens < 1 or self.output_tokens < 0:
            raise ValueError("a workload needs >= 1 request of >= 1 prompt token")
        if not 0 <= self.shared_prefix_tokens <= self.prompt_tokens:
            raise ValueError("the shared prefix must be within the prompt")


@dataclass(frozen=True)
class WorkloadFit:
    blocks_per_request: int
    blocks_needed: int  # every request's own blocks
    fit_at_once: int  # requests that run at once in the pool, nothing shared
    shared_blocks: int  # full blocks of the shared prefix, held once
    blocks_per_request_shared: int  # a request's blocks after the shared ones
    blocks_needed_shared: int
    fit_at_once_shared: int


def fit_workload(workload: Workload, num_blocks: int, block_size: int = 16) -> WorkloadFit:
    """Blocks a workload needs and how many of its requests a pool of `num_blocks` runs at once,
    without and with prefix sharing (only full blocks are shared, as the prefix cache does)."""
    tokens = workload.prompt_tokens + workload.output_tokens
    per_request = -(-tokens // block_size)
    shared = workload.shared_prefix_tokens // block_size
    rest = per_request - shared
    n = workload.num_requests
    room = num_blocks - shared
    # A request wholly inside the shared prefix needs no blocks of its own.
    at_once_shared = 0 if room < 0 else (room // rest if rest else n)
    return WorkloadFit(
        blocks_per_request=per_request,
        blocks_needed=n * per_request,
        fit_at_once=min(n, num_blocks // per_request),
        shared_blocks=shared,
        blocks_per_request_shared=rest,
        blocks_needed_shared=shared + n * rest,
        fit_at_once_shared=min(n, at_once_shared),
    )


# ---------------------------------------------------------------------------- admission


@dataclass(frozen=True)
class Admission:
    """Whether one replica's pool holds one request of max_model_len, and what would fix it."""

    admitted: bool
    reason: str  # CapacityOK | NoMaxModelLen | PoolTooSmall
    message: str
    kv_tokens: int = 0
    max_model_len: int | None = None


def admit(shape: ModelShape, plan: CapacityPlan, max_model_len: int | None) -> Admission:
    """Does `plan`'s pool (see plan_on_gpu) hold one request of max_model_len? The message gives
    the numbers and, when it does not, the knobs that fix it."""
    pool = (
        f"the KV pool holds {plan.block_tokens:,} tokens ({plan.kv_bytes / GB:.1f} GB per GPU at "
        f"{plan.bytes_per_token:,} bytes per token, {plan.kv_format} KV, {plan.weights_format} "
        f"weights {plan.weights_bytes / GB:.1f} GB per GPU, tensor parallel "
        f"{plan.tensor_parallel_size})"
    )
    if max_model_len is None:
        native = shape.max_position_embeddings
        return Admission(
            False,
            "NoMaxModelLen",
            f"no max-model-len is set, so the engine takes the model's native context "
            f"({native if native is not None else 'unknown'} tokens); {pool}. Set "
            f"engineArgs.max-model-len to at most {plan.block_tokens:,}",
            plan.block_tokens,
        )
    if plan.holds_one(max_model_len):
        return Admission(
            True,
            "CapacityOK",
            f"{pool}: {plan.sequences_at(max_model_len)} requests of max-model-len "
            f"{max_model_len:,} at once",
            plan.block_tokens,
            max_model_len,
        )
    fixes = []
    if plan.kv_blocks == 0:
        # The weights and overhead alone fill the GPU: no context length helps.
        fixes.append(f"smaller weights than {plan.weights_format} (fp8, int4)")
    else:
        fixes.append(f"engineArgs.max-model-len <= {plan.block_tokens:,}")
    if value_bytes(plan.kv_format) > 1 and plan.kv_blocks:
        fp8 = kv_pool_plan(
            shape.kv_bytes_per_token("fp8", plan.tensor_parallel_size),
            plan.kv_bytes,
            kv_format="fp8",
            block_size=plan.block_size,
        )
        fixes.append(f"kv-cache-dtype fp8 ({fp8.block_tokens:,} tokens)")
    fixes.append("more GPUs per replica (tensor-parallel-size and nvidia.com/gpu)")
    return Admission(
        False,
        "PoolTooSmall",
        f"{pool}: less than one request of max-model-len {max_model_len:,}. Fix: "
        + "; or ".join(fixes),
        plan.block_tokens,
        max_model_len,
    )
