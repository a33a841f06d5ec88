"""Scheduler rules: chunking, partial-prefill cap, preemption, anti-thrash, stops, rejections."""

from __future__ import annotations

import pytest

from conftest import check_invariants, make_request, make_scheduler
from pagefleet.engine.kv_transfer.connector import RemoteSource
from pagefleet.engine.request import RequestStatus
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.simulated import run_step


def _chunks(out) -> dict[str, int]:
    return {r.request_id: n for r, n in out.scheduled}


def test_chunked_prefill_splits_at_the_budget_and_mixes_with_decodes():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    short = make_request("short", [1, 2, 3], max_tokens=10)
    sched.add_request(short)
    run_step(sched, sched.schedule())  # short is decoding now
    long = make_request("long", list(range(20)), max_tokens=2)
    sched.add_request(long)
    seen = []
    while long.num_output_tokens == 0:
        out = sched.schedule()
        seen.append(_chunks(out))
        assert out.num_tokens <= 8
        run_step(sched, out)
    # The decode takes 1 token of each step's budget; the prompt takes the rest: 7 + 7 + 6.
    assert seen == [{"short": 1, "long": 7}, {"short": 1, "long": 7}, {"short": 1, "long": 6}]
    assert long.num_computed_tokens == 20 and long.num_output_tokens == 1


def test_long_prefill_token_threshold_caps_a_prompt_per_step():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    r = make_request("r", list(range(12)), max_tokens=1)
    sched.add_request(r)
    sizes = []
    while not r.status.finished:
        out = sched.schedule()
        sizes.append(_chunks(out)["r"])
        run_step(sched, out)
    assert sizes == [5, 5, 2]


def test_partial_prefill_cap_holds_back_a_second_long_prompt():
    for cap, expected in ((1, {"a": 6}), (2, {"a": 6, "b": 4})):
        sched = make_scheduler(
            max_num_batched_tokens=10,
            long_prefill_token_threshold=6,
            max_num_partial_prefills=cap,
        )
        sched.add_request(make_request("a", list(range(30)), max_tokens=1))
        sched.add_request(make_request("b", list(range(100, 130)), max_tokens=1))
        assert _chunks(sched.schedule()) == expected


def test_a_prompt_that_finishes_in_the_step_does_not_count_as_partial():
    sched = make_scheduler(max_num_batched_tokens=10, max_num_partial_prefills=1)
    sched.add_request(make_request("long", list(range(30)), max_tokens=1))
    sched.add_request(make_request("tiny", [7, 8], max_tokens=1))
    run_step(sched, sched.schedule())  # long takes the whole budget
    assert _chunks(sched.schedule()) == {"long": 10}
    sched2 = make_scheduler(max_num_batched_tokens=10, max_num_partial_prefills=1)
    sched2.add_request(make_request("tiny", [7, 8], max_tokens=1))
    sched2.add_request(make_request("long", list(range(30)), max_tokens=1))
    assert _chunks(sched2.schedule()) == {"tiny": 2, "long": 8}


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", [i + 1], max_tokens=5))
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert sched.num_waiting == 2


def test_preemption_picks_the_most_recently_admitted_and_keeps_its_tokens():
    # 4 blocks of 4 slots; three requests grow until the pool is full.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    reqs = [make_request(f"r{i}", [i + 1] * 3, max_tokens=12) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    victim = None
    for _ in range(20):
        out = sched.schedule()
        check_invariants(sched)
        if out.preempted:
            victim = out.preempted[0]
            break
        run_step(sched, out)
    assert victim is reqs[2], "the last admitted request is the victim"
    assert victim.status is RequestStatus.PREEMPTED and sched.waiting[0] is victim
    assert victim.num_computed_tokens == 0 and victim.block_ids == []
    assert victim.num_output_tokens > 0, "generated tokens survive preemption"
    assert sched.num_preemptions == 1 and victim.num_preemptions == 1
    # It resumes later, recomputing prompt + output, and finishes like the others.
    while sched.has_unfinished():
        run_step(sched, sched.schedule())
        check_invariants(sched)
    assert all(r.finish_reason == "length" and r.num_output_tokens == 12 for r in reqs)


