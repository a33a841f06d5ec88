"""Simulated engines: the real scheduler and cache under a step-time model, filler tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from pagefleet.block_hash import hash_blocks
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.scheduler import SchedulerOutput
from pagefleet.engine.simulated import FIRST_FILLER_TOKEN, SimulatedRunner, SimulationProfile
from pagefleet.kv_events import BlockStored
from server_utils import metric_value, running_server, wait_until

FAST = SimulationProfile(speedup=1000.0)


def test_time_model_charges_prefill_decode_and_kv_reads():
    slept = []
    runner = SimulatedRunner(SimulationProfile(), vocab_size=512, sleep=slept.append)
    from conftest import make_request

    prompt = make_request("p", list(range(1, 33)), block_size=16)
    decode = make_request("d", list(range(1, 11)), block_size=16)
    decode.num_computed_tokens = 10
    decode.all_token_ids.append(99)  # one sampled token waiting to be fed back
    logits, sampled, _ = runner.execute(SchedulerOutput([(prompt, 32), (decode, 1)], [], 33))
    p = SimulationProfile()
    expected = (
        p.step_overhead_s
        + 32 * p.prefill_s_per_token
        + p.decode_s_per_seq
        + (11 * p.decode_s_per_kv_token)
    )
    assert slept == [pytest.approx(expected)]
    assert sampled == [prompt, decode] and logits.shape == (2, 512)
    assert all(int(t) >= FIRST_FILLER_TOKEN for t in logits.argmax(dim=1))


def test_simulated_llm_is_deterministic_and_uses_the_prefix_cache(tiny_checkpoints):
    llm = LLM(
        tiny_checkpoints["llama"], simulate=FAST, max_model_len=256, num_gpu_blocks_override=64
    )
    prompt = list(range(10, 58))  # three full blocks
    params = SamplingParams(temperature=0.7, max_tokens=12)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    batch = llm.generate([[1, 2, 3], prompt], params, use_tqdm=False)
    assert len(alone.token_ids) == 12 and alone.finish_reason == "length"
    assert llm.engine.scheduler.kv_cache.prefix_cache_hits >= 48  # the second run hit
    assert batch[1].num_cached_tokens == 48
    assert len(batch[1].outputs[0].token_ids) == 12
    assert llm.engine.runner.simulated_seconds > 0


def test_simulated_server_serves_metrics_and_kv_events(tiny_checkpoints):
    from pagefleet.router.kv_subscriber import KVEventSubscriber
    from pagefleet.router.prefix_index import PrefixIndex
    from server_utils import free_port

    port = free_port()
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"})
    flags = ("--simulate", "--simulate-profile", '{"speedup": 100}', "--kv-events-config", events)
    with running_server(tiny_checkpoints["llama"], *flags) as (base, _):
        index = PrefixIndex("precise")
        seen = []
        sub = KVEventSubscriber(
            "sim",
            f"tcp://127.0.0.1:{port}",
            lambda pod, evs: (seen.extend(evs), index.apply(pod, evs)),
            index.remove_pod,
        ).start()
        try:
            body = {"prompt": list(range(10, 74)), "max_tokens": 8}
            for _ in range(2):
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
            assert metric_value(base, "vllm:prefix_cache_hits_total") >= 64
            # The SUB socket may join after those events went out (PUB drops them): new
            # prompts until one's four blocks reach the index, rather than a sleep and hope.
            sent: list[list[int]] = []

            def indexed() -> bool:
                prompt = [100 + len(sent), *range(10, 73)]  # a new first token, a new chain
                assert httpx.post(f"{base}/v1/completions", json={**body, "prompt": prompt})
                sent.append(prompt)
                return any(index.match(hash_blocks(p, 16), now=0).get("sim", 0) == 4 for p in sent)

            wait_until(indexed, 10, "the engine's KV events to reach the index")
            assert any(isinstance(e, BlockStored) for e in seen)
        finally:
            sub.stop()


def test_bad_simulation_profiles_are_refused():
    with pytest.raises(ValueError, match="unknown keys"):
        SimulationProfile.load('{"warp": 9}')
    with pytest.raises(ValueError, match="speedup > 0"):
        SimulationProfile.load('{"speedup": 0}')
