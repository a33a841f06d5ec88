"""Speculative decoding beyond one colocated engine: a P/D decode engine speculates on the KV
it pulled over NIXL (its greedy output equals a colocated engine's without speculation, drafts
accepted; the prefill engine ignores the flag and says so), a TP=2 engine speculates with every
rank running rank 0's verify rows (greedy equals TP=1 without speculation)."""

from __future__ import annotations

import json
from pathlib import Path

from test_pd import as_router, kv_flags, prefill_directly, pulls
from test_spec_decode import GREEDY, NGRAM, _prompts, _tokens

from pagefleet.engine import LLM, SamplingParams
from server_utils import FLEET_ENV, metric_value, running_server

# Repetitive, so the decode engine's n-gram drafts get accepted; 3 full blocks and a partial.
PD_PROMPT = [5, 6, 7, 8, 9, 10, 11] * 8 + [5, 6]
PD_MAX_TOKENS = 32
SPEC_FLAGS = ("--speculative-config", json.dumps(NGRAM))


def _decode_with_pulled_kv(decode: str, prompt: list[int], params: dict) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": PD_MAX_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "kv_transfer_params": params}
    r = as_router(decode, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_pd_decode_engine_speculates_on_pulled_kv_and_equals_colocated(tiny_checkpoints):
    """Fails for: a decode engine that refuses --speculative-config with --kv-transfer-config,
    drafts verified against a pulled prompt whose slots or computed count are off (the output
    changes), a decode engine that recomputes the prompt instead of pulling it (prompt tokens
    computed > 1), and a prefill engine that silently takes the flag (no log line)."""
    path = tiny_checkpoints["llama"]
    base = LLM(path, max_model_len=1024, dtype="float32")
    try:
        params = SamplingParams(temperature=0, max_tokens=PD_MAX_TOKENS, ignore_eos=True)
        expected = base.generate([list(PD_PROMPT)], params, use_tqdm=False)[0].outputs[0].text
    finally:
        base.engine.close()
    with (
        running_server(path, *kv_flags("nixl", "kv_producer"), *SPEC_FLAGS, env=FLEET_ENV) as (
            prefill,
            prefill_proc,
        ),
        running_server(path, *kv_flags("nixl", "kv_consumer"), *SPEC_FLAGS, env=FLEET_ENV) as (
            decode,
            decode_proc,
        ),
    ):
        kv_params = prefill_directly(prefill, PD_PROMPT)
        assert _decode_with_pulled_kv(decode, PD_PROMPT, kv_params) == expected
        assert pulls(decode, "nixl") == 1
        assert metric_value(decode, "pagefleet:kv_transfer_fallbacks_total") == 0
        # Only the prompt's last token is computed on the decode engine (for its logits).
        assert metric_value(decode, "vllm:prompt_tokens_total") == 1
        assert metric_value(decode, "vllm:spec_decode_num_drafts_total") > 0
        assert metric_value(decode, "vllm:spec_decode_num_accepted_tokens_total") > 0
        prefill_log = Path(prefill_proc.log_path).read_text(errors="replace")
        assert "Speculative decoding off: a prefill engine (kv_producer)" in prefill_log
        decode_log = Path(decode_proc.log_path).read_text(errors="replace")
        assert "Speculative decoding: ngram" in decode_log


def test_tp2_with_ngram_equals_tp1_without(tiny_checkpoints):
    """Rank 0 prepares the verify rows (1 + k single rows a request) and broadcasts them in the
    step body; the workers run them as given. Fails for: a step codec that drops or reorders
    verify rows (a worker's shard attends over other slots: the gathered logits change),
    a worker pool that misses the drafts' keys and values, and rejected slots reused out of
    step between ranks (the output changes on the next verification)."""
    path = tiny_checkpoints["llama"]
    prompts = _prompts()
    args = {
        "max_model_len": 256,
        "num_gpu_blocks_override": 64,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 8,
    }
    base = LLM(path, **args)
    try:
        reference = _tokens(base.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        base.engine.close()
    llm = LLM(path, tensor_parallel_size=2, speculative_config=NGRAM, **args)
    try:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
        engine = llm.engine
        assert engine.spec_counters.num_accepted_tokens > 0
        kv = engine.scheduler.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.engine.close()
