"""Transfers over runs of blocks: the decode side's pull destination comes in runs of free ids
laid out like the source's runs, and the READ's regions coalesce over every run that lines up
on both sides (up or down) while copying exactly the bytes of the per-block copy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_pool import count_runs

from conftest import check_invariants, make_request, make_scheduler
from pagefleet.engine.kv_cache import KVCacheManager
from pagefleet.engine.kv_cache.block_pool import mirror_runs, source_runs
from pagefleet.engine.kv_transfer.connector import RemoteSource
from pagefleet.engine.kv_transfer.layout import PoolGeometry, block_regions, block_runs
from pagefleet.engine.request import RequestStatus

GEOMETRY = PoolGeometry(2, 3, 64, 2, 4, element_size=2)  # 12 planes of 64 blocks, 16-byte chunks


def per_block_bytes(geometry: PoolGeometry, pairs) -> dict[int, int]:
    """Reference: local byte offset -> remote byte offset, one block and plane at a time."""
    chunk = geometry.chunk_bytes
    out = {}
    for remote, local in pairs:
        for plane in range(geometry.num_planes):
            base = plane * geometry.plane_bytes
            for k in range(chunk):
                out[base + local * chunk + k] = base + remote * chunk + k
    return out


def region_bytes(regions: np.ndarray) -> dict[int, int]:
    out = {}
    for remote, local, length in regions.tolist():
        for k in range(length):
            assert local + k not in out, "two regions write the same local byte"
            out[local + k] = remote + k
    return out


def num_aligned_runs(pairs) -> int:
    """Maximal runs of pairs moving by the same +1 or -1 on both sides (the fewest regions
    per plane any copy of these pairs in this order can use)."""
    runs, step = 0, 0
    for i, (remote, local) in enumerate(pairs):
        if i:
            moved = remote - pairs[i - 1][0]
            if moved in (1, -1) and local - pairs[i - 1][1] == moved and step in (0, moved):
                step = moved
                continue
        runs, step = runs + 1, 0
    return runs


@st.composite
def runs_of_pairs(draw):
    """Pairs made of runs going up or down on each side, with scattered singles between."""
    remote_ids = draw(st.permutations(range(GEOMETRY.num_blocks)))
    local_ids = draw(st.permutations(range(GEOMETRY.num_blocks)))
    pairs, used_local = [], set()
    for _ in range(draw(st.integers(0, 6))):
        length = draw(st.integers(1, 8))
        r0, l0 = draw(st.integers(0, 56)), draw(st.integers(0, 56))
        rs, ls = draw(st.sampled_from([1, -1])), draw(st.sampled_from([1, -1]))
        for k in range(length):
            local = l0 + k if ls == 1 else l0 + length - 1 - k
            if local not in used_local:
                used_local.add(local)
                pairs.append((r0 + k if rs == 1 else r0 + length - 1 - k, local))
        if draw(st.booleans()):
            local = local_ids[len(pairs) % 64]
            if local not in used_local:
                used_local.add(local)
                pairs.append((remote_ids[len(pairs) % 64], local))
    return pairs


@settings(max_examples=150, deadline=None)
@given(runs_of_pairs())
def test_merged_regions_copy_exactly_the_bytes_of_the_per_block_copy(pairs):
    """Fails for: a descending run read upside down, a run cut or overrun by one block, a
    region merged across a gap on one side only, more regions than aligned runs."""
    regions = block_regions(GEOMETRY, GEOMETRY, pairs)
    assert region_bytes(regions) == per_block_bytes(GEOMETRY, pairs)
    assert len(regions) <= GEOMETRY.num_planes * num_aligned_runs(pairs)


def test_runs_going_down_on_both_sides_are_one_region_per_plane():
    """The prefill pool hands out descending ids (freed tail-first, reused from the LRU head):
    mirrored on our side they coalesce. Fails for: only ascending runs merged."""
    assert block_runs([(9, 3), (8, 2), (7, 1), (20, 10), (21, 11)]) == [(7, 1, 3), (20, 10, 2)]
    assert block_runs([(9, 3), (8, 4)]) == [(9, 3, 1), (8, 4, 1)]  # opposite ways: no run
    assert block_runs([(1, 1), (2, 2), (1, 3)]) == [(1, 1, 2), (1, 3, 1)]
    regions = block_regions(GEOMETRY, GEOMETRY, [(9 - k, 40 - k) for k in range(6)])
    assert len(regions) == GEOMETRY.num_planes
    assert (regions[:, 2] == 6 * GEOMETRY.chunk_bytes).all()


def test_mirror_runs_lays_our_run_out_like_the_source_runs():
    """Fails for: the allocation's order kept whatever the source (one region per block)."""
    assert source_runs([7, 6, 5, 12, 13, 14, 3]) == [(3, -1), (3, 1), (1, 1)]
    assert source_runs([]) == []
    ours = [20, 21, 22, 23, 24, 25, 26, 27]
    source = [7, 6, 5, 12, 13, 14, 3]
    mirrored = mirror_runs(ours, source)
    assert mirrored == [22, 21, 20, 23, 24, 25, 26, 27]
    assert sorted(mirrored) == ours
    pairs = list(zip(source, mirrored, strict=False))
    assert len(block_runs(pairs)) == 3
    assert mirror_runs(ours, []) == ours  # no source ids: ascending as allocated


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=30, unique=True),
    st.lists(st.integers(0, 40), max_size=30),
)
def test_mirror_runs_is_a_layout_of_the_same_blocks_that_splits_no_run_it_can_keep(ids, source):
    """Every allocated block is used once; each source run is cut only where it cannot fit in
    one of our runs: with one run of ours, the READ has exactly one region per source run.
    Fails for: a block dropped or doubled, a run laid the wrong way, a greedy walk that cuts
    source runs at our runs' boundaries needlessly."""
    ids = sorted(ids)
    mirrored = mirror_runs(ids, source)
    assert sorted(mirrored) == ids
    positions = source[: len(ids)]
    num_source_runs = len(source_runs(positions)) + (len(positions) < len(ids))
    runs = num_aligned_runs(list(zip(positions, mirrored, strict=False)))
    runs += len(positions) < len(ids)  # the tail past the source, read from nowhere
    assert runs <= num_source_runs + count_runs(ids) - 1
    one_run = list(range(100, 100 + len(ids)))
    laid = mirror_runs(one_run, source)
    assert num_aligned_runs(list(zip(positions, laid, strict=False))) == len(source_runs(positions))


