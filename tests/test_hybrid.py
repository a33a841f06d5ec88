"""Hybrid models (Qwen3.5: Gated DeltaNet and gated attention layers) in one engine on CPU:
greedy output equals HF transformers' in float32 under chunked prefill with a small token
budget, preemption in a tight pool, prefix hits at block boundaries (hits counted only where
no recompute was needed) and speculative decoding (the state rolled back to the last kept
draft); the state slots balance after 100 clients left mid-stream; the engine's pool and
`pagefleet plan` agree to the block (tiny checkpoints sized from memory, the seed's 27B rows);
a hybrid draft model and the offload tier are refused by name."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import pytest
import torch

from conftest import make_request
from hf_reference import HYBRID_CASES, assert_greedy_matches_hf
from pagefleet.common.capacity import GB
from pagefleet.common.cli import main
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.async_llm import AsyncLLM
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.kv_cache.manager import KVCacheManager
from pagefleet.engine.kv_cache.state_cache import StateConfig
from pagefleet.engine.kv_sizing import cache_plan_of
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.model import qwen3_5
from pagefleet.engine.spec_decode.ngram import NgramProposer

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
# GiB of cache (state slots, then KV blocks) per checkpoint: seven blocks each, so six
# prompts of up to 70 tokens preempt, and a 24-token budget chunks them.
KV_MEMORY = {"qwen3_5": 0.000262, "qwen3_5_vl": 0.0000796}
ENGINE = {"max_model_len": 96, "max_num_batched_tokens": 24, "max_num_seqs": 6}


@pytest.fixture(scope="module")
def engines(hybrid_checkpoints):
    llms = {
        name: LLM(path, dtype="float32", kv_cache_memory=KV_MEMORY[name], **ENGINE)
        for name, path in hybrid_checkpoints.items()
    }
    yield llms
    for llm in llms.values():
        llm.engine.close()


def _prompts(seed: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def _check(path: str, prompts: list[list[int]], outs) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert_greedy_matches_hf(path, prompt, list(out.outputs[0].token_ids))


def assert_state_balanced(engine: LLMEngine) -> None:
    """Nothing holds a slot or a block once no request runs: no slot in use, no pinned
    snapshot, no pending move, every block free (cached ones included) and usage 0."""
    kv = engine.scheduler.kv_cache
    slots = kv.state.slots
    assert slots.num_in_use == 0, f"{slots.num_in_use} state slots leaked"
    assert not +slots.pins and not kv.state._fills
    assert len(slots.free) + len(slots.snapshots) == slots.num_slots
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0


@pytest.mark.parametrize("name", list(HYBRID_CASES))
def test_greedy_equals_hf_across_chunks_preemption_and_prefix_hits(
    engines, hybrid_checkpoints, name
):
    """Fails for: a state not carried across chunks or not reset for a new sequence, a
    snapshot taken at the wrong position or copied into the wrong slot, a preempted request
    resuming on a stale state, wrong weights anywhere (norm offsets, q/gate interleave, conv
    channel order, partial rotary), and a hit counted where the state had to be recomputed."""
    llm, path = engines[name], hybrid_checkpoints[name]
    engine = llm.engine
    prompts = _prompts(3, 6)
    _check(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert engine.scheduler.num_preemptions > 0, "the pool did not force preemption"

    # A prompt again: a hit at its last block boundary before its final token (39 -> 32).
    base = list(range(300, 340))
    again = list(range(300, 340))
    longer = base + [7] * 13  # continues it: hits the same 32-token snapshot
    # Two prompts sharing 48 tokens: the second finds the attention blocks but no state at
    # 48 (nothing snapshot there yet), so nothing counts as a hit; it snapshots there, and
    # the third prompt sharing them hits all 48.
    shared = list(range(100, 148))
    branches = [shared + [9] * 20, [*shared, 11, 12, 13], [*shared, 14, 15, 16, 17, 18]]
    hits_before = engine.stats().prefix_cache_hits
    cached = []
    for prompt in [base, again, longer, *branches]:
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        _check(path, [prompt], [out])
        cached.append(out.num_cached_tokens)
    assert cached == [0, 32, 32, 0, 0, 48]
    assert engine.stats().prefix_cache_hits - hits_before == sum(cached)
    assert_state_balanced(engine)


@pytest.mark.parametrize("name", list(HYBRID_CASES))
def test_engine_pool_and_plan_agree_to_the_block(engines, hybrid_checkpoints, name, capsys):
    """The engine sized from --kv-cache-memory and `pagefleet plan --kv-cache-memory` on the
    same checkpoint and flags: the same state slots (whose bytes are the state pool's
    tensors) and the same number of KV blocks."""
    engine = engines[name].engine
    runner = engine.runner
    pool = runner.state_pool
    slot_bytes = (pool.conv[:, 0].numel() + pool.ssm[:, 0].numel()) * pool.conv.element_size()
    argv = [hybrid_checkpoints[name], "--kv-cache-memory", str(KV_MEMORY[name])]
    argv += ["--max-num-seqs", str(ENGINE["max_num_seqs"]), "--kv-cache-dtype", "float32"]
    assert main(["plan", *argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plans"]
    assert row["state_slots"] == pool.num_slots == 2 * ENGINE["max_num_seqs"]
    assert row["state_bytes"] == pool.num_slots * slot_bytes
    assert row["kv_blocks"] == runner.kv_pool.shape[3] == engine.scheduler.kv_cache.num_blocks


SEED_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": {
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "layer_types": [*["linear_attention"] * 3, "full_attention"] * 16,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    },
}
SEED_ARGS = ["--gpu", "H100-80GB", "--kv-cache-dtype", "bf16,fp8", "--overhead-gb", "5"]
SEED_ARGS += ["--params", "27e9", "--max-num-seqs", "8"]


def test_the_seeds_27b_rows_agree_with_the_engines_sizing(tmp_path, capsys):
    """Seed 003's 27B hybrid on one H100 (bf16 weights, bf16 and fp8 KV): the engine's sizing
    code (kv_sizing.cache_plan_of, over the model built on the meta device) given the same
    memory left after weights and overhead gives plan's blocks and state slots, with 8 running
    sequences; and a pool of the seed's 13,923 blocks is what plan says it is."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SEED_27B))
    assert main(["plan", str(config), *SEED_ARGS, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plans"]
    cfg = qwen3_5.config_from_hf(SEED_27B, "Qwen3_5ForConditionalGeneration")
    with torch.device("meta"):
        model = qwen3_5.build(cfg, 16).to(torch.bfloat16)
    args = EngineArgs(model=str(tmp_path), max_num_seqs=8)
    budget = int(80 * GB * 0.92) - 27 * 10**9 * 2 - 5 * GB  # GPU x utilisation - weights - 5 GB
    for row, kv_dtype in zip(rows, (torch.bfloat16, torch.float8_e4m3fn), strict=True):
        ours = cache_plan_of(args, model, kv_dtype, budget)
        assert (
            (ours.kv_blocks, ours.state_slots)
            == (row["kv_blocks"], row["state_slots"])
            == (
                ours.kv_blocks,
                16,
            )
        )
        assert ours.state_bytes == row["state_bytes"] == 16 * 48 * (3 * 10_240 + 786_432) * 2
    # Without state slots the bf16 row is the seed's table: 13,923 blocks of 1 MiB.
    assert rows[0]["kv_blocks"] < 13_923
    assert main(["plan", str(config), "--num-gpu-blocks", "13923", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plans"]
    engine_block = cache_plan_of(args, model, torch.bfloat16, 0).bytes_per_block
    assert row["bytes_per_block"] == engine_block == 1_048_576


def test_state_slots_balance_after_100_clients_leave(hybrid_checkpoints):
    """100 streams, a quarter left before any output (most never admitted: six run at once),
    the others after one to three outputs: every slot and block comes back, no snapshot
    stays pinned, no move stays pending."""
    path = hybrid_checkpoints["qwen3_5_vl"]
    args = {**ENGINE, "max_num_batched_tokens": 256}
    engine = LLMEngine(EngineArgs(model=path, dtype="float32", num_gpu_blocks_override=40, **args))
    llm = AsyncLLM(lambda: engine)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(2, 40))] for _ in range(100)]

    async def leave(i: int) -> None:
        stream = llm.generate(prompts[i], params, f"r{i}")
        seen = 0
        while i % 4 and seen < i % 4:
            await anext(stream)
            seen += 1
        await stream.aclose()

    async def run() -> None:
        # A leaked slot starves admission: fail in bounded time rather than hang.
        await asyncio.wait_for(asyncio.gather(*(leave(i) for i in range(100))), 120)

    try:
        asyncio.run(run())
        deadline = asyncio.run(_until(lambda: llm.num_unfinished == 0))
        assert deadline, "requests still unfinished"
        llm.shutdown()
        assert_state_balanced(llm.engine)
    finally:
        llm.shutdown()
        llm.engine.close()


async def _until(condition, timeout: float = 60.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not condition():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.01)
    return True


@dataclass(frozen=True)
class CorruptedOracle(NgramProposer):
    """Drafts the known greedy continuation with draft j wrong, j cycling over 0..k (k: none
    wrong), so verifications keep every number of drafts from none to all."""

    references: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        k = min(self.num_speculative_tokens, max_tokens)
        for prompt, reference in self.references:
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = list(reference[done : done + k])
                wrong = done % (self.num_speculative_tokens + 1)
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % 500 + 5
                return drafts
        return []


def test_speculative_decoding_rolls_the_state_back_to_the_last_kept_draft(
    engines, hybrid_checkpoints
):
    """Verifying k drafts saves the state after each; whatever number is kept (0..k here, in
    turn), the next step continues from the state after the last kept token. Fails for: a
    state not rolled back (it absorbed the rejected drafts), rolled back one token off, or a
    verification's rows read as separate sequences; outputs are HF's and slots balance."""
    path = hybrid_checkpoints["qwen3_5"]
    prompts = _prompts(11, 3)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = engines["qwen3_5"].generate(prompts, params, use_tqdm=False)
    refs = tuple(
        (tuple(p), tuple(o.outputs[0].token_ids)) for p, o in zip(prompts, plain, strict=True)
    )
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(path, dtype="float32", speculative_config=spec, num_gpu_blocks_override=32, **ENGINE)
    try:
        engine = llm.engine
        engine.proposer = CorruptedOracle(3, 1, 3, refs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [list(r) for _, r in refs]
        for prompt, out in zip(prompts, outs, strict=True):
            assert_greedy_matches_hf(path, prompt, list(out.outputs[0].token_ids))
        per_position = engine.spec_counters.snapshot().accepted_per_pos
        assert per_position[0] > per_position[1] > per_position[2] > 0  # 1, 2 and 3 kept
        assert_state_balanced(engine)
    finally:
        engine.close()


def test_a_hybrid_draft_model_and_the_offload_tier_are_refused(hybrid_checkpoints):
    """A draft model's own state would need rolling back too, and the offload tier keeps
    blocks without their states: both refused, naming why, not silently wrong."""
    path = hybrid_checkpoints["qwen3_5_vl"]
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="a hybrid draft model is not supported"):
        LLM(path, speculative_config=draft, num_gpu_blocks_override=8, max_model_len=64)
    with pytest.raises(ValueError, match="offload tier keeps KV blocks, not a hybrid"):
        KVCacheManager(8, 16, True, num_host_blocks=4, state=StateConfig(4, 1, 1.0))


def test_a_state_slot_is_admitted_with_the_blocks_all_or_nothing_and_weighs_in_usage():
    """With blocks free but no state slot a hybrid request is not admitted and nothing
    changes; a running sequence's slot counts in usage by its bytes (here two blocks' worth),
    so vllm:kv_cache_usage_perc says what the state takes."""
    kv = KVCacheManager(
        8, 4, True, state=StateConfig(num_slots=2, transfer_blocks=1, slot_blocks=2)
    )
    a, b, c = (make_request(rid, list(range(1, 9))) for rid in "abc")
    assert kv.allocate_slots(a, 8, []) and kv.allocate_slots(b, 8, [])
    assert kv.usage == (4 + 2 * 2) / (8 + 2 * 2)
    assert not kv.allocate_slots(c, 4, [])
    assert (c.block_ids, c.state_slot, kv.num_free_blocks) == ([], -1, 4)
    freed = a.state_slot
    kv.free(a)
    assert a.state_slot == -1
    assert kv.allocate_slots(c, 4, []) and c.state_slot == freed
