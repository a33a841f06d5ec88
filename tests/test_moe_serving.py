"""Mixture-of-experts models through the engine: greedy output equals HF transformers' in
float32 for Qwen3-MoE, Mixtral and Qwen3.5-MoE (hybrid layers, a shared expert) across chunked
prefill, preemption and prefix hits; TP=2 engines (experts split by columns; for Qwen3.5-MoE
also its linear-attention heads and shared expert) and `pagefleet serve --tensor-parallel-size 2
--enable-expert-parallel` (whole experts per rank, all-to-all dispatch) equal TP=1; P/D moves a
MoE model's KV and decodes the same text; the routing counters reach the engine's stats and
/metrics, one series per sparse layer."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from hf_reference import assert_greedy_equal
from pagefleet.engine import LLM, SamplingParams
from server_utils import FLEET_SECRET, free_port, running_server

START_TIMEOUT = 240  # two ranks load on a busy 2-core box
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 9 blocks of 16 for 4 requests of 41-52 tokens (2 blocks each at first, 3-4 by the end):
# preemption; 32 tokens a
# step: the longer prompts are chunked.
TIGHT = {
    "num_gpu_blocks_override": 9,
    "max_model_len": 140,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 32,
}
PROMPTS = [[(7 * i + 3 * n) % 500 + 5 for i in range(n)] for n in (30, 31, 29, 40)]
SHARED = list(range(300, 332))  # two full blocks: the second run is a full prefix hit
# Tokens the second run of SHARED finds cached. A hybrid recomputes the prompt's last token
# from a state snapshot, and snapshots sit at block boundaries: its hit stops at 16.
CACHED = {"qwen3_moe": 32, "mixtral": 32, "qwen3_5_moe": 16}


def check_all(path: str, prompts: list[list[int]], outputs) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, MAX_TOKENS)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _run_paths(llm: LLM, path: str | None) -> dict:
    """The prompts through a tight pool (chunked prefill and preemption), then SHARED twice
    (a prefix hit, the second time a full one); with `path`, each output checked against HF."""
    varied = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    preemptions = llm.engine.scheduler.num_preemptions
    first = llm.generate([SHARED], GREEDY, use_tqdm=False)
    again = llm.generate([SHARED], GREEDY, use_tqdm=False)
    if path is not None:
        check_all(path, PROMPTS, varied)
        check_all(path, [SHARED], again)
    return {
        "varied": _tokens(varied),
        "prefix": _tokens(first) + _tokens(again),
        "preemptions": preemptions,
        "cached": again[0].num_cached_tokens,
    }


@pytest.fixture(scope="module")
def tp1_runs(moe_checkpoints) -> Callable[[str], dict]:
    """A case's run at TP=1 through every scheduling path, checked against HF (the comparisons
    below reuse its tokens); made on first use, once per case, so a case that diverges fails
    its own tests only."""

    @functools.cache
    def run(case: str) -> dict:
        path = moe_checkpoints[case]
        llm = LLM(path, **TIGHT)
        try:
            return {**_run_paths(llm, path), "expert_load": llm.engine.stats().expert_load}
        finally:
            llm.engine.close()

    return run


@pytest.mark.parametrize("case", list(CACHED))
def test_greedy_equals_hf_through_chunking_preemption_and_prefix_hits(tp1_runs, case):
    """`_run_paths` compared every output with HF's; here, that the paths were taken and the
    router's counts reached the engine's stats: every computed token was routed to top-k
    experts in every sparse layer."""
    run = tp1_runs(case)
    assert run["preemptions"] > 0, "the pool did not force preemption"
    assert run["cached"] == CACHED[case], "the second run of the prompt was not a prefix hit"
    load = run["expert_load"]
    assert load is not None and len({layer.routed for layer in load.layers}) == 1
    assert load.layers[0].routed % 2 == 0 and load.layers[0].routed > 0


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_5_moe"])
def test_tp2_splits_every_expert_and_equals_tp1(moe_checkpoints, tp1_runs, case):
    """Qwen3.5-MoE's ranks also split its shared expert and its linear-attention heads (and
    carry one state slot per sequence each) through the same chunks, preemption and hit."""
    path = moe_checkpoints[case]
    llm = LLM(path, tensor_parallel_size=2, **TIGHT)
    try:
        block = llm.engine.runner.model.layers[0].mlp
        assert block.experts.shard.count == 5 and block.experts.columns == 12  # 24 over 2
        if case == "qwen3_5_moe":
            assert block.shared_expert.columns == 10  # of 20
            assert llm.engine.runner.state_pool.shape.num_heads == 2  # of 4 value heads
        two = _run_paths(llm, None)
    finally:
        llm.engine.close()
    one = tp1_runs(case)
    assert two["varied"] == one["varied"] and two["prefix"] == one["prefix"]


def test_serve_expert_parallel_equals_tp1_and_reports_expert_load(moe_checkpoints, tp1_runs):
    """`pagefleet serve --tensor-parallel-size 2 --enable-expert-parallel --all2all-backend
    alltoall`: rank 0 holds experts 0-2 and rank 1 experts 3-4 of each layer; the completion
    equals TP=1's greedy text; /metrics has the load per sparse layer and per rank."""
    path = moe_checkpoints["qwen3_moe"]
    flags = ("--tensor-parallel-size", "2", "--enable-expert-parallel")
    flags += ("--all2all-backend", "alltoall")
    with running_server(path, *flags, timeout=START_TIMEOUT) as (base, proc):
        body = {"model": "tiny", "prompt": SHARED, "temperature": 0, "ignore_eos": True}
        body["max_tokens"] = MAX_TOKENS
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        log = Path(proc.log_path).read_text(errors="replace")
    assert "rank 0: whole experts per rank (expert parallel, --all2all-backend alltoall): " in log
    assert "experts 0-2 of 5" in log
    tokenizer = AutoTokenizer.from_pretrained(path)
    expected = tokenizer.decode(tp1_runs("qwen3_moe")["prefix"][0], skip_special_tokens=True)
    assert r.json()["choices"][0]["text"] == expected
    routed = _samples(metrics, "pagefleet:moe_routed_tokens_total")
    # The prompt's tokens and 11 decode steps, each routed to 2 experts in layers 0 and 2.
    assigned = 2 * (len(SHARED) + MAX_TOKENS - 1)
    assert routed == {"0": assigned, "2": assigned}
    mean = {"0": assigned / 5, "2": assigned / 5}
    assert _samples(metrics, "pagefleet:moe_expert_load_mean") == mean
    for layer, busiest in _samples(metrics, "pagefleet:moe_rank_load_max").items():
        assert assigned / 2 <= busiest <= assigned
        assert busiest >= _samples(metrics, "pagefleet:moe_expert_load_max")[layer]


