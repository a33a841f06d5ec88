"""KV-cache manager: all-or-nothing allocation, prefix hits, the last-token-only recompute."""

from __future__ import annotations

from conftest import make_request, make_scheduler
from pagefleet.engine.kv_cache import BlockStored, KVCacheManager
from pagefleet.engine.request import Request
from pagefleet.engine.sampling_params import SamplingParams


def _req(rid: str, prompt: list[int], bs: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=8), block_size=bs)


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8, [])
    b = _req("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8, [])
    assert b.block_table == [] and kv.num_free_blocks == 1
    # The miss was not counted as a query: only admitted requests are.
    assert kv.prefix_cache_queries == 8


def test_prefix_hit_shares_computed_blocks_and_counts_tokens():
    sched = make_scheduler(num_blocks=16, block_size=4)
    first = make_request("first", list(range(10)), max_tokens=3)
    sched.add_request(first)
    out = sched.schedule()
    sched.update_from_output(out, [0])
    # Two full blocks of the prompt are computed and cached now.
    second = make_request("second", [*range(8), 50, 51, 52], max_tokens=3)
    sched.add_request(second)
    out = sched.schedule()
    assert dict((r.request_id, n) for r, n in out.scheduled) == {"first": 1, "second": 3}
    assert second.block_table[:2] == first.block_table[:2]
    assert all(b.ref_cnt == 2 for b in second.block_table[:2])
    kv = sched.kv_cache
    assert kv.prefix_cache_queries == 10 + 11 and kv.prefix_cache_hits == 8


def test_full_hit_computes_only_the_last_token_without_writing_shared_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(8))  # exactly two blocks
    first = make_request("first", prompt, max_tokens=1)
    sched.add_request(first)
    first_out = sched.schedule()
    first_blocks = list(first.block_ids)
    sched.update_from_output(first_out, [7])
    assert first.finish_reason == "length"
    free_before = sched.kv_cache.num_free_blocks

    again = make_request("again", prompt, max_tokens=2)
    sched.add_request(again)
    out = sched.schedule()
    assert out.scheduled == [(again, 1)]  # one token, not the whole last block
    assert again.num_computed_tokens == 7
    # Its keys/values are cached: the runner must not write position 7 (< num_cached_tokens).
    assert again.num_cached_tokens == 8
    assert again.block_ids == first_blocks
    assert sched.kv_cache.num_free_blocks == free_before - 2  # revived, nothing new allocated
    assert sched.kv_cache.prefix_cache_hits == 8
    sched.update_from_output(out, [3])
    # The next token (position 8) goes into a fresh, private block.
    out = sched.schedule()
    assert out.scheduled == [(again, 1)] and len(again.block_table) == 3
    assert again.block_table[2].ref_cnt == 1 and again.block_table[2].block_hash is None


def test_usage_excludes_cached_free_blocks_which_are_counted_apart():
    sched = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("r", list(range(12)), max_tokens=1)
    sched.add_request(r)
    out = sched.schedule()
    assert sched.kv_cache.usage == 3 / 8
    sched.update_from_output(out, [1])
    assert sched.kv_cache.usage == 0.0
    assert sched.kv_cache.num_cached_free_blocks == 3


def test_stored_events_follow_computation_and_chain_parents():
    events = []
    sched = make_scheduler(
        num_blocks=8, block_size=4, listener=events.append, max_num_batched_tokens=6
    )
    r = make_request("r", list(range(10)), max_tokens=3)
    sched.add_request(r)
    sched.update_from_output(sched.schedule(), [None])  # computes 6: one full block
    assert events == [BlockStored([r.block_hashes[0]], None, [0, 1, 2, 3], 4)]
    sched.update_from_output(sched.schedule(), [42])  # computes 4 more: block 1 full
    assert events[-1] == BlockStored([r.block_hashes[1]], r.block_hashes[0], [4, 5, 6, 7], 4)