def test_resumed_request_is_not_the_victim_in_the_next_step():
    """Anti-thrash: a request resumed in the previous step, or that has not sampled a token
    since it resumed, is skipped as a victim while others are left. Fails for: the step window
    off by one either way, or the not-sampled test off by one (a plain decode counted as
    recomputing, or the step that samples after the recompute not)."""
    sched = make_scheduler(num_blocks=32)
    a, b, c = (make_request(x, [1, 2], max_tokens=5) for x in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    run_step(sched, sched.schedule())  # all three computed their prompt: plain decodes now
    sched.schedule()
    # c was resumed in the previous step: b is preempted for a instead, though c is newer.
    c.resumed_step = sched.step_id - 1
    assert sched._pick_victim(0) is b
    # Only when c is the sole candidate left does it lose its blocks.
    assert sched._pick_victim(2) is c
    b.resumed_step = sched.step_id - 1
    assert sched._pick_victim(1) is c
    # A request resumed two steps ago is fair game again...
    c.resumed_step = sched.step_id - 2
    assert sched._pick_victim(0) is c
    # ... unless it has not sampled since it resumed: still recomputing its lost tokens...
    c.resumed_len = len(c.all_token_ids)
    c.num_computed_tokens = len(c.all_token_ids) - 2
    assert sched._pick_victim(0) is a
    # ... or computing the last of them, the step that samples its next token.
    c.num_computed_tokens = len(c.all_token_ids) - 1
    assert sched._pick_victim(0) is a
    # One token later it decodes as any request does.
    c.all_token_ids.append(0)
    assert sched._pick_victim(0) is c


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_two_requests_that_each_fill_the_pool_do_not_evict_each_other_forever(
    enable_prefix_caching,
):
    # Seven one-token blocks; the recompute after a preemption takes several 2-token chunks.
    sched = make_scheduler(
        num_blocks=7,
        block_size=1,
        max_num_batched_tokens=7,
        max_num_seqs=5,
        max_num_partial_prefills=2,
        long_prefill_token_threshold=2,
        enable_prefix_caching=enable_prefix_caching,
    )
    a = make_request("a", [0, 1, 0], max_tokens=5, block_size=1)
    b = make_request("b", [0, 1, 2, 2, 2, 2, 2], max_tokens=1, block_size=1)
    sched.add_request(a)
    sched.add_request(b)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        check_invariants(sched)
        # A request resumed and still recomputing is never the victim of another request.
        for victim in out.preempted:
            assert (
                victim.resumed_step < 0
                or not sched._protected(victim)
                or all(sched._protected(r) for r in [*sched.running, victim])
            )
        run_step(sched, out)
        steps += 1
        assert steps < 100, f"livelock: {sched.num_preemptions} preemptions in {steps} steps"
    assert a.num_output_tokens == 5 and b.num_output_tokens == 1


def test_stop_token_eos_min_tokens_and_ignore_eos():
    def generate(**params):
        sched = make_scheduler()
        r = make_request("r", [5], max_tokens=6, **params)
        sched.add_request(r)
        tokens = iter([9, 2, 9, 2, 9, 9])
        while not r.status.finished:
            out = sched.schedule()
            sched.update_from_output(out, [next(tokens)])
        return r.output_token_ids, r.finish_reason

    assert generate(eos_token_id=2) == ([9, 2], "stop")
    assert generate(eos_token_id=2, min_tokens=3) == ([9, 2, 9, 2], "stop")
    assert generate(eos_token_id=2, ignore_eos=True) == ([9, 2, 9, 2, 9, 9], "length")
    assert generate(stop_token_ids=(9,)) == ([9], "stop")


def test_max_model_len_caps_output():
    sched = make_scheduler(max_model_len=8)
    r = make_request("r", [1, 2, 3, 4, 5], max_tokens=100)
    sched.add_request(r)
    while not r.status.finished:
        run_step(sched, sched.schedule())
    assert r.num_tokens == 8 and r.finish_reason == "length"


def test_abort_frees_blocks_for_running_and_waiting_requests():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    run = make_request("run", list(range(9)), max_tokens=5)
    wait = make_request("wait", list(range(9)), max_tokens=5)
    sched.add_request(run)
    sched.add_request(wait)
    out = sched.schedule()
    assert sched.abort("run") is run and sched.abort("wait") is wait
    assert sched.abort("run") is None  # unknown now: ignored
    # The step scheduled before the abort completes without touching the aborted request.
    assert sched.update_from_output(out, [3]) == []
    assert run.finish_reason == "abort" and run.num_output_tokens == 0
    assert sched.kv_cache.num_free_blocks == 8 and not sched.has_unfinished()


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "kwargs", "message"),
    [
        ([], 4, {}, "prompt is empty"),
        (list(range(64)), 4, {"max_model_len": 64}, "--max-model-len"),
        (list(range(40)), 40, {"num_blocks": 8}, "--num-gpu-blocks-override"),
    ],
)
def test_requests_that_can_never_run_are_rejected_at_add(prompt, max_tokens, kwargs, message):
    sched = make_scheduler(**kwargs)
    with pytest.raises(ValueError, match=message):
        sched.add_request(make_request("r", prompt, max_tokens=max_tokens))
    assert not sched.has_unfinished()


