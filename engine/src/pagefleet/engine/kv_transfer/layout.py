"""Pure geometry of KV block transfers: who may exchange blocks (CompatRecord), and which byte
regions of two KV pools a list of (remote block, local block) pairs covers.

The engine's KV pool is one contiguous tensor [layers, 2, kv_heads, num_blocks, block_size,
head_dim] (engine/runner.py). A "plane" is one (layer, k|v, head) slice: num_blocks consecutive
chunks of block_size * head_dim elements. One block is therefore one chunk in each of the
layers * 2 * kv_heads planes, and a run of consecutive block ids is one region per plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields

import numpy as np

from pagefleet.common import __version__

CACHE_LAYOUT = "layer,kv,head,block,slot,dim"


@dataclass(frozen=True)
class CompatRecord:
    """What two engines must agree on before one reads the other's KV blocks."""

    model: str
    dtype: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_layout: str = CACHE_LAYOUT
    version: str = __version__
    # Ranks of the engine; num_kv_heads is then each rank's (a shard of every block per rank).
    tensor_parallel_size: int = 1

    @classmethod
    def from_pool_shape(
        cls,
        model: str,
        dtype: str,
        kv_dtype: str,
        shape: Sequence[int],
        tensor_parallel_size: int = 1,
    ) -> CompatRecord:
        """The record of a pool tensor shaped [layers, 2, kv_heads, blocks, block_size, dim]
        (rank 0's pool under tensor parallelism)."""
        geometry = PoolGeometry.from_shape(shape, element_size=1)
        return cls(
            model=model,
            dtype=dtype,
            kv_dtype=kv_dtype,
            num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            block_size=geometry.block_size,
            tensor_parallel_size=tensor_parallel_size,
        )

    def mismatches(self, other: CompatRecord, roles: tuple[str, str] | None = None) -> list[str]:
        """Human-readable reasons why `other` (the peer) is incompatible; empty if none.
        `roles` names this engine and the peer (e.g. ("prefill", "decode")) where it helps."""
        return [
            _mismatch(f.name, mine, theirs, roles)
            for f, mine, theirs in zip(fields(self), astuple(self), astuple(other), strict=True)
            if mine != theirs
        ]


def _mismatch(name: str, mine, theirs, roles: tuple[str, str] | None) -> str:
    if name == "tensor_parallel_size":
        # Rank r reads rank r's shard: shards of another split would need re-slicing.
        sizes = (
            f"the {roles[0]} engine has tensor-parallel size {mine}, the {roles[1]} engine {theirs}"
            if roles
            else f"tensor-parallel size {mine} here, {theirs} on the peer"
        )
        return (
            f"heterogeneous TP is not supported: {sizes} (both need the same "
            "--tensor-parallel-size)"
        )
    if name == "kv_dtype":
        # Blocks are moved as bytes: fp8 bytes read as bfloat16 (or back) would be garbage.
        dtypes = (
            f"the {roles[0]} engine's KV cache is {mine}, the {roles[1]} engine's {theirs}"
            if roles
            else f"KV cache {mine} here, {theirs} on the peer"
        )
        return f"kv_dtype differs: {dtypes} (both need the same --kv-cache-dtype)"
    return f"{name} differs: {mine!r} here, {theirs!r} on the peer"


@dataclass(frozen=True)
class RankAgent:
    """One tensor-parallel rank's NIXL agent over its shard of the pool (handshake data)."""

    rank: int
    agent_name: str
    metadata: bytes
    pool: PoolInfo
    first_kv_head: int
    num_kv_heads: int


@dataclass(frozen=True)
class PoolGeometry:
    """Shape and element size of one engine's KV pool; num_blocks may differ between peers."""

    num_layers: int
    num_kv_heads: int
    num_blocks: int
    block_size: int
    head_dim: int
    element_size: int

    @classmethod
    def from_shape(cls, shape: Sequence[int], element_size: int) -> PoolGeometry:
        if len(shape) != 6 or shape[1] != 2:
            raise ValueError(
                f"KV pool shape {tuple(shape)} is not [layers, 2, kv_heads, blocks, slots, dim]"
            )
        layers, _, heads, blocks, block_size, dim = (int(s) for s in shape)
        return cls(layers, heads, blocks, block_size, dim, element_size)

    @property
    def num_planes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one block within one plane."""
        return self.block_size * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        return self.num_planes * self.chunk_bytes

    @property
    def plane_bytes(self) -> int:
        return self.num_blocks * self.chunk_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_planes * self.plane_bytes

    def same_block_layout(self, other: PoolGeometry) -> bool:
        """Whether a block of one pool has exactly the bytes layout of a block of the other."""
        return (self.num_planes, self.chunk_bytes) == (other.num_planes, other.chunk_bytes)


@dataclass(frozen=True)
class PoolInfo:
    """Where a KV pool lives in its process, for a NIXL peer's remote descriptors."""

    base_address: int
    size_bytes: int
    num_blocks: int
    element_size: int
    mem_type: str  # "DRAM" or "VRAM", NIXL's names
    device_id: int

    def geometry(self, compat: CompatRecord) -> PoolGeometry:
        return PoolGeometry(
            compat.num_layers,
            compat.num_kv_heads,
            self.num_blocks,
            compat.block_size,
            compat.head_dim,
            self.element_size,
        )


