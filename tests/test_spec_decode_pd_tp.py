"""Speculative decoding beyond one colocated engine: a P/D decode engine speculates on the KV
it pulled over NIXL (its greedy output equals a colocated engine's without speculation, drafts
accepted; the prefill engine ignores the flag and says so), a TP=2 engine speculates with every
rank running rank 0's verify rows (greedy equals TP=1 without speculation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_pd import decode_directly, kv_flags, prefill_directly, pulls
from test_spec_decode import GREEDY, NGRAM, _prompts, _tokens

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.distributed.step_codec import decode_step, encode_step
from server_utils import FLEET_ENV, metric_value, running_server

# Repetitive, so the decode engine's n-gram drafts get accepted; 3 full blocks and a partial.
PD_PROMPT = [5, 6, 7, 8, 9, 10, 11] * 8 + [5, 6]
PD_MAX_TOKENS = 32
DRAFT = {"method": "draft_model", "num_speculative_tokens": 4}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_pd_decode_engine_speculates_on_pulled_kv_and_equals_colocated(tiny_checkpoints, method):
    """Fails for: a decode engine that refuses --speculative-config with --kv-transfer-config,
    drafts verified against a pulled prompt whose slots or computed count are off (the output
    changes), a decode engine that recomputes the prompt instead of pulling it (prompt tokens
    computed > 1), and a prefill engine that silently takes the flag (no log line). The draft
    model (the target itself here, so its drafts are accepted) computes its own KV of the
    pulled prompt on the decode engine: the target's prompt is still not recomputed."""
    path = tiny_checkpoints["llama"]
    config = NGRAM if method == "ngram" else {**DRAFT, "model": path}
    spec_flags = ("--speculative-config", json.dumps(config))
    base = LLM(path, max_model_len=1024, dtype="float32")
    try:
        params = SamplingParams(temperature=0, max_tokens=PD_MAX_TOKENS, ignore_eos=True)
        expected = base.generate([list(PD_PROMPT)], params, use_tqdm=False)[0].outputs[0].text
    finally:
        base.engine.close()
    with (
        running_server(path, *kv_flags("nixl", "kv_producer"), *spec_flags, env=FLEET_ENV) as (
            prefill,
            prefill_proc,
        ),
        running_server(path, *kv_flags("nixl", "kv_consumer"), *spec_flags, env=FLEET_ENV) as (
            decode,
            decode_proc,
        ),
    ):
        kv_params = prefill_directly(prefill, PD_PROMPT)
        assert decode_directly(decode, PD_PROMPT, kv_params, PD_MAX_TOKENS) == expected
        assert pulls(decode, "nixl") == 1
        assert metric_value(decode, "pagefleet:kv_transfer_fallbacks_total") == 0
        # Only the prompt's last token is computed on the decode engine (for its logits).
        assert metric_value(decode, "vllm:prompt_tokens_total") == 1
        assert metric_value(decode, "vllm:spec_decode_num_drafts_total") > 0
        assert metric_value(decode, "vllm:spec_decode_num_accepted_tokens_total") > 0
        prefill_log = Path(prefill_proc.log_path).read_text(errors="replace")
        assert "Speculative decoding off: a prefill engine (kv_producer)" in prefill_log
        decode_log = Path(decode_proc.log_path).read_text(errors="replace")
        assert f"Speculative decoding: {method}" in decode_log


TP_PATHS = {
    "chunked-prefill": {"num_gpu_blocks_override": 64, "max_num_batched_tokens": 32},
    # 9 blocks of 16 for 4 requests of up to 48 tokens (3 blocks each): preemption.
    "tight-pool-preemption": {
        "num_gpu_blocks_override": 9,
        "max_num_batched_tokens": 32,
        "max_model_len": 140,
    },
}


