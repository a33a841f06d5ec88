"""PEFT LoRA adapters on disk: `adapter_config.json` + `adapter_model.safetensors`, checked
against the base model before anything is read into memory.

An adapter adds `B A x * scaling` to the projections it targets (q/k/v/o/gate/up/down), with
`A` [r, in] and `B` [out, r]; scaling is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with
rsLoRA. The scaling is folded into B as the weights are read. Everything an adapter can say is
bounded before it is trusted: the config's size and fields, the weight file's size (no bigger
than its largest possible tensors), every tensor's name, dtype and shape (the base model's),
the rank (`--max-lora-rank`). What PEFT can express and this engine does not compute (DoRA,
trained biases, extra trained modules, per-module ranks) is refused by name, never ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_CONFIG_BYTES = 1 << 20
_HEADER_SLACK = 1 << 20  # the safetensors header beside the tensors' bytes
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_KEY = re.compile(r"base_model\.model\.(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<ab>[AB])\.weight")
# Config fields whose non-default values change the computation in ways this engine does not
# implement: (field, its harmless values, what it is).
_UNSUPPORTED = (
    ("use_dora", (None, False), "DoRA (use_dora)"),
    ("bias", (None, "none"), "trained biases (bias)"),
    ("lora_bias", (None, False), "a trained LoRA bias (lora_bias)"),
    ("fan_in_fan_out", (None, False), "fan_in_fan_out weights"),
    ("modules_to_save", (None, []), "fully trained extra modules (modules_to_save)"),
    ("rank_pattern", (None, {}), "per-module ranks (rank_pattern)"),
    ("alpha_pattern", (None, {}), "per-module alphas (alpha_pattern)"),
    ("layer_replication", (None, []), "layer replication"),
    ("trainable_token_indices", (None, [], {}), "trained token embeddings"),
    ("target_parameters", (None, []), "targeted parameters (target_parameters)"),
    ("use_qalora", (None, False), "QA-LoRA"),
)


class AdapterError(ValueError):
    """The adapter cannot run on this engine; the message says why."""


class AdapterNotFound(AdapterError):
    """The adapter's folder or one of its files is not there."""


class AdapterOutsideRoot(AdapterError):
    """The path leads outside the folder adapters may be loaded from."""


@dataclass(frozen=True)
class Target:
    """A projection an adapter may target: the model's layer that computes it, the part of that
    layer's output it fills (a fused q/k/v or gate/up layer), and its checkpoint shape."""

    module: str  # the model's layer, e.g. layers.0.self_attn.qkv_proj
    part: object  # "q", "gate", ... or None for an unfused layer
    out_features: int
    in_features: int


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    base_model: str | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class LoRAWeight:
    """One targeted projection's A [r, in] and B [out, r], the scaling folded into B."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class AdapterWeights:
    config: AdapterConfig
    modules: dict[str, LoRAWeight]  # by the checkpoint's projection name

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


def adapter_files(folder: str | Path) -> tuple[Path, Path]:
    """The adapter's config and weight files, or AdapterNotFound naming what is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterNotFound(f"LoRA adapter {str(folder)!r} is not a folder")
    config, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for file in (config, weights):
        if not file.is_file():
            extra = ""
            if file is weights and (folder / "adapter_model.bin").exists():
                extra = " (pickled adapter_model.bin is not loaded: save it as safetensors)"
            raise AdapterNotFound(f"LoRA adapter {str(folder)!r} has no {file.name}{extra}")
    return config, weights


def resolve_under_root(root: str | Path, path: str) -> Path:
    """The adapter folder `path` (absolute, or relative to `root`) once every symlink is
    followed, if it and its two files lie under `root`: AdapterOutsideRoot otherwise, decided
    before anything about the path's existence is told (no probing outside the root);
    AdapterNotFound if it is inside but incomplete."""
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(base / path))
    _inside(base, target, path)
    for file in adapter_files(target):
        _inside(base, Path(os.path.realpath(file)), path)
    return target


def _inside(base: Path, resolved: Path, path: str) -> None:
    if resolved != base and base not in resolved.parents:
        raise AdapterOutsideRoot(
            f"LoRA adapter path {path!r} leads outside the folder adapters load from (--lora-root)"
        )


