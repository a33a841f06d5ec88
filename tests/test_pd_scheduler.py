"""Scheduler paths of disaggregation: a decode-side request waits for its pulled blocks without
holding up others, falls back to computing locally, and a prefill-side request's blocks stay
held until released; nothing is freed while a transfer may still write into it."""

from __future__ import annotations

from conftest import check_invariants, make_request, make_scheduler
from pagefleet.engine.kv_transfer.connector import RemoteSource
from pagefleet.engine.request import RequestStatus

PROMPT = list(range(1, 19))  # 18 tokens: 5 blocks of 4, the last one partial


def step(sched, tokens=None):
    out = sched.schedule()
    sampled = [tokens.get(r.request_id, 7) if tokens else 7 for r, _ in out.scheduled]
    finished = sched.update_from_output(out, sampled)
    check_invariants(sched)
    return out, finished


def test_a_remote_prefill_request_pulls_then_computes_only_its_last_token():
    sched = make_scheduler(num_blocks=16)
    remote = make_request("d", PROMPT, max_tokens=3)
    remote.remote_source = RemoteSource("prefill-pod", "127.0.0.1", 1, (), "r")
    local = make_request("other", [9, 9, 9], max_tokens=3)
    sched.add_request(remote)
    sched.add_request(local)
    out, _ = step(sched)
    assert out.kv_loads == [remote] and remote.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(remote.block_ids) == 5  # the whole prompt's blocks, allocated up front
    assert [r.request_id for r, _ in out.scheduled] == ["other"]  # others keep going
    out, _ = step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["other"]
    sched.finish_remote_load("d", ok=True)
    assert remote.remote_source is None and remote.num_computed_tokens == len(PROMPT) - 1
    out, _ = step(sched)
    assert ("d", 1) in [(r.request_id, n) for r, n in out.scheduled]
    assert remote.output_token_ids == [7]
    assert remote.num_cached_blocks == 4  # pulled full blocks join the prefix cache


def test_a_failed_pull_falls_back_to_computing_the_prompt_locally():
    sched = make_scheduler(num_blocks=16)
    remote = make_request("d", PROMPT, max_tokens=2)
    remote.remote_source = RemoteSource("prefill-pod", "127.0.0.1", 1, (), "r")
    sched.add_request(remote)
    step(sched)
    sched.finish_remote_load("d", ok=False)
    out, _ = step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("d", len(PROMPT))]
    _, finished = step(sched)
    assert finished == [remote] and remote.output_token_ids == [7, 7]
    assert sched.kv_cache.num_free_blocks == 16


def test_local_prefix_hits_shrink_what_is_pulled():
    sched = make_scheduler(num_blocks=16)
    warm = make_request("warm", [*PROMPT[:12], 50], max_tokens=1)
    sched.add_request(warm)
    step(sched)
    remote = make_request("d", PROMPT, max_tokens=2)
    remote.remote_source = RemoteSource("prefill-pod", "127.0.0.1", 1, (), "r")
    sched.add_request(remote)
    step(sched)
    assert remote.num_cached_blocks == 3 and remote.num_computed_tokens == 12
    assert len(remote.block_ids) == 5  # blocks 3 and 4 are what the transfer must fill


def test_an_abort_while_pulling_frees_the_blocks_only_when_the_transfer_ends():
    sched = make_scheduler(num_blocks=16)
    remote = make_request("d", PROMPT, max_tokens=2)
    remote.remote_source = RemoteSource("prefill-pod", "127.0.0.1", 1, (), "r")
    sched.add_request(remote)
    step(sched)
    sched.abort("d")
    assert sched.kv_cache.num_free_blocks == 11  # a READ may still be writing into them
    check_invariants(sched)
    sched.finish_remote_load("d", ok=True)
    assert sched.kv_cache.num_free_blocks == 16 and not sched.has_unfinished()
    assert sched.finish_remote_load("d", ok=True) is None  # a late report is ignored


def test_a_prefill_side_request_holds_its_blocks_until_released():
    sched = make_scheduler(num_blocks=16)
    req = make_request("p", PROMPT, max_tokens=1)
    req.hold_blocks = True
    sched.add_request(req)
    _, finished = step(sched)
    assert finished == [req] and req.status is RequestStatus.FINISHED_LENGTH
    assert sched.held == {"p": req} and sched.num_held_blocks == 5
    assert sched.kv_cache.usage == 5 / 16  # held blocks count as used
    assert sched.release_held("p") and not sched.release_held("p")
    assert sched.kv_cache.usage == 0 and sched.kv_cache.num_free_blocks == 16


def test_loading_requests_count_against_max_num_seqs():
    sched = make_scheduler(num_blocks=32, max_num_seqs=2)
    for i in range(2):
        r = make_request(f"d{i}", PROMPT, max_tokens=2)
        r.remote_source = RemoteSource("p", "127.0.0.1", 1, (), "r")
        sched.add_request(r)
    sched.add_request(make_request("x", [1, 2], max_tokens=2))
    out, _ = step(sched)
    assert len(out.kv_loads) == 2 and not out.scheduled


def test_a_pull_nixl_cannot_cancel_quarantines_its_blocks_for_good():
    sched = make_scheduler(num_blocks=16)
    remote = make_request("d", PROMPT, max_tokens=2)
    remote.remote_source = RemoteSource("prefill-pod", "127.0.0.1", 1, (), "r")
    sched.add_request(remote)
    step(sched)
    sched.quarantine_remote_load("d")  # the READ may write into its 5 blocks any time
    assert remote.status is RequestStatus.FINISHED_ABORTED and not sched.has_unfinished()
    assert sched.kv_cache.num_free_blocks == 11
    check_invariants(sched)
    assert sched.finish_remote_load("d", ok=True) is None
    step(sched)
    assert sched.kv_cache.num_free_blocks == 11