def test_mirror_runs_fits_source_runs_into_our_runs_whole():
    """Two runs of ours (3 and 5 blocks) and a source of a 5-run then a 3-run: best fit puts
    each whole. Fails for: walking our ids in order (the 5-run cut over the gap)."""
    laid = mirror_runs([0, 1, 2, 10, 11, 12, 13, 14], [50, 51, 52, 53, 54, 9, 8, 7])
    assert laid == [10, 11, 12, 13, 14, 2, 1, 0]


PROMPT = list(range(1, 19))  # 18 tokens: 5 blocks of 4


def _scramble_free_list(sched, order):
    """Take every block and free them one by one in `order`: the LRU list is then scattered."""
    pool = sched.kv_cache.pool
    pool.allocate(pool.num_blocks)
    for block_id in order:
        pool.free([block_id])


def test_a_pull_gets_a_run_of_blocks_mirroring_the_prefill_side():
    """The decode side allocates the blocks a remote prefill is read into from a run of free
    ids, laid out like the source's blocks, while local prompts keep LRU order. Fails for:
    the pull allocated like any prompt (5 regions per plane instead of 2)."""
    sched = make_scheduler(num_blocks=16)
    order = [15, 0, 14, 1, 13, 2, 12, 3, 11, 4, 10, 5, 9, 6, 8, 7]
    _scramble_free_list(sched, order)
    remote = make_request("d", PROMPT, max_tokens=2)
    # The prefill pod's blocks: a descending run of three, then an ascending one of two.
    remote.remote_source = RemoteSource("p", "10.0.0.1", 1, (30, 29, 28, 40, 41), "p-req")
    local = make_request("other", [9] * 9, max_tokens=2)
    sched.add_request(remote)
    sched.add_request(local)
    out = sched.schedule()
    assert out.kv_loads == [remote] and remote.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert remote.block_ids == [2, 1, 0, 3, 4]
    assert local.block_ids == [15, 14, 13]  # not a transfer: the LRU head, as before
    pairs = list(zip(remote.remote_source.block_ids, remote.block_ids, strict=True))
    assert len(block_regions(GEOMETRY, GEOMETRY, pairs)) == 2 * GEOMETRY.num_planes
    sched.update_from_output(out, [7])
    check_invariants(sched)
    sched.finish_remote_load("d", ok=True)
    out = sched.schedule()
    assert ("d", 1) in [(r.request_id, n) for r, n in out.scheduled]
    sched.update_from_output(out, [7 for _ in out.scheduled])
    check_invariants(sched)


