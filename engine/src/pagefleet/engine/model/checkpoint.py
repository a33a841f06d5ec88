"""A checkpoint on disk as the loader reads it: its config.json and its tensors, lazily.

A Hugging Face directory of safetensors shards, or a GGUF file (model/gguf.py), each answering
the same questions: the config (as config.json's keys), the tensor sources (under HF names) and
the KV-cache scales. Nothing past this module knows which format it read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.common.gguf_file import is_gguf
from pagefleet.engine.kv_cache.fp8 import LayerScales, read_kv_scales, scales_from_entries
from pagefleet.engine.model.weights import TensorSource


def read_config(path: str | Path) -> dict:
    if is_gguf(path):
        from pagefleet.engine.model import gguf

        return gguf.read_config(path)
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


@dataclass
class SafetensorsSource:
    """One tensor of an open safetensors file (a `TensorSource`, model/weights.py)."""

    name: str
    handle: object  # safetensors' safe_open, open for the duration of the walk

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(self.name).get_shape())

    def read(self) -> torch.Tensor:
        return self.handle.get_tensor(self.name)

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        lazy = self.handle.get_slice(self.name)
        return lazy[start : start + length] if dim == 0 else lazy[:, start : start + length]


def kv_scales(path: str | Path, num_layers: int) -> list[LayerScales]:
    """Per layer (k_scale, v_scale) for an fp8 KV cache: the checkpoint's calibrated ones (vLLM's
    names), 1.0 where it has none (a GGUF carries none)."""
    if is_gguf(path):
        return scales_from_entries([], num_layers)
    return read_kv_scales(weight_files(Path(path)), num_layers)


def tensor_sources(path: str | Path) -> Iterator[TensorSource]:
    """Every tensor of the checkpoint, file after file (each file open only while walked)."""
    if is_gguf(path):
        from pagefleet.engine.model import gguf

        yield from gguf.tensor_sources(path)
        return
    from safetensors import safe_open

    for file in weight_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield SafetensorsSource(name, handle)
