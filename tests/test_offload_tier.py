"""The CPU offload tier (--kv-offloading-size): blocks evicted from the device pool are kept in
host memory and loaded back on a prefix hit instead of being recomputed, in the background while
other requests step; greedy output stays equal to HF transformers' in float32; KV events say
which medium holds a block; the router scores tier hits below device hits; nothing stays pinned
or allocated after requests end or abort, even mid-load."""

from __future__ import annotations

import concurrent.futures
import random
import threading

import pytest

from hf_reference import assert_greedy_equal
from pagefleet.common.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.kv_cache.host_tier import HostTier, TierLoad
from pagefleet.engine.request import RequestStatus

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 24 device blocks of 16 tokens: two 150-token conversations cannot both stay on the device.
ENGINE = dict(num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=4)
TIER_GIB = 1 / 1024  # 1 MiB: 128 blocks of the tiny llama (8 KiB each)
BLOCK_BYTES = 8192


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(length)] for _ in range(n)]


def _run(llm: LLM, prompt: list[int]):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def _scrape(llm: LLM) -> dict[str, float]:
    """The engine's /metrics as the server exports them (name -> value)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagefleet.engine.server.metrics import _EngineCollector

    registry = CollectorRegistry()
    registry.register(_EngineCollector(llm.engine, "tiny"))
    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _gate(llm: LLM) -> threading.Event:
    """Hold the copier's one worker thread: loads queue behind it until the event is set."""
    gate = threading.Event()
    llm.engine.tier_copier._worker.submit(gate.wait, 30)
    return gate


def _assert_all_released(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.host_tier.pinned and not kv.host_tier.orphans
    assert not llm.engine.scheduler.requests and not llm.engine.scheduler.tier_loading
    assert not llm.engine.tier_copier.in_flight


def test_returning_prompts_load_from_the_tier_and_stay_greedy_equal(tiny_checkpoints):
    """Catches reloaded blocks holding the wrong bytes (a wrong slot, a slot overwritten by a
    store, a block written before its store was copied): the returning conversations' greedy
    tokens must equal HF's and the first time's; the counters and /metrics say what moved."""
    path = tiny_checkpoints["llama"]
    llm = LLM(path, kv_offloading_size=TIER_GIB, **ENGINE)
    tier = llm.engine.scheduler.kv_cache.host_tier
    prompts = _prompts(4, 150)
    first = [_run(llm, p).outputs[0].token_ids for p in prompts]  # each evicts the previous
    assert tier.stats.stored_blocks > 0
    for prompt, before in zip(prompts, first, strict=True):
        again = _run(llm, prompt)
        assert again.outputs[0].token_ids == before
        assert_greedy_equal(path, prompt, again.outputs[0].token_ids, MAX_TOKENS)
        assert again.num_cached_tokens >= 144  # 9 full blocks came back, none recomputed
    assert tier.stats.loaded_blocks >= 4 * 9 - 9  # the last prompt may still be on the device
    assert tier.stats.hit_blocks == tier.stats.loaded_blocks
    moved = tier.stats.loaded_blocks + tier.stats.stored_blocks
    assert llm.engine.tier_copier.bytes_moved == moved * BLOCK_BYTES
    _assert_all_released(llm)
    metrics = _scrape(llm)
    assert metrics["pagefleet:kv_offload_loaded_blocks_total"] == tier.stats.loaded_blocks
    assert metrics["pagefleet:kv_offload_hit_blocks_total"] == tier.stats.hit_blocks
    assert metrics["pagefleet:kv_offload_loads_total"] == tier.stats.loads >= 3
    assert metrics["pagefleet:kv_offload_bytes_total"] == moved * BLOCK_BYTES
    assert metrics["pagefleet:kv_offload_blocks"] == len(tier) > 0
    assert metrics["vllm:external_prefix_cache_hits_total"] == tier.stats.hit_blocks * 16


def test_without_the_tier_the_same_trace_recomputes(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], **ENGINE)
    assert llm.engine.scheduler.kv_cache.host_tier is None
    prompts = _prompts(4, 150)
    for p in prompts:
        _run(llm, p)
    assert _run(llm, prompts[0]).num_cached_tokens == 0
    assert "pagefleet:kv_offload_blocks" not in _scrape(llm)


def test_batches_mixing_loads_stores_and_preemption_stay_greedy_equal(tiny_checkpoints):
    """Many requests at once over a pool that holds two: a step stores evicted blocks while
    loads run, and preempted requests come back through the tier."""
    path = tiny_checkpoints["llama"]
    llm = LLM(path, kv_offloading_size=TIER_GIB, **ENGINE)
    system = _prompts(1, 64, seed=3)[0]
    prompts = [system + p for p in _prompts(6, 40, seed=4)]
    outs = llm.generate(prompts + prompts[::-1], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts + prompts[::-1], outs, strict=True):
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, MAX_TOKENS)
    assert llm.engine.scheduler.kv_cache.host_tier.stats.loaded_blocks > 0
    _assert_all_released(llm)


