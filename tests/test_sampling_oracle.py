"""The sampler against an independent oracle: for a fixed logits vector, HF transformers' logits
processors (repetition penalty, temperature, top-k, top-p, min-p; presence and frequency
penalties as vLLM and OpenAI define them) give the distribution a token must be drawn from.
Our sampler's draws over many rows must fit it (chi-square goodness of fit), never hit a token
the oracle excludes, and return the logprobs vLLM returns: the log-softmax of the raw logits.

Each test names the mutations of `engine/sampler.py` it was seen to catch (applied by hand once,
and by `make mutate`).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagefleet.engine.request import Request
from pagefleet.engine.sampler import Sampler
from pagefleet.engine.sampling_params import SamplingParams

# 16 tokens with distinct, unevenly spread logits: some negative (repetition penalty multiplies
# those), a clear favourite, and a long tail that top-k/top-p/min-p cut at different places.
LOGITS = torch.tensor(
    [2.1, 1.7, 1.2, 0.9, 0.4, 0.1, -0.3, -0.8, 1.5, 0.6, -1.5, -0.1, 0.25, -2.0, 1.0, -0.5]
)
PROMPT = [3, 7, 7, 12]  # token 7 has a negative logit, 3 and 12 positive ones
OUTPUT = [1, 1, 1, 4, 9, 7]  # token 1 three times: frequency differs from presence
DRAWS = 20_000
# A correct sampler fails this with probability 1e-5 for a given generator seed; the seed is
# fixed, so the test is deterministic. Every mutation listed below gives p-values < 1e-30.
P_VALUE_FLOOR = 1e-5


def oracle(params: SamplingParams, prompt=PROMPT, output=OUTPUT) -> torch.Tensor:
    """The distribution HF's processors give, penalties first, in HF's warper order."""
    scores = LOGITS.clone().unsqueeze(0)
    ids = torch.tensor([prompt + output])
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    # Presence and frequency penalties are not HF processors; vLLM and OpenAI define them over
    # the generated tokens only: logit -= frequency * count + presence * (count > 0).
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=LOGITS.numel())
    scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    return torch.softmax(scores[0], dim=-1)


def make_request(params: SamplingParams, rid: str = "r", prompt=PROMPT, output=OUTPUT) -> Request:
    req = Request(rid, prompt, params, eos_token_id=None)
    req.all_token_ids.extend(output)
    return req


def draw(params: SamplingParams, n: int = DRAWS, seed: int = 0, **request_kw) -> torch.Tensor:
    """Counts per token of `n` rows sampled in one batch (one shared request)."""
    req = make_request(params, **request_kw)
    out = Sampler(seed=seed).sample(LOGITS.repeat(n, 1), [req] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=LOGITS.numel())


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's goodness of fit over the oracle's support (its upper tail probability)."""
    support = expected_probs > 0
    observed = counts[support].double()
    expected = expected_probs[support].double() * counts.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0).item()


def assert_fits(counts: torch.Tensor, expected: torch.Tensor) -> None:
    outside = counts[expected == 0]
    assert outside.sum() == 0, f"drew tokens the oracle excludes: {outside.tolist()}"
    p = chi_square_p_value(counts, expected)
    assert p > P_VALUE_FLOOR, (
        f"draws do not fit the oracle (p={p:.2e}):\n"
        f"  observed {(counts / counts.sum()).tolist()}\n  expected {expected.tolist()}"
    )