def test_after_a_local_prefix_hit_the_pulled_blocks_mirror_the_source_past_the_hit():
    """The pull skips blocks found in the local prefix cache, so block i of the table pairs
    with source block i: the mirrored layout must start at the first pulled position. Fails
    for: mirroring the source from its start (the hit's ids shift every run by one)."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    warm = make_request("warm", [*PROMPT[:4], 90], max_tokens=1)
    assert kv.allocate_slots(warm, 5, [])
    warm.num_computed_tokens = 5
    kv.cache_computed_blocks(warm)
    kv.free(warm)
    pulled = make_request("d", PROMPT, max_tokens=2)
    hits = kv.find_cached_prefix(pulled)
    assert [b.block_id for b in hits] == [0]
    source = (77, 12, 11, 10, 40)  # block 0 is cached here; then a descending run of three
    remaining = pulled.num_tokens - kv.num_computed_after_hit(pulled, hits)
    assert kv.allocate_slots(pulled, remaining, hits, transfer_source=source)
    assert pulled.block_ids == [0, 3, 2, 1, 4]
    pairs = list(zip(source[1:], pulled.block_ids[1:], strict=True))
    assert num_aligned_runs(pairs) == 2


def test_a_held_prompt_on_the_prefill_side_takes_its_blocks_in_runs_chunk_after_chunk():
    """A prefill pod's request kept for a decode pod (`hold_blocks`) is the source of that
    pod's READ, which merges only where both sides run: its blocks come in runs through every
    prefill chunk, while a plain prompt keeps LRU order. Fails for: the held prompt allocated
    from the LRU head (five runs of one block)."""
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    order = [15, 0, 14, 1, 13, 2, 12, 3, 11, 4, 10, 5, 9, 6, 8, 7]
    _scramble_free_list(sched, order)
    held = make_request("held", PROMPT, max_tokens=1)
    held.hold_blocks = True
    sched.add_request(held)
    chunks = 0
    while held.num_computed_tokens < len(PROMPT):
        out = sched.schedule()
        sched.update_from_output(out, [7 for _ in out.scheduled])
        check_invariants(sched)
        chunks += 1
    assert chunks == 3  # 8 + 8 + 2 tokens: blocks taken 2, 2 and 1 at a time
    assert held.block_ids == [0, 1, 2, 3, 4]
    plain = make_scheduler(num_blocks=16)
    _scramble_free_list(plain, order)
    local = make_request("plain", PROMPT, max_tokens=2)
    plain.add_request(local)
    plain.schedule()
    assert local.block_ids == [15, 0, 14, 1, 13]