def test_preempted_requests_resume_through_the_tier_and_stay_greedy_equal(tiny_checkpoints):
    """Four requests that outgrow the pool while decoding: the preempted ones' blocks are
    evicted into the tier and loaded back when they resume; output is still HF's."""
    path = tiny_checkpoints["llama"]
    llm = LLM(path, kv_offloading_size=TIER_GIB, **ENGINE)
    prompts = _prompts(4, 88, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, 24)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv_cache.host_tier.stats.loads > 0
    _assert_all_released(llm)


def test_a_load_runs_while_other_requests_keep_stepping(tiny_checkpoints):
    """Catches a load on the step's critical path: with the copy held back, another request
    keeps decoding while the returning one waits; once the copy lands it joins the batch and
    its output is still HF's."""
    path = tiny_checkpoints["llama"]
    llm = LLM(path, kv_offloading_size=TIER_GIB, **ENGINE)
    engine = llm.engine
    returning, *evictors, busy = _prompts(4, 150, seed=7)
    for prompt in [returning, *evictors]:  # the evictors push the returning one into the tier
        _run(llm, prompt)
    long_decode = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("busy", busy[:40], long_decode)
    engine.step()
    gate = _gate(llm)
    engine.add_request("back", returning, GREEDY)
    busy_req = engine.scheduler.requests["busy"]
    back = engine.scheduler.requests["back"]
    tokens_before = busy_req.num_output_tokens
    for _ in range(5):
        engine.step()
    assert back.status is RequestStatus.WAITING_FOR_TIER_LOAD
    assert busy_req.num_output_tokens >= tokens_before + 5  # it stepped while the copy waited
    gate.set()
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["back"].num_cached_tokens >= 144
    assert_greedy_equal(path, returning, outputs["back"].outputs[0].token_ids, MAX_TOKENS)
    _assert_all_released(llm)


def test_aborts_mid_load_release_blocks_and_pins(tiny_checkpoints):
    """Catches a leak (or a block reused while a copy still writes it): requests aborted while
    their blocks are being copied keep blocks and pins until the copy ends, then free both."""
    llm = LLM(tiny_checkpoints["llama"], kv_offloading_size=TIER_GIB, **ENGINE)
    engine = llm.engine
    prompts = _prompts(4, 150, seed=5)
    for p in prompts:
        _run(llm, p)
    gate = _gate(llm)
    ids = [engine.add_request(None, p, GREEDY) for p in prompts[:2]]
    engine.step()  # admits both with loads from the tier; the copies wait behind the gate
    kv, sched = engine.scheduler.kv_cache, engine.scheduler
    assert all(r.status is RequestStatus.WAITING_FOR_TIER_LOAD for r in sched.requests.values())
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()
    assert kv.num_free_blocks < kv.num_blocks and kv.host_tier.pinned  # the copy may write
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.host_tier.stats.loaded_blocks > 0
    _assert_all_released(llm)


def test_reset_prefix_cache_clears_the_tier_even_during_a_load(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], kv_offloading_size=TIER_GIB, **ENGINE)
    engine = llm.engine
    prompts = _prompts(3, 150, seed=6)
    for p in prompts:
        _run(llm, p)
    kv = engine.scheduler.kv_cache
    tier = kv.host_tier
    assert len(tier) > 0
    gate = _gate(llm)
    engine.add_request("back", prompts[0], GREEDY)
    engine.step()
    assert tier.pinned
    kv.reset_prefix_cache()
    assert len(tier) == 0 and tier.orphans == set(tier.pinned)
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_released(llm)
    assert len(tier.free_slots) + len(tier) == tier.num_slots


def test_tier_book_keeping_and_events_carry_the_cpu_medium():
    """Pure HostTier: stores fill free slots then evict the LRU unpinned one, with CPU-medium
    events; a pinned slot is never taken; a re-stored hash costs no copy."""
    events = []
    tier = HostTier(2, 16, events.append)
    tier.store([(b"a", 0), (b"b", 1)])
    assert tier.take_stores() == [(0, 0), (1, 1)]
    assert events == [BlockStored([b"a", b"b"], None, [], 16, MEDIUM_CPU)]
    slots = tier.pin([b"a"])
    load = TierLoad("r", [(slots[0], 5)])
    events.clear()
    tier.store([(b"c", 2), (b"d", 3)])  # b (unpinned) goes; a is pinned; d finds no slot
    assert tier.take_stores() == [(2, 1)]
    assert events == [
        BlockRemoved([b"b"], MEDIUM_CPU),
        BlockStored([b"c"], None, [], 16, MEDIUM_CPU),
    ]
    tier.store([(b"c", 7)])
    assert tier.take_stores() == []  # already held
    assert tier.lookup([b"a", b"c", b"x"]) == 2
    tier.load_done(load)
    assert not tier.pinned
    assert tier.stats.stored_blocks == 3 and tier.stats.evicted_blocks == 1


