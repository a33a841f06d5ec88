"""Hybrid models (Qwen3.5) across engines and ranks: tensor parallelism splits linear-attention
and attention heads over two ranks and equals HF's greedy output through chunking, preemption
and a prefix hit; disaggregated prefill/decode hands the prompt's recurrent state to the decode
engine inside KV blocks, over NIXL and over TCP, and the decode engine's output equals HF's
with nothing left held or leaked on either side."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_hybrid import ENGINE, GREEDY, _check, _prompts, assert_state_balanced

from pagefleet.engine import LLM
from server_utils import free_port

FLEET_SECRET = "hybrid-pd-test-secret-0123456789abcdef"


def test_tp2_splits_both_kinds_of_heads_and_equals_hf(hybrid_checkpoints):
    """Fails for: a rank holding the wrong linear-attention heads (q/k/v channel pieces, z, a,
    b, A_log, dt_bias or conv rows), a state slot that differs between ranks (the step
    broadcast's state metadata), an out_proj summed twice, and moves (snapshot copies, resets)
    that only rank 0 makes."""
    path = hybrid_checkpoints["qwen3_5"]
    llm = LLM(path, tensor_parallel_size=2, num_gpu_blocks_override=7, **ENGINE)
    try:
        runner = llm.engine.runner
        assert runner.state_pool.shape.num_heads == 2  # of the checkpoint's 4 value heads
        prompts = _prompts(3, 6)
        _check(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
        assert llm.engine.scheduler.num_preemptions > 0, "the pool did not force preemption"
        base = list(range(300, 340))
        for expected in (0, 32):
            (out,) = llm.generate([base], GREEDY, use_tqdm=False)
            _check(path, [base], [out])
            assert out.num_cached_tokens == expected
        assert_state_balanced(llm.engine)
    finally:
        llm.engine.close()


def _engine(path: str, connector: str, role: str) -> LLM:
    config = {"kv_connector": connector, "kv_role": role, "kv_port": free_port()}
    return LLM(
        path,
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=32,
        max_num_seqs=4,
        kv_transfer_config=json.dumps({**config, "kv_ip": "127.0.0.1"}),
    )


@pytest.mark.parametrize("connector", ["nixl", "tcp"])
def test_decode_engine_continues_from_the_prefill_engines_state(
    hybrid_checkpoints, connector, monkeypatch
):
    """Fails for: a state not written into the transport blocks (or written after the prompt's
    last token, which the decode engine recomputes), not loaded into the decode engine's slot,
    blocks or slots not released on either side, a pull that moves more or fewer blocks than
    the prompt's and the state's, and a snapshot the decode engine publishes at a boundary it
    never computed."""
    monkeypatch.setenv("PAGEFLEET_FLEET_SECRET", FLEET_SECRET)
    path = hybrid_checkpoints["qwen3_5_vl"]
    prefill, decode = (
        _engine(path, connector, "kv_producer"),
        _engine(path, connector, "kv_consumer"),
    )
    try:
        runner = decode.engine.runner
        block_bytes = runner.kv_pool[:, :, :, 0].numel() * runner.kv_pool.element_size()
        transfer_blocks = runner.state_config().transfer_blocks
        hold = dataclasses.replace(
            GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        prompts = [list(range(10, 60)), list(range(200, 233))]
        moved = 0
        for prompt in prompts:
            (first,) = prefill.generate([prompt], hold, use_tqdm=False)
            params = first.kv_transfer_params
            blocks = -(-len(prompt) // 16) + transfer_blocks
            assert len(params["remote_block_ids"]) == blocks
            pull = dataclasses.replace(GREEDY, kv_transfer_params=params)
            (out,) = decode.generate([prompt], pull, use_tqdm=False)
            _check(path, [prompt], [out])
            moved += blocks * block_bytes
        stats = decode.engine.connector.stats
        assert (stats.transfers, stats.failures, stats.fallbacks) == (2, 0, 0)
        assert stats.bytes == moved
        # The decode engine never computed the pulled prompts: a later local request over the
        # same prefix finds their blocks but no state snapshot there, and computes it.
        longer = [*prompts[0], 5, 6, 7]
        (out,) = decode.generate([longer], GREEDY, use_tqdm=False)
        _check(path, [longer], [out])
        for _ in range(3):  # the prefill engine frees what the decode engine released
            prefill.engine.step()
        assert prefill.engine.scheduler.num_held_blocks == 0
        assert_state_balanced(prefill.engine)
        assert_state_balanced(decode.engine)
    finally:
        prefill.engine.close()
        decode.engine.close()