def read_adapter_config(file: Path) -> AdapterConfig:
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{file.name} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{file.name} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{file.name} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file.name}: peft_type {raw.get('peft_type')!r} is not LORA")
    for name, harmless, what in _UNSUPPORTED:
        if raw.get(name) not in harmless:
            raise AdapterError(f"{file.name}: {what} is not supported")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            if not isinstance(target, str) or target.rsplit(".", 1)[-1] not in TARGETS:
                raise AdapterError(
                    f"{file.name}: target module {target!r} is not supported "
                    f"(LoRA applies to {', '.join(TARGETS)})"
                )
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{file.name}: r must be a positive integer, not {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{file.name}: lora_alpha must be a number, not {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{file.name}: use_rslora must be true or false")
    base = raw.get("base_model_name_or_path")
    return AdapterConfig(rank, float(alpha), rslora, base if isinstance(base, str) else None)


def check_adapter(
    folder: str | Path, targets: Mapping[str, Target], max_rank: int
) -> AdapterConfig:
    """Read and check the adapter's config and its weight file's header (no tensor data)."""
    config_file, weights_file = adapter_files(folder)
    config = read_adapter_config(config_file)
    if config.rank > max_rank:
        raise AdapterError(f"LoRA adapter rank {config.rank} is above --max-lora-rank {max_rank}")
    bound = sum(4 * max_rank * (t.in_features + t.out_features) for t in targets.values())
    if weights_file.stat().st_size > bound + _HEADER_SLACK:
        raise AdapterError(
            f"{ADAPTER_WEIGHTS} is larger than any rank-{max_rank} adapter of this model"
        )
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as handle:
            shapes = {
                k: (handle.get_slice(k).get_shape(), handle.get_slice(k).get_dtype())
                for k in handle.keys()  # noqa: SIM118 (safe_open is not a mapping)
            }
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{ADAPTER_WEIGHTS} cannot be read: {e}") from None
    _check_tensors(shapes, targets, config.rank)
    return config


def _check_tensors(shapes: dict, targets: Mapping[str, Target], rank: int) -> None:
    found: dict[str, set[str]] = {}
    for key, (shape, dtype) in shapes.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterError(
                f"{ADAPTER_WEIGHTS}: tensor {key!r} is not a LoRA A or B weight of a "
                f"supported projection ({', '.join(TARGETS)})"
            )
        module, ab = match["module"], match["ab"]
        target = targets.get(module)
        if target is None:
            raise AdapterError(
                f"{ADAPTER_WEIGHTS}: {module!r} is not a projection of this model that LoRA "
                f"applies to ({', '.join(TARGETS)} of its attention and dense MLP layers; not "
                "mixture-of-experts experts, linear-attention layers or a gated query)"
            )
        if dtype not in _DTYPES:
            raise AdapterError(f"{ADAPTER_WEIGHTS}: {key} has dtype {dtype} (F32/F16/BF16 only)")
        want = [rank, target.in_features] if ab == "A" else [target.out_features, rank]
        if list(shape) != want:
            raise AdapterError(
                f"{ADAPTER_WEIGHTS}: {key} has shape {list(shape)}, the base model and rank "
                f"{rank} need {want} (an adapter trained for another model?)"
            )
        found.setdefault(module, set()).add(ab)
    for module, parts in found.items():
        if parts != {"A", "B"}:
            raise AdapterError(f"{ADAPTER_WEIGHTS}: {module} has lora_{parts.pop()} only")
    if not found:
        raise AdapterError(f"{ADAPTER_WEIGHTS} holds no LoRA weights")


def load_adapter(
    folder: str | Path, targets: Mapping[str, Target], max_rank: int, dtype: torch.dtype
) -> AdapterWeights:
    """The adapter's weights in `dtype` on the CPU, checked first (check_adapter)."""
    config = check_adapter(folder, targets, max_rank)
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / ADAPTER_WEIGHTS), device="cpu")
    modules = {}
    for key in tensors:
        match = _KEY.fullmatch(key)
        if match["ab"] != "A":
            continue
        prefix = key[: -len("lora_A.weight")]
        a = tensors[key].to(torch.float32)
        b = tensors[prefix + "lora_B.weight"].to(torch.float32) * config.scaling
        modules[match["module"]] = LoRAWeight(a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return AdapterWeights(config, modules)