CASES = {
    # mutations caught: temperature ignored; temperature multiplied instead of divided
    "temperature 0.6": SamplingParams(temperature=0.6),
    "temperature 1.7": SamplingParams(temperature=1.7),
    # top-k off by one (k-th logit excluded or (k+1)-th kept); top-k applied before temperature
    # makes no difference, but top-k ignored or applied to the wrong row does
    "top_k 5": SamplingParams(temperature=0.9, top_k=5),
    # top-p keeping the token that crosses the mass (or not), cumulative mass including the
    # token itself, top-p ignored
    "top_p 0.7": SamplingParams(temperature=1.0, top_p=0.7),
    "top_p 0.35 at temperature 0.5": SamplingParams(temperature=0.5, top_p=0.35),
    # min-p not scaled by the top probability; `<` turned into `<=`; min-p ignored
    "min_p 0.2": SamplingParams(temperature=1.0, min_p=0.2),
    "top_k and top_p and min_p": SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.1),
    # repetition penalty: prompt tokens not penalised, negative logits divided, penalty ignored
    "repetition 1.8": SamplingParams(temperature=1.0, repetition_penalty=1.8),
    "repetition 0.7 (a reward)": SamplingParams(temperature=1.0, repetition_penalty=0.7),
    # frequency used as presence or the other way round; prompt tokens counted; sign flipped
    "frequency 0.8": SamplingParams(temperature=1.0, frequency_penalty=0.8),
    "presence 1.1": SamplingParams(temperature=1.0, presence_penalty=1.1),
    "presence -0.9 (a reward)": SamplingParams(temperature=1.0, presence_penalty=-0.9),
    "every penalty with top_p": SamplingParams(
        temperature=0.7,
        top_p=0.95,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
    ),
}


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_draws_fit_hf_processors(params):
    """Fails for: temperature ignored, top-k/top-p/min-p off by one or ignored, penalties on the
    wrong tokens, and an exponential race drawn with uniform noise (argmax p/U is biased)."""
    assert_fits(draw(params), oracle(params))


def test_the_test_rejects_a_sampler_that_ignores_temperature():
    """The bound is tight enough: T=1 draws do not pass for T=0.6 (the audit's mutation)."""
    counts = draw(SamplingParams(temperature=1.0))
    assert chi_square_p_value(counts, oracle(SamplingParams(temperature=0.6))) < 1e-30
    assert chi_square_p_value(counts, oracle(SamplingParams(temperature=1.0))) > P_VALUE_FLOOR


def test_seeded_rows_fit_the_oracle_and_ignore_the_batch():
    """Many requests with their own seeds (one row each) draw from the same distribution, and a
    seeded row's token does not depend on the rows beside it. Fails for: seeded rows drawing
    from the shared generator's stream; a per-request generator re-seeded at every step."""
    params = SamplingParams(temperature=0.8, top_k=10)
    n = 6000
    requests = [make_request(dataclasses.replace(params, seed=s), f"s{s}") for s in range(n)]
    sampler = Sampler(seed=0)
    tokens = sampler.sample(LOGITS.repeat(n, 1), requests).token_ids
    assert_fits(torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()), oracle(params))
    # The same seeds in another sampler, batched with other rows in a different order: same
    # tokens. A second step of each request continues its own stream instead of repeating.
    other = Sampler(seed=123)
    unseeded = make_request(SamplingParams(temperature=1.0), "u")
    batch = [unseeded, *requests[:50][::-1]]
    again = other.sample(LOGITS.repeat(51, 1), batch).token_ids[1:][::-1]
    assert again == tokens[:50]
    second = [other.sample(LOGITS.unsqueeze(0), [r]).token_ids[0] for r in requests[:50]]
    assert second != tokens[:50]


def test_min_tokens_masks_stop_tokens_and_keeps_the_rest_in_proportion():
    """Below min_tokens, stop tokens (EOS included) cannot be drawn; the other tokens keep
    their relative odds. At min_tokens, they can be drawn again. Fails for: the mask applied
    at or after min_tokens (off by one), or EOS left out of the mask."""
    params = SamplingParams(temperature=1.0, min_tokens=len(OUTPUT) + 1, stop_token_ids=(8,))
    req = Request("m", PROMPT, params, eos_token_id=0)
    req.all_token_ids.extend(OUTPUT)
    counts_tensor = Sampler(0).sample(LOGITS.repeat(DRAWS, 1), [req] * DRAWS).token_ids
    counts = torch.bincount(torch.tensor(counts_tensor), minlength=LOGITS.numel())
    masked = LOGITS.clone()
    masked[[0, 8]] = float("-inf")
    assert_fits(counts, torch.softmax(masked, dim=-1))
    req.all_token_ids.append(5)  # now at min_tokens: the stop tokens are allowed again
    counts_tensor = Sampler(0).sample(LOGITS.repeat(DRAWS, 1), [req] * DRAWS).token_ids
    counts = torch.bincount(torch.tensor(counts_tensor), minlength=LOGITS.numel())
    assert_fits(counts, torch.softmax(LOGITS, dim=-1))


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    """temperature 0 with a repetition penalty: the argmax after the penalty, which here is
    not the raw argmax. Fails for: penalties skipped for greedy rows."""
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    req = make_request(params, prompt=[0], output=[])  # token 0 (the favourite) in the prompt
    token = Sampler(0).sample(LOGITS.unsqueeze(0), [req]).token_ids[0]
    assert token == int(oracle(dataclasses.replace(params, temperature=1.0), [0], []).argmax())
    assert token != int(LOGITS.argmax())


