"""A checkpoint on disk as the loader reads it: its config.json and its tensors, lazily.

Today a Hugging Face directory of safetensors shards; another format (GGUF) plugs in here by
answering the same two questions: the config (as config.json's keys) and the tensor sources.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


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


def tensor_sources(path: str | Path) -> Iterator[SafetensorsSource]:
    """Every tensor of the checkpoint, file after file (each file open only while walked)."""
    from safetensors import safe_open

    for file in weight_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield SafetensorsSource(name, handle)