def test_reset_prefix_cache_stops_hits():
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add_request(make_request("a", list(range(8)), max_tokens=1))
    sched.update_from_output(sched.schedule(), [1])
    assert sched.kv_cache.reset_prefix_cache() == 2
    b = make_request("b", list(range(8)), max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert out.scheduled == [(b, 8)] and b.num_cached_tokens == 0


def test_prefix_caching_off_never_hits():
    sched = make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", list(range(8)), max_tokens=1))
    sched.update_from_output(sched.schedule(), [1])
    b = make_request("b", list(range(8)), max_tokens=1)
    sched.add_request(b)
    assert sched.schedule().scheduled == [(b, 8)]
    assert sched.kv_cache.num_cached_free_blocks == 0


def test_defaults_are_vllms():
    kv = KVCacheManager(num_blocks=4)
    assert (kv.block_size, kv.enable_prefix_caching) == (16, True)


def test_decode_fills_the_last_block_before_taking_another():
    """A request whose tokens exactly fill its blocks needs none more; one token more needs
    one. Fails for: `<=` turned into `<` (a block too many), slots counted in blocks."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = _req("r", list(range(6)))
    assert kv.allocate_slots(r, 6, [])
    assert len(r.block_table) == 2
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 2) and len(r.block_table) == 2 and kv.num_free_blocks == 2
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1) and len(r.block_table) == 3 and kv.num_free_blocks == 1


def test_the_last_free_blocks_can_be_taken_exactly():
    """Fails for: a request for exactly the free blocks refused (`>` turned into `>=`)."""
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = _req("r", list(range(12)))
    assert kv.allocate_slots(r, 12, []) and kv.num_free_blocks == 0


def _cached(kv: KVCacheManager, prompt: list[int]) -> None:
    """Compute `prompt` in a request, cache its full blocks, free it."""
    r = _req("warm", prompt)
    assert kv.allocate_slots(r, len(prompt), [])
    r.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(r)
    kv.free(r)


def test_a_prefix_hit_counts_its_revived_blocks_against_free_space():
    """Hits that sit in the free list are taken out of it: they cannot also be handed out as
    new blocks. Fails for: revived blocks counted wrongly (the allocation then fails inside the
    pool, or is refused when it fits), or a refused request given True."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefix = list(range(8))  # two blocks, cached and free
    _cached(kv, prefix)
    fits = _req("fits", [*prefix, *range(50, 58)])  # two hits + two new blocks: exactly all
    hits = kv.find_cached_prefix(fits)
    assert len(hits) == 2 and kv.allocate_slots(fits, 8, hits)
    assert len(fits.block_table) == 4 and kv.num_free_blocks == 0
    kv.free(fits)
    too_big = _req("big", [*prefix, *range(50, 62)])  # two hits + three new blocks: no
    hits = kv.find_cached_prefix(too_big)
    assert not kv.allocate_slots(too_big, 12, hits)
    assert too_big.block_table == [] and kv.num_free_blocks == 4


def test_hits_accumulate_and_only_count_with_prefix_caching_on():
    """Fails for: hits assigned rather than added; queries counted with caching off."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _cached(kv, list(range(8)))
    for rid in ("x", "y"):
        r = _req(rid, [*range(8), 99])
        assert kv.allocate_slots(r, 1, kv.find_cached_prefix(r))
        kv.free(r)
    assert kv.prefix_cache_hits == 16
    off = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert off.allocate_slots(_req("z", list(range(8))), 8, [])
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)


def test_requests_with_prompt_logprobs_never_take_prefix_hits():
    """Every prompt position must be computed to have its logprobs. Fails for: `or` turned
    into `and` (a cached prefix skips the positions whose logprobs were asked for)."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _cached(kv, list(range(8)))
    asks = Request("p", [*range(8), 9], SamplingParams(prompt_logprobs=1), block_size=4)
    assert kv.find_cached_prefix(asks) == []
    assert len(kv.find_cached_prefix(_req("q", [*range(8), 9]))) == 2


def test_nothing_newly_full_emits_no_event():
    """Fails for: an empty BlockStored event sent when no new block is full."""
    events = []
    kv = KVCacheManager(num_blocks=4, block_size=4, listener=events.append)
    r = _req("r", list(range(6)))
    assert kv.allocate_slots(r, 6, [])
    r.num_computed_tokens = 6
    kv.cache_computed_blocks(r)
    assert len(events) == 1
    kv.cache_computed_blocks(r)  # still one full block
    assert len(events) == 1


def test_freeing_resets_what_the_request_had_cached():
    """A preempted request starts over: no blocks, nothing cached. Fails for: stale counts
    (the runner would skip writing positions it believes cached)."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _cached(kv, list(range(8)))
    r = _req("r", [*range(8), 99])
    assert kv.allocate_slots(r, 1, kv.find_cached_prefix(r))
    assert (r.num_cached_blocks, r.num_cached_tokens) == (2, 8)
    kv.free(r)
    assert (r.num_cached_blocks, r.num_cached_tokens) == (0, 0)
    assert r.block_table == [] and r.block_ids == []


def test_a_hit_admission_allocates_blocks_for_all_new_tokens():
    """Fails for: the new-block count on the hit path off by a block."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _cached(kv, list(range(8)))
    r = _req("r", [*range(8), *range(60, 69)])  # 17 tokens: 2 hit blocks + 3 new
    hits = kv.find_cached_prefix(r)
    assert kv.allocate_slots(r, 9, hits)
    assert len(r.block_table) == 5 and r.num_computed_tokens == 8