@pytest.mark.parametrize("name", list(TP_PATHS))
def test_tp2_with_ngram_equals_tp1_without(tiny_checkpoints, name):
    """Rank 0 prepares the verify rows (1 + k single rows a request) and broadcasts them in the
    step body; the workers run them as given. Fails for: a step codec that drops or reorders
    verify rows (a worker's shard attends over other slots: the gathered logits change),
    a worker pool that misses the drafts' keys and values, and rejected slots reused out of
    step between ranks (the output changes on the next verification)."""
    path = tiny_checkpoints["llama"]
    prompts = _prompts()
    args = {"max_model_len": 256, "max_num_seqs": 8} | TP_PATHS[name]
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
        if name == "tight-pool-preemption":
            assert engine.scheduler.num_preemptions > 0, "the pool did not force preemption"
        kv = engine.scheduler.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.engine.close()


def test_verify_rows_cross_the_step_broadcast_unchanged(tiny_checkpoints):
    """Workers never see the drafts as such: rank 0's prepared step carries a verifying
    request as 1 + k single rows (its last token, then the drafts, at consecutive positions
    and slots) and 1 + k logit rows, and the body a worker decodes holds exactly those.
    Fails for: a codec that truncates single rows to one a request, or drops logit rows."""
    llm = LLM(tiny_checkpoints["llama"], max_model_len=256, speculative_config=NGRAM)
    engine = llm.engine
    try:
        engine.add_request("r", list(PD_PROMPT), SamplingParams(temperature=0, max_tokens=16))
        for _ in range(4):
            engine.step()
            req = engine.scheduler.running[0]
            if req.spec_token_ids:
                break
        assert req.spec_token_ids, "the n-gram proposer proposed nothing"
        out = engine.scheduler.schedule()
        drafts = out.spec_token_ids[req.request_id]
        inputs = engine.runner.prepare(out)
        start = req.num_computed_tokens
        assert inputs.input_ids.tolist() == [req.all_token_ids[start], *drafts]
        assert inputs.positions.tolist() == list(range(start, start + 1 + len(drafts)))
        assert len(inputs.sample_rows) == 1 + len(drafts)
        head, body = encode_step(
            inputs.input_ids, inputs.positions, inputs.meta, list(inputs.sample_rows)
        )
        ids, positions, meta, logit_rows = decode_step(body, head.tolist()[2], 16)
        assert torch.equal(ids, inputs.input_ids) and torch.equal(positions, inputs.positions)
        assert torch.equal(meta.slot_mapping, inputs.meta.slot_mapping)
        assert meta.num_single == inputs.meta.num_single == 1 + len(drafts)
        assert logit_rows.tolist() == list(inputs.sample_rows)
        for a, b in zip(meta.single_groups, inputs.meta.single_groups, strict=True):
            assert torch.equal(a.block_tables, b.block_tables) and torch.equal(a.mask, b.mask)
    finally:
        engine.close()


# ------------------------------------------------------------- lossless sampling, engine level

# A constant prompt on a tied-embedding checkpoint with small weights: every position sees the
# same context, the repeated token is the most likely of the top 4 (~0.27, the others ~0.24),
# and after it the n-gram proposer drafts it again. The first generated token is sampled
# plainly (no drafts exist at prefill); given it is REPEAT, tokens 2 and 3 are drafted
# positions (token 3 when token 2 was the accepted draft), each accepted about a quarter of
# the time.
REPEAT = 7
SAMPLE_PROMPT = [REPEAT] * 16
TOP_K = 4
NUM_SAMPLES = 2000
# Chi-square critical value for 3 degrees of freedom (4 tokens) at p = 0.001 (tables).
CHI2_DF3_P001 = 16.27
SPEC_NGRAM_1 = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}


def _echo_checkpoint(root: Path) -> str:
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    path = root / "echo"
    return str(write_tiny_checkpoint(path, tie_word_embeddings=True, initializer_range=0.02))


