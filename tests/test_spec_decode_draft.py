"""Speculative decoding with a draft model: greedy equality with and without speculation (and
with HF) when the draft is the target itself (every draft accepted), another tiny checkpoint
(drafts rejected) or a perturbed copy (some accepted), under chunked prefill, preemption and
prefix hits; the draft's KV is recomputed wherever it may be stale; refusals; the metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_spec_decode import ENGINE_PATHS, _prompts, _tokens

from hf_reference import assert_greedy_equal
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.model.tiny import write_tiny_checkpoint
from pagefleet.engine.spec_decode.config import SpeculativeConfig
from server_utils import metric_value, running_server

K = 4
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = _prompts()


def _draft_llm(target: str, draft: str, **args) -> LLM:
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
    return LLM(target, speculative_config=config, **{"max_model_len": 256, **args})


def _perturbed_copy(source: str, dest: Path, scale: float) -> str:
    """The checkpoint at `source` with gaussian noise on every weight: a draft that agrees
    with the target on some tokens and not others."""
    shutil.copytree(source, dest)
    generator = torch.Generator().manual_seed(7)
    for file in dest.glob("*.safetensors"):
        weights = load_file(file)
        noisy = {
            name: w + scale * w.std() * torch.randn(w.shape, generator=generator)
            for name, w in weights.items()
        }
        save_file(noisy, file, metadata={"format": "pt"})
    return str(dest)


@pytest.fixture(scope="module")
def drafts(tiny_checkpoints, tmp_path_factory) -> dict[str, dict[str, str]]:
    """Per architecture: the draft checkpoints (itself, another, perturbed)."""
    from hf_reference import ARCH_CASES

    root = tmp_path_factory.mktemp("drafts")
    result = {}
    for arch in ("llama", "qwen3"):
        name, opts = ARCH_CASES[arch]
        target = tiny_checkpoints[arch]
        other = write_tiny_checkpoint(root / f"{arch}-other", name, **{**opts, "seed": 5})
        result[arch] = {
            "itself": target,
            "other": str(other),
            "perturbed": _perturbed_copy(target, root / f"{arch}-perturbed", 0.3),
        }
    return result


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_a_draft_model_equals_greedy_without_and_hf(tiny_checkpoints, drafts, arch):
    """Token for token with each draft on every engine path. The target as its own draft has
    every draft accepted, also after preemption (asserted) and on a second run's prefix hits
    (asserted): a draft reading stale keys/values of a preempted request or of blocks it
    never wrote would propose other tokens and be rejected."""
    target = tiny_checkpoints[arch]
    base = LLM(target, max_model_len=256, num_gpu_blocks_override=256)
    reference = _tokens(base.generate(PROMPTS, GREEDY, use_tqdm=False))
    for prompt, tokens in zip(PROMPTS, reference, strict=True):
        assert_greedy_equal(target, prompt, tokens, MAX_TOKENS)
    for kind, draft in drafts[arch].items():
        for name, args in ENGINE_PATHS.items():
            llm = _draft_llm(target, draft, **args)
            assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference, (
                kind,
                name,
            )
            engine = llm.engine
            counters = engine.spec_counters
            assert counters.num_draft_tokens > 0, (kind, name)
            if kind == "itself":
                assert counters.num_accepted_tokens == counters.num_draft_tokens, name
            if kind == "perturbed":
                assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, name
            if name == "tight-pool-preemption":
                assert engine.scheduler.num_preemptions > 0, "the pool did not force preemption"
            if name == "batched":
                again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
                assert _tokens(again) == reference, kind
                assert all(o.num_cached_tokens > 0 for o in again), "no prefix hit"
                if kind == "itself":
                    assert counters.num_accepted_tokens == counters.num_draft_tokens
            kv = engine.scheduler.kv_cache
            assert kv.num_free_blocks == kv.num_blocks, (kind, name)


def test_n_greater_than_one_and_stop_strings_with_a_draft(tiny_checkpoints, drafts):
    target = tiny_checkpoints["llama"]
    base = LLM(target, max_model_len=256, num_gpu_blocks_override=256)
    spec = _draft_llm(target, drafts["llama"]["perturbed"], num_gpu_blocks_override=256)
    two = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = base.generate(PROMPTS, two, use_tqdm=False)
    got = spec.generate(PROMPTS, two, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    text = base.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=(stop,))
    w = base.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    g = spec.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, "stop")


def test_metrics_count_the_draft_models_proposals(tiny_checkpoints):
    target = tiny_checkpoints["llama"]
    llm = _draft_llm(target, target, num_gpu_blocks_override=64)
    out = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    stats = llm.engine.stats().spec_decode
    # Every draft accepted: each verification emits K + 1 tokens (the last ones fewer, cut by
    # max_tokens), after the one token of the prefill step.
    assert stats.num_drafts >= (MAX_TOKENS - 1) // (K + 1)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.accepted_per_pos[0] == stats.num_drafts
    assert stats.num_accepted_tokens + stats.num_drafts == MAX_TOKENS - 1


def test_draft_model_config_is_parsed_as_vllm_writes_it():
    config = SpeculativeConfig.parse(
        '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 3,'
        ' "draft_tensor_parallel_size": 1}'
    )
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/d", 3)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model (the draft"),
        (
            {
                "method": "draft_model",
                "model": "/d",
                "num_speculative_tokens": 2,
                "draft_tensor_parallel_size": 2,
            },
            "draft_tensor_parallel_size must be 1",
        ),
        (
            {
                "method": "draft_model",
                "model": "/d",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
            },
            "only for method ngram",
        ),
        ({"method": "ngram", "model": "/d", "num_speculative_tokens": 2}, "only for method"),
    ],
)
def test_bad_draft_model_config_is_refused(raw, message):
    with pytest.raises(ValueError, match="--speculative-config") as e:
        SpeculativeConfig.parse(raw)
    assert message in str(e.value)


def test_a_draft_of_another_tokenizer_or_a_missing_path_is_refused(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match="cannot load the draft"):
        _draft_llm(target, str(tmp_path / "missing"))
    wide = write_tiny_checkpoint(tmp_path / "wide", vocab_size=1024, num_layers=1)
    with pytest.raises(ValueError, match="vocab_size 1024 is not the target's"):
        _draft_llm(target, str(wide))
    other_eos = write_tiny_checkpoint(tmp_path / "eos", num_layers=1)
    config_file = other_eos / "config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = [config["eos_token_id"], 7]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eos token ids"):
        _draft_llm(target, str(other_eos))


def test_a_draft_under_tp_is_refused_until_tested():
    """The draft's own runner is built for one rank: under tensor parallelism it fails at
    start rather than run unproven (P/D is tested: tests/test_spec_decode_pd_tp.py)."""
    spec = {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="a draft model under --tensor-parallel-size"):
        EngineArgs(model="/m", speculative_config=spec, tensor_parallel_size=2)


def test_sampling_with_a_draft_is_seeded_reproducible(tiny_checkpoints, drafts):
    """Random requests verify greedy drafts with the rejection sampler (q a point mass): a
    seeded request gives the same tokens run to run, and drafts were both accepted and
    rejected along the way."""
    target = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, seed=11)
    runs = []
    for _ in range(2):
        llm = _draft_llm(target, drafts["llama"]["itself"], num_gpu_blocks_override=128)
        runs.append(_tokens(llm.generate(PROMPTS, params, use_tqdm=False)))
        counters = llm.engine.spec_counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert runs[0] == runs[1]
    assert all(len(tokens) == MAX_TOKENS for tokens in runs[0])


def test_serve_with_a_draft_model_end_to_end(tiny_checkpoints):
    """`pagefleet serve --speculative-config` with vLLM's draft_model JSON: the completion
    equals the offline engine's greedy output without speculation, and /metrics counts every
    draft of the target-as-its-own-draft accepted."""
    path = tiny_checkpoints["llama"]
    want = LLM(path, max_model_len=256, num_gpu_blocks_override=256).generate(
        [PROMPTS[2]], GREEDY, use_tqdm=False
    )[0]
    config = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    with running_server(path, "--speculative-config", json.dumps(config)) as (base, _):
        body = {
            "model": "tiny",
            "prompt": PROMPTS[2],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want.outputs[0].text
        drafted = metric_value(base, "vllm:spec_decode_num_draft_tokens_total")
        assert drafted > 0
        assert metric_value(base, "vllm:spec_decode_num_accepted_tokens_total") == drafted


def test_the_draft_pool_is_paid_from_the_kv_budget(tiny_checkpoints):
    """The target's pool and the draft's (a block for each of the target's, plus scratch)
    fit together in --kv-cache-memory (the GPU's budget is split the same way): a draft as
    large as the target halves the target's blocks rather than doubling the memory."""
    path = tiny_checkpoints["llama"]
    budget_gib = 0.004
    alone = LLM(path, max_model_len=256, kv_cache_memory=budget_gib).engine.runner
    engine = _draft_llm(path, path, kv_cache_memory=budget_gib, max_num_seqs=8).engine
    draft_pool = engine.proposer.runner.kv_pool
    used = sum(p.numel() * p.element_size() for p in (engine.runner.kv_pool, draft_pool))
    assert used <= budget_gib * (1 << 30)
    per_block = alone.kv_pool.numel() * alone.kv_pool.element_size() / alone.kv_pool.shape[3]
    assert alone.kv_pool.shape[3] == int(budget_gib * (1 << 30) // per_block)
    assert engine.runner.kv_pool.shape[3] < alone.kv_pool.shape[3] / 2


def test_a_draft_model_on_cpu_pauses_at_eight_running_requests_unless_told(tiny_checkpoints):
    """benchmarks/spec_decode.py: on CPU a draft model's forwards cost more than they save
    at 8 running requests, so the engine pauses speculation there by itself; an explicit
    disable_by_batch_size wins, and n-gram drafts (almost free to propose) never pause."""
    from pagefleet.engine.llm_engine import DRAFT_CPU_DISABLE_AT

    path = tiny_checkpoints["llama"]
    assert DRAFT_CPU_DISABLE_AT == 8
    assert _draft_llm(path, path).engine.spec_disable_at == DRAFT_CPU_DISABLE_AT
    told = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    told["disable_by_batch_size"] = 32
    assert LLM(path, max_model_len=256, speculative_config=told).engine.spec_disable_at == 32
    ngram = {"method": "ngram", "num_speculative_tokens": K}
    assert LLM(path, max_model_len=256, speculative_config=ngram).engine.spec_disable_at is None