def test_greedy_ties_take_the_first_maximum_as_hf_does():
    """Tied top logits (a row of equal scores, a tie late in a vocabulary-wide row): HF's
    greedy search takes torch.argmax, the first maximum; so must we, on every row."""
    params = SamplingParams(temperature=0.0)
    wide = torch.randn(3, 49_152, generator=torch.Generator().manual_seed(2))
    wide[0] = 0.0
    wide[1, [40_000, 40_001, 45_000]] = 100.0
    wide[2, [7, 30_000]] = 100.0
    reqs = [make_request(params, rid=str(i), prompt=[0], output=[]) for i in range(3)]
    assert Sampler(0).sample(wide, reqs).token_ids == [0, 40_000, 7]
    assert Sampler(0).sample(wide, reqs).token_ids == wide.argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [CASES["every penalty with top_p"], CASES["top_k 5"]])
def test_logprobs_are_the_raw_log_softmax_as_vllm_returns_them(params):
    """vLLM returns logprobs of the raw logits (before penalties, temperature and truncation):
    the sampled token's and the top-k's values and ranks equal the oracle's log-softmax.
    Fails for: logprobs taken after temperature or penalties, ranks off by one, top-k entries
    missing or unsorted, the sampled token left out."""
    k = 4
    params = dataclasses.replace(params, logprobs=k)
    rows = 64
    req = make_request(params)
    out = Sampler(seed=1).sample(LOGITS.repeat(rows, 1), [req] * rows)
    reference = torch.log_softmax(LOGITS.double(), dim=-1)
    order = reference.argsort(descending=True).tolist()
    sampled_ranks = set()
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry
        assert set(order[:k]) <= set(entry) and len(entry) <= k + 1
        for tok, lp in entry.items():
            assert lp.logprob == pytest.approx(reference[tok].item(), abs=1e-5)
            assert lp.rank == order.index(tok) + 1
        sampled_ranks.add(entry[token].rank)
    assert max(sampled_ranks) > k  # some draws came from outside the top k: still reported


def test_rows_without_logprobs_get_none_beside_rows_with_them():
    """Fails for: logprobs computed for every row when any row asks (extra work and a wrong
    response shape), or for none."""
    asks = make_request(SamplingParams(temperature=0.0, logprobs=0), "a")
    silent = make_request(SamplingParams(temperature=0.0), "b")
    out = Sampler(0).sample(LOGITS.repeat(2, 1), [asks, silent])
    assert out.logprobs[1] is None
    assert set(out.logprobs[0]) == {0} and out.logprobs[0][0].rank == 1


# Probabilities 1/2, 1/4, 1/8, 1/8 exactly (softmax of these logits is exact in float32): the
# edges of top-p and min-p fall exactly on a token.
DYADIC = torch.tensor([2.0, 1.0, 0.0, 0.0]) * math.log(2.0)


def draw_row(logits: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    req = make_request(params, prompt=[0], output=[])
    tokens = Sampler(0).sample(logits.repeat(n, 1), [req] * n).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel())


