"""`n > 1` against HF transformers. Token-for-token comparison with HF's sampling is not
possible: HF draws with `torch.multinomial` from the global generator, we draw with an
exponential race from a per-sample generator, so the same seed gives different tokens. What is
comparable is checked instead: the distribution of the n samples' first token against HF's
processed next-token distribution, each sample's logprobs against HF's log-softmax along that
sample's own tokens, and vLLM's seeding rule (sample i of a request seeded s draws as a single
request seeded s + i)."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampling_oracle import assert_fits
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from hf_reference import hf_logprobs
from pagefleet.engine import LLM, SamplingParams

PROMPT = [11, 42, 7, 300, 255, 18, 99, 4, 61, 77, 123, 5, 250, 190, 33, 64, 17]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], num_gpu_blocks_override=512, max_model_len=256)


def test_first_tokens_of_n_samples_follow_hf_distribution(llm, tiny_checkpoints):
    """2000 samples (8 requests of n=250) against softmax(top_k(logits / T)) of HF's logits.
    Fails for: siblings drawing the same noise (all n alike), siblings sampled from another
    row's logits, temperature or top-k ignored."""
    temperature, top_k = 0.8, 12
    params = SamplingParams(n=250, temperature=temperature, top_k=top_k, max_tokens=1)
    outs = llm.generate([PROMPT] * 8, params, use_tqdm=False)
    tokens = [c.token_ids[0] for out in outs for c in out.outputs]
    logits = hf_logprobs(tiny_checkpoints["llama"], PROMPT)[-1:]  # log-softmax: same ranking
    ids = torch.tensor([PROMPT])
    processed = TopKLogitsWarper(top_k)(ids, TemperatureLogitsWarper(temperature)(ids, logits))
    expected = torch.softmax(processed[0], dim=-1)
    counts = torch.bincount(torch.tensor(tokens), minlength=expected.numel())
    assert_fits(counts, expected)


def test_each_sample_logprobs_equal_hf_along_its_own_tokens(llm, tiny_checkpoints):
    """The n samples share the prompt's blocks and then diverge. Fails for: a sibling writing
    into a shared block, a sibling reading another's KV, logprobs of the wrong row."""
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=10, logprobs=0, ignore_eos=True
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "the samples did not diverge"
    for c in out.outputs:
        ref = hf_logprobs(tiny_checkpoints["llama"], PROMPT + c.token_ids)
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            assert math.isclose(
                entry[token].logprob, ref[len(PROMPT) - 1 + i, token].item(), abs_tol=1e-4
            ), (c.index, i)


def test_sample_i_draws_as_a_single_request_seeded_seed_plus_i(llm):
    """vLLM seeds sample i of a request seeded s with s + i. Fails for: all samples on seed s
    (identical samples), or seeds that depend on the batch."""
    common = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 12, "ignore_eos": True}
    together = llm.generate([PROMPT], SamplingParams(n=3, seed=11, **common), use_tqdm=False)
    alone = [
        llm.generate([PROMPT], SamplingParams(seed=11 + i, **common), use_tqdm=False)[0]
        for i in range(3)
    ]
    assert [c.token_ids for c in together[0].outputs] == [a.outputs[0].token_ids for a in alone]