def test_a_request_that_fits_the_pool_exactly_is_accepted_and_finishes():
    # 8 blocks x 4 = 32 slots; 20 + 13 = 33 tokens, the last never needs a slot.
    sched = make_scheduler(num_blocks=8)
    r = make_request("r", list(range(20)), max_tokens=13)
    sched.add_request(r)
    while sched.has_unfinished():
        run_step(sched, sched.schedule())
    assert r.num_output_tokens == 13


def test_duplicate_ids_and_bad_max_tokens_are_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("r", [1], max_tokens=1))
    with pytest.raises(ValueError, match="duplicate request id"):
        sched.add_request(make_request("r", [2], max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)


def test_bad_config_names_the_flag():
    with pytest.raises(ValueError, match="--block-size"):
        make_scheduler(block_size=3)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        make_scheduler(max_num_seqs=0)
    with pytest.raises(ValueError, match="without chunked prefill"):
        make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        make_scheduler(enable_chunked_prefill=False, long_prefill_token_threshold=8)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        make_scheduler(max_num_seqs=16, max_num_batched_tokens=8)


def test_one_block_is_enough_for_a_scheduler_and_none_is_refused_by_name():
    from pagefleet.engine.config import CacheConfig, SchedulerConfig
    from pagefleet.engine.scheduler import Scheduler

    assert Scheduler.create(SchedulerConfig(max_model_len=8), CacheConfig(4, num_gpu_blocks=1))
    with pytest.raises(ValueError, match=r"^num_gpu_blocks must be set \(>= 1\) to build"):
        Scheduler.create(SchedulerConfig(max_model_len=8), CacheConfig(4, num_gpu_blocks=0))


def test_rejections_say_why():
    sched = make_scheduler(block_size=4)
    with pytest.raises(ValueError, match=r"^the prompt is empty: at least one token is required$"):
        sched.add_request(make_request("e", []))
    with pytest.raises(
        ValueError, match=r"^request hashed with block_size=8, engine uses 4 \(--block-size\)$"
    ):
        sched.add_request(make_request("b", [1, 2], block_size=8))


def test_a_step_applies_results_to_every_request_after_an_aborted_or_chunked_one():
    """Fails for: `continue` turned into `break` (requests after an aborted one, or after a
    prompt chunk, lose their token), or a result list too short for the step accepted."""
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    first, second = make_request("x", [1, 2], max_tokens=4), make_request("y", [3], max_tokens=4)
    sched.add_request(first)
    sched.add_request(second)
    out = sched.schedule()
    sched.abort("x")
    sched.update_from_output(out, [7, 8])
    assert second.output_token_ids == [8]
    with pytest.raises(IndexError):
        sched.update_from_output(sched.schedule(), [])
    capped = make_scheduler(max_num_batched_tokens=8, block_size=4, long_prefill_token_threshold=4)
    chunked, short = make_request("z", list(range(20)), max_tokens=2), make_request("s", [3])
    capped.add_request(chunked)
    capped.add_request(short)
    out = capped.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("z", 4), ("s", 1)]
    capped.update_from_output(out, [9])  # one token per request that samples: "s" only
    assert short.output_token_ids == [9] and chunked.num_output_tokens == 0


