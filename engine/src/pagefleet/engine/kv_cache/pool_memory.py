"""Zeroed memory for the engine's pools (KV blocks, host tier, recurrent state). On the CPU a
pool is an anonymous mapping whose zero pages the kernel supplies on first touch: a pool sized
for all of --kv-cache-memory then costs neither the seconds of writing zeros at start nor
resident memory for blocks no request has used yet."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on the CPU backed by pages written only when first used."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes)  # anonymous (shared, mmap's default): zeros until written
    # The tensor holds the mapping (frombuffer keeps its buffer alive).
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
