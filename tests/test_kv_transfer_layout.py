"""KV transfer geometry: compatibility records, coalesced byte regions and wire chunks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.engine.kv_transfer.layout import (
    CompatRecord,
    PoolGeometry,
    block_regions,
    block_runs,
    describe_pool,
    geometry_of,
    wire_chunks,
)

RECORD = CompatRecord(
    model="tiny-llama",
    dtype="bfloat16",
    kv_dtype="bfloat16",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    block_size=4,
)


def test_identical_records_have_no_mismatch():
    assert RECORD.mismatches(dataclasses.replace(RECORD)) == []


def test_every_differing_field_is_reported_with_both_values():
    other = dataclasses.replace(RECORD, block_size=16, kv_dtype="float32")
    reasons = other.mismatches(RECORD)
    assert len(reasons) == 2
    # The KV dtype's reason names both caches and the flag that aligns them.
    assert reasons[0].startswith("kv_dtype differs: KV cache float32 here, bfloat16 on the peer")
    assert "--kv-cache-dtype" in reasons[0]
    assert "block_size" in reasons[1] and "16" in reasons[1] and "4" in reasons[1]


def test_record_from_a_pool_shape():
    record = CompatRecord.from_pool_shape("m", "float32", "float32", (3, 2, 4, 100, 16, 64))
    assert (record.num_layers, record.num_kv_heads, record.block_size, record.head_dim) == (
        3,
        4,
        16,
        64,
    )
    assert record.cache_layout == "layer,kv,head,block,slot,dim"
    with pytest.raises(ValueError, match="not \\[layers, 2"):
        CompatRecord.from_pool_shape("m", "f", "f", (3, 4, 100, 16, 64))


def geometry(num_blocks: int, layers: int = 2, heads: int = 3, bs: int = 2, dim: int = 4):
    return PoolGeometry(layers, heads, num_blocks, bs, dim, element_size=2)


def copy_naively(src: np.ndarray, dst: np.ndarray, pairs) -> None:
    """Reference: copy each (remote, local) block plane by plane, element views of the pools."""
    for remote, local in pairs:
        dst[:, :, :, local] = src[:, :, :, remote]


def apply_regions(src: bytes, dst: bytearray, regions: np.ndarray) -> None:
    for remote_off, local_off, length in regions.tolist():
        dst[local_off : local_off + length] = src[remote_off : remote_off + length]


pair_lists = st.integers(1, 12).flatmap(
    lambda n_local: st.tuples(
        st.integers(1, 12),
        st.just(n_local),
        st.lists(st.integers(0, n_local - 1), unique=True, max_size=n_local),
    )
)


@settings(max_examples=80, deadline=None)
@given(pair_lists, st.randoms(use_true_random=False))
def test_regions_copy_exactly_the_paired_blocks(case, rnd):
    n_remote, n_local, local_ids = case
    pairs = [(rnd.randrange(n_remote), local) for local in local_ids]
    remote, local = geometry(n_remote), geometry(n_local)
    src = np.arange(remote.pool_bytes // 2, dtype=np.int16).reshape(2, 2, 3, n_remote, 2, 4)
    dst = -np.ones((2, 2, 3, n_local, 2, 4), dtype=np.int16)
    expected = dst.copy()
    copy_naively(src, expected, pairs)
    out = bytearray(dst.tobytes())
    apply_regions(src.tobytes(), out, block_regions(remote, local, pairs))
    assert np.array_equal(np.frombuffer(bytes(out), dtype=np.int16).reshape(dst.shape), expected)


def test_consecutive_runs_coalesce_into_one_region_per_plane():
    # Llama-3-8B's shape, 32k tokens in 2048 consecutive blocks: 512 regions, not 1M.
    llama = PoolGeometry(32, 8, 4096, 16, 128, element_size=2)
    pairs = [(100 + i, 2000 + i) for i in range(2048)]
    regions = block_regions(llama, llama, pairs)
    assert regions.shape == (llama.num_planes, 3)
    assert (regions[:, 2] == 2048 * llama.chunk_bytes).all()
    assert int(regions[:, 2].sum()) == 2048 * llama.block_bytes


def test_two_runs_give_two_regions_per_plane_and_a_whole_pool_is_one():
    g = geometry(10)
    assert block_runs([(0, 5), (1, 6), (7, 2), (8, 3), (3, 4)]) == [(0, 5, 2), (7, 2, 2), (3, 4, 1)]
    assert len(block_regions(g, g, [(0, 5), (1, 6), (7, 2), (8, 3)])) == 2 * g.num_planes
    whole = block_regions(g, g, [(i, i) for i in range(10)])
    assert whole.tolist() == [[0, 0, g.pool_bytes]]
    assert block_regions(g, g, []).shape == (0, 3)


def test_bad_pairs_are_refused():
    g = geometry(4)
    with pytest.raises(ValueError, match="remote block 4"):
        block_regions(g, g, [(4, 0)])
    with pytest.raises(ValueError, match="local block -1"):
        block_regions(g, g, [(0, -1)])
    with pytest.raises(ValueError, match="twice"):
        block_regions(g, g, [(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="layouts differ"):
        block_regions(g, geometry(4, heads=2), [(0, 0)])


@pytest.mark.parametrize("max_bytes", [1, 48, 200, 10_000])
def test_wire_chunks_cover_every_plane_of_every_block_once(max_bytes):
    g = geometry(8)  # chunk 16 bytes, 12 planes, block 192 bytes
    chunks = wire_chunks(5, g, max_bytes)
    seen = [
        (block, plane)
        for c in chunks
        for plane in range(c.first_plane, c.first_plane + c.num_planes)
        for block in range(c.first_block, c.first_block + c.num_blocks)
    ]
    assert sorted(seen) == [(b, p) for b in range(5) for p in range(g.num_planes)]
    for c in chunks:
        assert c.num_planes * c.num_blocks * g.chunk_bytes <= max(max_bytes, g.chunk_bytes)


def test_describe_pool_gives_address_size_and_geometry():
    pool = torch.zeros(2, 2, 3, 7, 4, 8, dtype=torch.bfloat16)
    info = describe_pool(pool)
    assert info.base_address == pool.data_ptr()
    assert info.size_bytes == pool.numel() * 2
    assert (info.num_blocks, info.element_size, info.mem_type) == (7, 2, "DRAM")
    assert info.geometry(CompatRecord.from_pool_shape("m", "d", "d", pool.shape)) == geometry_of(
        pool
    )
    with pytest.raises(ValueError, match="contiguous"):
        describe_pool(pool.transpose(0, 1))
