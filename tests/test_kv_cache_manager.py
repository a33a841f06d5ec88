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
    assert b.block_ids == [] and kv.num_free_blocks == 1
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
    assert second.block_ids[:2] == first.block_ids[:2]
    assert all(sched.kv_cache.pool.blocks[i].ref_cnt == 2 for i in second.block_ids[:2])
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
    assert out.scheduled == [(again, 1)] and len(again.block_ids) == 3
    fresh = sched.kv_cache.pool.blocks[again.block_ids[2]]
    assert fresh.ref_cnt == 1 and fresh.block_hash is None


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
