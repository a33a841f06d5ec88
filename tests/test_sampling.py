"""Sampling features end to end on a tiny checkpoint: seeds, stops, n > 1, logprobs, penalties."""

from __future__ import annotations

import math

import pytest
import torch

from hf_reference import hf_logprobs
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.request import Request
from pagefleet.engine.sampler import apply_penalties

PROMPT = [11, 42, 7, 300, 255, 18, 99, 4, 61, 77, 123, 5, 250, 190, 33, 64, 17]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], num_gpu_blocks_override=256, max_model_len=256)


def _greedy(llm, prompt=PROMPT, **kw) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 16), **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(llm):
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=100, seed=1234, max_tokens=20, ignore_eos=True
    )
    alone = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [[5, 6, 7] * k for k in range(1, 9)]
    batch = [*others[:4], PROMPT, *others[4:]]
    params = (
        [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 4
        + [seeded]
        + [SamplingParams(temperature=0, max_tokens=7)] * 4
    )
    in_batch = llm.generate(batch, params, use_tqdm=False)[4].outputs[0].token_ids
    assert in_batch == alone
    other_seed = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=100, seed=99, max_tokens=20, ignore_eos=True
    )
    assert llm.generate([PROMPT], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_degenerate_sampling_settings_equal_greedy(llm):
    greedy = _greedy(llm, ignore_eos=True)
    for params in (
        {"top_k": 1},
        {"top_p": 1e-6},
        {"min_p": 1.0},
    ):
        sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3, **params)
        assert llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids == greedy


def test_stop_strings_cut_the_text_and_free_the_blocks(llm):
    full = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text[: text.index(stop)]
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (cut, "stop", stop)
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(
        [PROMPT],
        SamplingParams(
            temperature=0,
            max_tokens=40,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == cut + stop
    kv = llm.engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_stop_token_ids_finish_with_the_token_as_reason(llm):
    greedy = _greedy(llm, ignore_eos=True)
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[greedy[3]]),
        use_tqdm=False,
    )[0].outputs[0]
    first = greedy.index(greedy[3])
    assert out.token_ids == greedy[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", greedy[3])


def test_min_tokens_masks_stop_tokens(llm):
    greedy = _greedy(llm, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[greedy[0]])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert greedy[0] not in out.token_ids[:3]
    assert len(out.token_ids) >= 3


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = list(range(100, 148))  # three full blocks
    kv = llm.engine.scheduler.kv_cache
    hits = kv.prefix_cache_hits
    out = llm.generate(
        [prompt],
        SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "seeds differ per sample"
    # The two siblings found all three blocks cached: 2 x 48 tokens.
    assert kv.prefix_cache_hits - hits >= 2 * 48
    same = llm.generate(
        [prompt], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    assert same.outputs[0].token_ids == same.outputs[1].token_ids


def test_logprobs_match_hf_log_softmax(llm, tiny_checkpoints):
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    ref = hf_logprobs(tiny_checkpoints["llama"], PROMPT + out.token_ids)
    total = 0.0
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]
        assert entry[token].rank == 1  # greedy picks the top token
        top3 = row.topk(3)
        assert set(entry) == set(top3.indices.tolist())
        for tok, lp in entry.items():
            assert math.isclose(lp.logprob, row[tok].item(), abs_tol=1e-4)
        total += entry[token].logprob
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-5)


def test_prompt_logprobs_match_hf(llm, tiny_checkpoints):
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    ref = hf_logprobs(tiny_checkpoints["llama"], PROMPT)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        assert math.isclose(
            entry[PROMPT[pos]].logprob, ref[pos - 1, PROMPT[pos]].item(), abs_tol=1e-4
        )


def test_penalties_follow_the_openai_rules():
    req = Request(
        "r",
        [1, 2],
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
    )
    for t in (3, 3, 4):
        req.all_token_ids.append(t)
    row = torch.tensor([1.0, 2.0, -2.0, 4.0, 3.0, 5.0])
    apply_penalties(row, req)
    # token 1, 2: prompt -> repetition only; 3: output x2; 4: output x1; 0 and 5 untouched.
    expected = [1.0, 1.0, -4.0, 4.0 / 2 - 0.25 * 2 - 0.5, 3.0 / 2 - 0.25 - 0.5, 5.0]
    assert torch.allclose(row, torch.tensor(expected))


def test_repetition_penalty_changes_a_repetitive_greedy_output(llm):
    plain = _greedy(llm, max_tokens=32, ignore_eos=True)
    penalised = _greedy(llm, max_tokens=32, ignore_eos=True, repetition_penalty=3.0)
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"stop": [""]}, "stop strings"),
    ],
)
def test_invalid_sampling_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_wait_for_min_tokens(llm):
    greedy = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop = greedy.text[1:3]
    early = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    late = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], min_tokens=10),
        use_tqdm=False,
    )[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 10
    assert len(late.token_ids) >= 10


def test_stop_token_text_is_left_out_unless_asked(llm):
    greedy = _greedy(llm, ignore_eos=True)
    tok = llm.get_tokenizer()
    params = dict(temperature=0, max_tokens=16, stop_token_ids=[greedy[2]])
    out = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == greedy[2]
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=True)
    kept = llm.generate(
        [PROMPT], SamplingParams(**params, include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=True)


def test_stop_string_on_the_last_allowed_token_is_a_stop(llm):
    greedy = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    first = llm.get_tokenizer().decode(greedy.token_ids[:1])
    stop = greedy.text[len(first) :][:1]
    assert stop
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_too_many_logprobs_are_refused(llm):
    with pytest.raises(ValueError, match="maximum, 20"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
