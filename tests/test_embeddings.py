"""The pooling runner against sentence-transformers' `encode` (the oracle), on tiny random
checkpoints with sentence-transformers configurations: last-token (normalised, the older
config format, Qwen3-Embedding's shape), mean (not normalised, a base `LlamaModel` without an
LM head) and CLS (normalised). Batches, single inputs, token ids, chunked prompts, prefix-cache
hits, preemption and Matryoshka dimensions; and which runner a checkpoint gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from st_checkpoints import st_checkpoint

from pagefleet.engine import LLM
from pagefleet.engine.pooling.config import PoolerConfig, resolve_pooling, resolve_runner
from pagefleet.engine.pooling.params import PoolingParams

TEXTS = [
    "hello",
    "the river and the mountain",
    "what is a cache block? " * 6,  # 39 tokens: three 16-token blocks, three chunks
    "tell me about the router and the engine, the prefill and the decode, the batch "
    "and the queue, the memory and the key value attention layer head",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "the cat and the dog in the tree by the river, " * 3,
]
# (source checkpoint, pooling mode, Normalize, options)
CASES = {
    "last": ("qwen3", "lasttoken", True, {"legacy": True, "matryoshka_dimensions": [16, 32, 64]}),
    "mean": ("llama", "mean", False, {"base_arch": "LlamaModel"}),
    "cls": ("qwen2", "cls", True, {}),
}


@pytest.fixture(scope="module")
def st_paths(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    return {
        name: st_checkpoint(tiny_checkpoints[src], root / name, mode, norm, **opts)
        for name, (src, mode, norm, opts) in CASES.items()
    }


@pytest.fixture(scope="module")
def oracle(st_paths):
    from sentence_transformers import SentenceTransformer

    models = {}

    def encode(case: str, texts: list[str]) -> torch.Tensor:
        if case not in models:
            models[case] = SentenceTransformer(st_paths[case], device="cpu")
        return models[case].encode(texts, convert_to_tensor=True).float()

    return encode


@pytest.fixture(scope="module")
def llms(st_paths):
    """One engine per case, squeezed: 4-token chunks of up to 4 prompts per 16-token step
    (the longer prompts take ten steps, batched with short ones), and 6 blocks (96 tokens)
    cannot hold 4 running prompts of 30-40 tokens, so requests lose their blocks halfway and
    compute their prompt again."""
    made = {}

    def get(case: str) -> LLM:
        if case not in made:
            made[case] = LLM(
                st_paths[case],
                max_num_batched_tokens=16,
                max_num_seqs=4,
                max_num_partial_prefills=4,
                long_prefill_token_threshold=4,
                max_model_len=96,
                num_gpu_blocks_override=6,
            )
        return made[case]

    return get


def assert_close(got: list, want: torch.Tensor) -> None:
    got = torch.stack([o.outputs.data for o in got])
    assert got.shape == want.shape
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min() >= 0.9999, cosine
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_embeddings_equal_sentence_transformers(case, llms, oracle):
    """Batched, chunked and preempted prompts; a single input; token-id inputs; a repeated
    input that hits the prefix cache (LAST pooling only: MEAN and CLS read every row, so
    their engine turns prefix caching off, as vLLM's does)."""
    llm = llms(case)
    want = oracle(case, TEXTS)
    assert_close(llm.embed(TEXTS, use_tqdm=False), want)
    assert llm.engine.stats().num_preemptions > 0
    tokenizer = llm.get_tokenizer()
    ids = [{"prompt_token_ids": tokenizer.encode(t)} for t in TEXTS[1:4]]
    assert_close(llm.embed(ids, use_tqdm=False), want[1:4])
    assert_close(llm.embed(TEXTS[2], use_tqdm=False), want[2:3])
    hits = llm.engine.stats().prefix_cache_hits
    assert_close(llm.embed(TEXTS[2], use_tqdm=False), want[2:3])
    assert (llm.engine.stats().prefix_cache_hits > hits) == (case == "last")
    assert llm.engine.limits.enable_prefix_caching == (case == "last")


def test_matryoshka_dimensions_truncate_then_renormalise(llms, oracle):
    full = oracle("last", TEXTS[:2])
    got = llms("last").embed(TEXTS[:2], PoolingParams(dimensions=32), use_tqdm=False)
    assert_close(got, torch.nn.functional.normalize(full[:, :32], dim=-1))
    with pytest.raises(ValueError, match=r"one of \[16, 32, 64\]"):
        llms("last").embed("hello", PoolingParams(dimensions=20), use_tqdm=False)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        llms("mean").embed("hello", PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match=r"use LLM\.embed"):
        llms("mean").generate("hello", use_tqdm=False)


def test_which_runner_and_pooler_a_checkpoint_gets(st_paths, tiny_checkpoints, tmp_path):
    plain = tiny_checkpoints["llama"]

    def runner(path, runner="auto", convert="auto"):
        config = json.loads((Path(path) / "config.json").read_text())
        return resolve_runner(runner, convert, path, config)

    assert runner(st_paths["last"]) == "pooling"  # a *ForCausalLM that declares pooling
    assert runner(st_paths["mean"]) == "pooling"  # a base model: no LM head
    assert runner(plain) == "generate"
    assert runner(plain, convert="embed") == "pooling"
    with pytest.raises(ValueError, match="no LM head"):
        runner(st_paths["mean"], runner="generate")
    with pytest.raises(ValueError, match="needs --convert embed"):
        runner(plain, runner="pooling", convert="none")

    config = json.loads((Path(plain) / "config.json").read_text())
    assert resolve_pooling(plain, config, None).pooler == PoolerConfig("LAST", True)
    override = '{"pooling_type": "mean", "use_activation": false}'
    assert resolve_pooling(st_paths["cls"], config, override).pooler == PoolerConfig("MEAN", False)
    with pytest.raises(ValueError, match="unknown keys"):
        resolve_pooling(plain, config, {"softmax": True})
    dense = st_checkpoint(plain, tmp_path / "dense", "mean", True)
    modules = json.loads((Path(dense) / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "x.models.Dense"})
    (Path(dense) / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="module Dense"):
        resolve_pooling(dense, config, None)