def test_router_scores_host_tier_hits_below_device_hits():
    """A pod holding a prompt's blocks in its device pool beats one holding them in its host
    tier, which beats one holding nothing; tier events are indexed apart from the device's."""
    from pagefleet.router.prefix_index import HOST_TIER_WEIGHT, PrefixIndex
    from pagefleet.router.scoring import RoutingRequest, prefix_scorer

    hashes = [b"h0", b"h1", b"h2", b"h3"]
    index = PrefixIndex("precise")
    index.apply("device", [BlockStored(hashes, None, [], 16)])
    index.apply("mixed", [BlockStored(hashes[:2], None, [], 16)])
    index.apply("mixed", [BlockStored(hashes[2:], None, [], 16, MEDIUM_CPU)])
    index.apply("host", [BlockStored(hashes, None, [], 16, MEDIUM_CPU)])
    found = index.match(hashes, now=0.0)
    assert found == {"device": 4, "mixed": 2 + 2 * HOST_TIER_WEIGHT, "host": 4 * HOST_TIER_WEIGHT}

    class Pod:
        def __init__(self, name: str) -> None:
            self.name = name

    scores = prefix_scorer(
        RoutingRequest(model="m", block_hashes=hashes, prefix_matches=found),
        [Pod("device"), Pod("mixed"), Pod("host")],
    )
    assert scores["device"] > scores["mixed"] > scores["host"] > 0
    # Evicted from the tier: the host pod no longer matches; a device removal leaves the tier.
    index.apply("host", [BlockRemoved(hashes[:1], MEDIUM_CPU)])
    index.apply("mixed", [BlockRemoved(hashes[:1])])
    found = index.match(hashes, now=0.0)
    assert "host" not in found and "mixed" not in found  # the chain's first block is gone
    index.apply("mixed", [AllBlocksCleared()])
    index.apply("mixed", [BlockStored(hashes[:1], None, [], 16)])
    assert index.match(hashes, now=0.0)["mixed"] == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (dict(kv_offloading_backend="lmcache"), "lmcache is not built"),
        (dict(kv_offloading_size=-1.0), ">= 0"),
        # Caught NaN passing as "no tier" nowhere and Infinity passing the check, then
        # overflowing int() at start-up with a traceback.
        (dict(kv_offloading_size=float("nan")), "finite"),
        (dict(kv_offloading_size=float("inf")), "finite"),
        (dict(kv_offloading_size=1.0, tensor_parallel_size=2), "tensor parallelism"),
        (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "needs prefix caching"),
    ],
)
def test_unsupported_offloading_settings_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="m", **extra)


class _LandsBetweenLooks(concurrent.futures.Future):
    """A copy that is still running the first time it is asked and done ever after: the
    worker thread finishing it while `finished` looks through the loads in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        return self.looks > 1

    def result(self, timeout=None):
        return None


def test_a_load_that_lands_while_finished_looks_is_reported_not_lost():
    """Catches `finished` asking each load twice (once for the landed, once for the rest): a
    copy completing between the two looks was in neither list, so its request waited for its
    tier load forever and its slots stayed pinned."""
    import torch

    from pagefleet.engine.kv_cache.tier_copier import TierCopier, _InFlight

    copier = TierCopier(torch.zeros(1, 2, 1, 4, 16, 8), num_slots=2)
    landed, landing = TierLoad("a", [(0, 0)]), TierLoad("b", [(1, 1)])
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(None)
    copier.in_flight += [_InFlight(landed, done), _InFlight(landing, _LandsBetweenLooks())]
    reported = copier.finished() + copier.finished()
    assert reported == [landed, landing] and not copier.in_flight
    copier.close()


def test_a_tier_larger_than_host_memory_is_refused_before_allocating(tiny_checkpoints):
    """Catches --kv-offloading-size 1e6 (GiB) trying to allocate and zero a petabyte of host
    memory (an OOM kill, or pinned-allocation failure on CUDA, minutes into start-up) instead
    of saying the host does not have it."""
    with pytest.raises(ValueError, match="more than this host's memory"):
        LLM(tiny_checkpoints["llama"], kv_offloading_size=1e6, **ENGINE)


def test_serve_flags_reach_engine_args():
    from pagefleet.common.cli import build_parser
    from pagefleet.engine.server.serve import engine_args_from

    argv = ["serve", "m", "--kv-offloading-size", "2.5", "--kv-offloading-backend", "native"]
    args = engine_args_from(build_parser().parse_args(argv))
    assert (args.kv_offloading_size, args.kv_offloading_backend) == (2.5, "native")
    with pytest.raises(ValueError, match="lmcache is not built"):
        engine_args_from(
            build_parser().parse_args(["serve", "m", "--kv-offloading-backend", "lmcache"])
        )