def describe_pool(pool) -> PoolInfo:
    """PoolInfo of a contiguous KV pool tensor (duck-typed, so this module needs no torch)."""
    if not pool.is_contiguous():
        raise ValueError("the KV pool must be one contiguous tensor")
    geometry = geometry_of(pool)
    on_gpu = pool.device.type == "cuda"
    return PoolInfo(
        base_address=pool.data_ptr(),
        size_bytes=geometry.pool_bytes,
        num_blocks=geometry.num_blocks,
        element_size=geometry.element_size,
        mem_type="VRAM" if on_gpu else "DRAM",
        device_id=(pool.device.index or 0) if on_gpu else 0,
    )


def geometry_of(pool) -> PoolGeometry:
    return PoolGeometry.from_shape(tuple(pool.shape), pool.element_size())


def block_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(remote_start, local_start, count) runs, in pair order, where both ids go up by one or
    both go down by one: either way remote block start + i lands on local block start + i,
    so a run is one region per plane. A descending run is reported by its lowest ids."""
    runs: list[list[int]] = []  # [first remote, first local, count, step]
    for remote, local in pairs:
        if runs:
            run = runs[-1]
            first_remote, first_local, count, step = run
            moved = remote - (first_remote + step * (count - 1))
            same_way = local - (first_local + step * (count - 1)) == moved
            if moved in (1, -1) and same_way and (count == 1 or moved == step):
                run[2] += 1
                run[3] = moved
                continue
        runs.append([remote, local, 1, 1])
    return [(r, lo, n) if step == 1 else (r - n + 1, lo - n + 1, n) for r, lo, n, step in runs]


def check_pairs(
    remote: PoolGeometry, local: PoolGeometry, pairs: Sequence[tuple[int, int]]
) -> None:
    """Raise ValueError if the pairs cannot be copied between these two pools."""
    if not remote.same_block_layout(local):
        raise ValueError(f"block layouts differ: remote {remote}, local {local}")
    for remote_id, local_id in pairs:
        if not 0 <= remote_id < remote.num_blocks:
            raise ValueError(f"remote block {remote_id} outside [0, {remote.num_blocks})")
        if not 0 <= local_id < local.num_blocks:
            raise ValueError(f"local block {local_id} outside [0, {local.num_blocks})")
    locals_ = [local_id for _, local_id in pairs]
    if len(set(locals_)) != len(locals_):
        raise ValueError("a local block appears twice: two remote blocks would overwrite it")


def block_regions(
    remote: PoolGeometry, local: PoolGeometry, pairs: Sequence[tuple[int, int]]
) -> np.ndarray:
    """Byte regions [n, 3] int64 of (remote_offset, local_offset, length), offsets from each
    pool's start, that copy every remote block of `pairs` onto its local block.

    Runs of consecutive ids on both sides become one region per plane, and regions that
    continue each other on both sides (a run ending at the last block of a plane, the next
    starting at block 0 of the next one) merge too, so a whole pool is a single region.
    """
    check_pairs(remote, local, pairs)
    if not pairs:
        return np.zeros((0, 3), dtype=np.int64)
    runs = np.asarray(block_runs(pairs), dtype=np.int64)
    chunk = remote.chunk_bytes
    planes = np.arange(remote.num_planes, dtype=np.int64)[:, None]
    remote_off = (planes * remote.plane_bytes + runs[None, :, 0] * chunk).ravel()
    local_off = (planes * local.plane_bytes + runs[None, :, 1] * chunk).ravel()
    length = np.broadcast_to(runs[None, :, 2] * chunk, (remote.num_planes, len(runs))).ravel()
    return _merge_adjacent(remote_off, local_off, length)


def _merge_adjacent(remote_off: np.ndarray, local_off: np.ndarray, length: np.ndarray):
    """Fold each region into the previous one when it continues it on both sides."""
    continues = (remote_off[1:] == remote_off[:-1] + length[:-1]) & (
        local_off[1:] == local_off[:-1] + length[:-1]
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return np.stack(
        [remote_off[starts], local_off[starts], np.add.reduceat(length, starts)], axis=1
    )


@dataclass(frozen=True)
class WireChunk:
    """One message of the TCP data path: planes [first_plane, +num_planes) of the requested
    blocks [first_block, +num_blocks) (indices into the request's block list), serialised
    as [num_planes, num_blocks, chunk_bytes]."""

    first_block: int
    num_blocks: int
    first_plane: int
    num_planes: int


def wire_chunks(num_blocks: int, geometry: PoolGeometry, max_bytes: int) -> list[WireChunk]:
    """Split a transfer of `num_blocks` blocks into messages of at most `max_bytes` (or one
    plane of one block, if that alone is bigger): whole blocks when a block fits, else
    groups of planes of one block."""
    if geometry.block_bytes <= max_bytes:
        per = max_bytes // geometry.block_bytes
        return [
            WireChunk(start, min(per, num_blocks - start), 0, geometry.num_planes)
            for start in range(0, num_blocks, per)
        ]
    per_planes = max(1, max_bytes // geometry.chunk_bytes)
    return [
        WireChunk(block, 1, plane, min(per_planes, geometry.num_planes - plane))
        for block in range(num_blocks)
        for plane in range(0, geometry.num_planes, per_planes)
    ]