def _target_top_k(path: str, prefixes: list[list[int]]) -> list[dict[int, float]]:
    """The target's exact next-token distribution after each prefix under top-k = TOP_K at
    temperature 1 (its raw top-k probabilities renormalised), from an engine that does not
    speculate."""
    llm = LLM(path, max_model_len=256, num_gpu_blocks_override=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_K)
        outs = llm.generate([list(p) for p in prefixes], params, use_tqdm=False)
    finally:
        llm.engine.close()
    dists = []
    for out in outs:
        top = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].rank)[:TOP_K]
        weights = {token: float(torch.tensor(lp.logprob).exp()) for token, lp in top}
        total = sum(weights.values())
        dists.append({token: w / total for token, w in weights.items()})
    return dists


def _chi_square(counts: dict[int, int], probs: dict[int, float]) -> float:
    total = sum(counts.values())
    stray = set(counts) - set(probs)
    assert not stray, f"tokens outside the target's top {TOP_K}: {stray}"
    return sum((counts.get(t, 0) - p * total) ** 2 / (p * total) for t, p in probs.items())


def _drafted_counts(llm: LLM) -> tuple[dict[int, int], dict[int, int]]:
    """Counts of token 2 given token 1 was REPEAT, and of token 3 given tokens 1 and 2 were."""
    # Four tokens: room for two drafts after token 1 (tokens 2 and 3), and a bonus token.
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=4, ignore_eos=True)
    outs = llm.generate([list(SAMPLE_PROMPT)] * NUM_SAMPLES, params, use_tqdm=False)
    second: dict[int, int] = {}
    third: dict[int, int] = {}
    for out in outs:
        t1, t2, t3 = out.outputs[0].token_ids[:3]
        if t1 == REPEAT:
            second[t2] = second.get(t2, 0) + 1
            if t2 == REPEAT:
                third[t3] = third.get(t3, 0) + 1
    return second, third


def _accept_always(probs, drafts, generator):
    """A wrong rule: keep every draft, then draw the bonus token from the last row."""
    bonus = torch.multinomial(probs[len(drafts)], 1, generator=generator)
    return [*drafts, int(bonus.item())]


def test_sampled_tokens_at_drafted_positions_follow_the_targets_distribution(tmp_path, monkeypatch):
    """Through the engine (scheduler, verify rows, top-k, the rejection sampler): the tokens
    at drafted positions match the target's top-k distribution within a chi-square bound at
    p = 0.001; the same test fails for an engine that accepts every draft. Fails for: a
    rejection rule that keeps drafts too often or too rarely, a residual that does not remove
    the draft's mass, probabilities taken before top-k/temperature, and verify rows whose
    logits belong to another position."""
    path = _echo_checkpoint(tmp_path)
    after_one, after_two = _target_top_k(
        path, [[*SAMPLE_PROMPT, REPEAT], [*SAMPLE_PROMPT, REPEAT, REPEAT]]
    )
    # The drafts (REPEAT) are among the target's top k: both branches of the rule run.
    assert REPEAT in after_one and REPEAT in after_two
    llm = LLM(path, max_model_len=256, speculative_config=SPEC_NGRAM_1)
    try:
        second, third = _drafted_counts(llm)
        counters = llm.engine.spec_counters
        # Every request whose first token was REPEAT verified two drafts (tokens 2 and 3).
        assert counters.num_drafts >= sum(second.values()) > 400
        assert counters.num_draft_tokens >= 2 * sum(second.values())
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        assert sum(third.values()) > 100
        assert _chi_square(second, after_one) < CHI2_DF3_P001
        assert _chi_square(third, after_two) < CHI2_DF3_P001

        monkeypatch.setattr(
            "pagefleet.engine.spec_decode.verifier.rejection_sample", _accept_always
        )
        wrong_second, _ = _drafted_counts(llm)
        assert _chi_square(wrong_second, after_one) > CHI2_DF3_P001
    finally:
        llm.engine.close()