def test_the_last_budget_token_admits_a_one_token_prompt_and_decodes_stay_in_budget():
    """Fails for: admission stopping with one token of budget left, or decodes scheduled past
    the budget."""
    sched = make_scheduler(max_num_batched_tokens=5, block_size=4)
    sched.add_request(make_request("four", [1, 2, 3, 4], max_tokens=3))
    sched.add_request(make_request("one", [5], max_tokens=3))
    assert _chunks(sched.schedule()) == {"four": 4, "one": 1}
    tight = make_scheduler(max_num_batched_tokens=2, block_size=4)
    for i in range(3):
        tight.add_request(make_request(f"d{i}", [i + 1], max_tokens=5))
    out = tight.schedule()
    assert len(out.scheduled) == 2 and out.num_tokens == 2
    run_step(tight, out)
    out = tight.schedule()
    assert out.num_tokens <= 2


def test_preemptions_are_counted_each_time():
    """Fails for: the counters set to 1 instead of incremented."""
    sched = make_scheduler(num_blocks=32)
    a, b = make_request("a", [1, 2], max_tokens=5), make_request("b", [3, 4], max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, sched.schedule())
    for _ in range(2):
        sched._preempt(b)
        run_step(sched, sched.schedule())
    assert (b.num_preemptions, sched.num_preemptions) == (2, 2)


def test_a_resumed_request_is_protected_for_exactly_the_next_step():
    """The anti-thrash window, through the real flow (not by setting resumed_step): a request
    re-admitted after preemption is protected in the step after, not the one after that.
    Fails for: the step counter moving by anything but one."""
    sched = make_scheduler(num_blocks=32)
    a, b = make_request("a", [1, 2], max_tokens=8), make_request("b", [3, 4], max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, sched.schedule())
    sched._preempt(b)
    run_step(sched, sched.schedule())  # b resumes: it recomputes its prompt and token
    assert b.status is RequestStatus.RUNNING and b.resumed_step == sched.step_id
    sched.schedule()  # the next step
    assert sched._protected(b)
    sched.schedule()  # and the one after
    assert not sched._protected(b)


def test_running_partial_prefills_count_against_the_partial_cap():
    """Prompts still being prefilled count toward max_num_partial_prefills in later steps too.
    Fails for: the count of running partial prefills set, decremented or doubled."""
    flags = dict(max_num_batched_tokens=64, long_prefill_token_threshold=4)
    sched = make_scheduler(max_num_partial_prefills=2, **flags)
    for name in "abc":
        sched.add_request(make_request(name, list(range(30)), max_tokens=1))
    out = sched.schedule()
    assert _chunks(out) == {"a": 4, "b": 4}  # admitted as partials up to the cap: c waits
    run_step(sched, out)
    assert _chunks(sched.schedule()) == {"a": 4, "b": 4}  # two partials running: c waits
    one = make_scheduler(max_num_partial_prefills=2, **flags)
    one.add_request(make_request("a", list(range(30)), max_tokens=1))
    run_step(one, one.schedule())
    one.add_request(make_request("b", list(range(100, 130)), max_tokens=1))
    assert _chunks(one.schedule()) == {"a": 4, "b": 4}  # one running partial: room for b


def test_a_remote_load_that_does_not_fit_waits_without_breaking_the_step():
    """Fails for: admission returning nothing when a remote load cannot get its blocks."""
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add_request(make_request("local", list(range(20)), max_tokens=4))
    run_step(sched, sched.schedule())  # holds 6 of 8 blocks
    remote = make_request("remote", list(range(100, 116)), max_tokens=1)  # needs 4 blocks
    remote.remote_source = RemoteSource("prefill-pod", "127.0.0.1", 1, (), "r")
    sched.add_request(remote)
    out = sched.schedule()
    assert out.kv_loads == [] and out.num_tokens == 1 and sched.waiting[0] is remote


def test_a_request_one_slot_larger_than_the_pool_is_refused():
    """2 blocks of 4 hold 8 tokens' keys and values, and the last token's are never written:
    a request of 9 tokens fits, 10 do not. Fails for: the capacity check off by one."""
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add_request(make_request("fits", [1, 2], max_tokens=7))
    with pytest.raises(ValueError, match="needs up to 3 KV blocks"):
        sched.add_request(make_request("big", [1, 2], max_tokens=8))