def _samples(text: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["layer"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_pd_moves_a_moe_models_kv_and_decodes_the_same_text(moe_checkpoints, monkeypatch):
    """In-process P/D over the TCP connector: the decode engine pulls the prompt's blocks and
    computes only its last token; the text equals a colocated engine's (and HF's)."""
    monkeypatch.setenv("PAGEFLEET_FLEET_SECRET", FLEET_SECRET)
    path = moe_checkpoints["mixtral"]

    def engine(role: str) -> LLM:
        config = {"kv_connector": "tcp", "kv_role": role, "kv_port": free_port()}
        return LLM(
            path,
            max_model_len=256,
            num_gpu_blocks_override=64,
            kv_transfer_config=json.dumps({**config, "kv_ip": "127.0.0.1"}),
        )

    prompt = list(range(10, 60))
    prefill, decode = engine("kv_producer"), engine("kv_consumer")
    try:
        hold = dataclasses.replace(
            GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        (first,) = prefill.generate([prompt], hold, use_tqdm=False)
        pull = dataclasses.replace(GREEDY, kv_transfer_params=first.kv_transfer_params)
        (out,) = decode.generate([prompt], pull, use_tqdm=False)
        assert decode.engine.connector.stats.transfers == 1
        assert decode.engine.connector.stats.failures == 0
        # Only the last prompt token went through the decode engine's routers.
        assert decode.engine.stats().expert_load.layers[0].routed == 2 * GREEDY.max_tokens
    finally:
        prefill.engine.close()
        decode.engine.close()
    check_all(path, [prompt], [out])