def hf_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scores, ids = logits.unsqueeze(0), torch.tensor([[0]])
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.75),  # the mass before token 2 is exactly 0.75
        SamplingParams(temperature=1.0, top_p=0.5),  # ... before token 1 exactly 0.5
        SamplingParams(temperature=1.0, min_p=0.25),  # tokens 2, 3 exactly at 0.25 x 0.5
        SamplingParams(temperature=1.0, top_k=1),  # top-k 1 is greedy, not "off"
    ],
    ids=["top_p at an edge", "top_p 0.5 at an edge", "min_p at an edge", "top_k 1"],
)
def test_edges_of_top_p_min_p_and_top_k_fall_as_in_hf(params):
    """Top-p keeps the smallest prefix whose mass reaches p (a token whose predecessors already
    reach it is out); min-p drops only tokens strictly below the scaled threshold; top_k=1 keeps
    one token. Fails for: `>=` turned into `>` in top-p, `<` into `<=` in min-p, top_k=1
    treated as no top-k."""
    expected = hf_distribution(DYADIC, params)
    assert_fits(draw_row(DYADIC, params), expected)


def test_min_p_scales_by_each_rows_own_top_probability():
    """Two rows with different peaks in one batch: each row's threshold uses its own top
    probability. Fails for: the top probability taken over the whole batch."""
    flat = SamplingParams(temperature=1.0, min_p=0.3)
    peaky = SamplingParams(temperature=0.3, min_p=0.3)
    n = 6000
    requests = [make_request(flat, "f"), make_request(peaky, "p")] * (n // 2)
    tokens = torch.tensor(Sampler(0).sample(LOGITS.repeat(n, 1), requests).token_ids)
    for start, params in ((0, flat), (1, peaky)):
        counts = torch.bincount(tokens[start::2], minlength=LOGITS.numel())
        assert_fits(counts, hf_distribution(LOGITS, params))


def test_a_repetition_penalty_of_exactly_2_applies():
    """Fails for: the penalty's no-op check comparing against a value other than 1."""
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    assert_fits(draw(params), oracle(params))


def test_token_ids_beyond_the_logits_are_ignored_not_fatal():
    """A tokenizer can have more ids than the model has logits (HF clamps them away in its
    repetition penalty). Such ids in the prompt, the output or the EOS set neither crash the
    sampler nor penalise a real token. Fails for: `< vocab` filters turned into `<= vocab`
    (an index error at id == vocab)."""
    vocab = LOGITS.numel()
    params = SamplingParams(temperature=0.0, repetition_penalty=5.0, min_tokens=3)
    req = Request("o", [vocab, 2], params, eos_token_id=vocab)
    req.all_token_ids.append(vocab)
    penalised = LOGITS.clone()
    penalised[2] /= 5.0
    assert Sampler(0).sample(LOGITS.unsqueeze(0), [req]).token_ids == [int(penalised.argmax())]


def test_unseeded_rows_follow_the_samplers_own_seed():
    """An engine's sampler seed makes unseeded requests reproducible, whatever else uses
    torch's global generator. Fails for: unseeded rows drawn from the global generator."""
    params = SamplingParams(temperature=1.0)

    def tokens(sampler_seed: int, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)  # someone else's use of the global generator
        sampler = Sampler(seed=sampler_seed)
        return sampler.sample(LOGITS.repeat(64, 1), [make_request(params)] * 64).token_ids

    assert tokens(5, global_seed=1) == tokens(5, global_seed=2) != tokens(6, global_seed=1)


def test_forgetting_a_request_restarts_its_seeded_stream():
    """The engine forgets a finished request's generator: a new request reusing the id starts
    from its seed again (and the dict does not grow with every request). Fails for: forget
    removing nothing."""
    params = SamplingParams(temperature=1.0, seed=9)
    sampler = Sampler(0)
    req = make_request(params, "again")
    first = [sampler.sample(LOGITS.unsqueeze(0), [req]).token_ids[0] for _ in range(8)]
    sampler.forget("again")
    assert "again" not in sampler.request_generators
    replay = [sampler.sample(LOGITS.unsqueeze(0), [req]).token_ids[0] for _ in range(8)]
    assert replay == first
    sampler.forget("never-seen")  # unknown ids are fine
