"""P/D with tensor parallelism, end to end: `pagefleet serve` prefill and decode engines of TP=2
(real processes, two ranks each, gloo on CPU) move each rank's shard of a prompt's blocks rank
to rank over NIXL (UCX on loopback), and the decode engine's greedy output equals the colocated
TP=1 engine's, for a model whose KV heads split over the ranks and one whose single KV head is
replicated; a TP=1 decode engine is refused by a TP=2 prefill engine with a message naming both
sizes, and computes the prompt itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_pd import MAX_TOKENS, decode_directly, held_blocks, kv_flags, prefill_directly, pulls

from pagefleet.engine.llm import LLM
from pagefleet.engine.sampling_params import SamplingParams
from server_utils import FLEET_ENV, metric_value, running_server, wait_until

BLOCK = 16
PROMPT = list(range(20, 220))  # 200 tokens: 12 full blocks and a partial one
LONGER = PROMPT + list(range(300, 364))  # 264 tokens: PROMPT's 12 full blocks, then 5 more
TP2 = ("--tensor-parallel-size", "2")
START_TIMEOUT = 240  # two ranks load on a busy 2-core box


def colocated_tp1(path: str) -> list[str]:
    llm = LLM(path, max_model_len=1024, dtype="float32")
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([list(PROMPT), list(LONGER)], params, use_tqdm=False)
    finally:
        llm.engine.close()
    return [o.outputs[0].text for o in outs]


def rank_block_bytes(path: str, tp: int) -> int:
    """Bytes of one block on one rank (float32): its share of the KV heads, at least one."""
    config = json.loads((Path(path) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * max(1, heads // tp) * BLOCK * head_dim * 4


def computed_prompt_tokens(engine: str) -> float:
    return metric_value(engine, "vllm:prompt_tokens_total")


def pulled_bytes(engine: str) -> float:
    return metric_value(engine, "pagefleet:kv_transfer_bytes_total")


def serve(path: str, role: str, *flags: str):
    return running_server(
        path, *kv_flags("nixl", role), *flags, timeout=START_TIMEOUT, env=FLEET_ENV
    )


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # 2 KV heads split; 1 KV head replicated
def test_tp2_prefill_to_tp2_decode_equals_colocated_tp1(tiny_checkpoints, arch):
    """Fails for: a worker rank that does not READ its shard (its KV stays zero: the output
    changes), a rank reading another rank's shard (wrong heads), a pull that completes before
    every rank's READ did, a decode engine that recomputes the prompt instead (prompt tokens
    computed > 1, or a fallback counted), and a pull that moves blocks the decode engine
    already caches (bytes)."""
    path = tiny_checkpoints[arch]
    expected = colocated_tp1(path)
    per_block = 2 * rank_block_bytes(path, 2)  # both ranks' shards
    with (
        serve(path, "kv_producer", *TP2) as (prefill, _),
        serve(path, "kv_consumer", *TP2) as (
            decode,
            _,
        ),
    ):
        params = prefill_directly(prefill, PROMPT)
        assert len(params["remote_block_ids"]) == 13
        assert decode_directly(decode, PROMPT, params) == expected[0]
        assert pulls(decode, "nixl") == 1
        assert metric_value(decode, "pagefleet:kv_transfer_fallbacks_total") == 0
        assert pulled_bytes(decode) == 13 * per_block
        # Only the prompt's last token is computed here (for its logits), as after a prefix hit.
        assert computed_prompt_tokens(decode) == 1

        # A longer prompt over the same prefix: only the 5 blocks not cached here move.
        params = prefill_directly(prefill, LONGER)
        assert decode_directly(decode, LONGER, params) == expected[1]
        assert pulls(decode, "nixl") == 2
        assert pulled_bytes(decode) == (13 + 5) * per_block
        assert computed_prompt_tokens(decode) == 2
        wait_until(lambda: held_blocks(prefill) == 0, 10, "the pulls to release the holds")
        assert metric_value(decode, "pagefleet:kv_transfer_failures_total") == 0


def test_a_tp1_decode_engine_is_refused_by_a_tp2_prefill_engine(tiny_checkpoints):
    """Heterogeneous TP is refused at the handshake (rank r's shard is not a TP=1 block) with
    both sizes named; the decode engine then computes the prompt itself and the hold is freed.
    Fails for: a handshake that ignores the TP size (the TP=1 engine would read rank 0's half
    of each block: wrong output, no fallback), or a refusal that does not say why."""
    path = tiny_checkpoints["llama"]
    expected = colocated_tp1(path)[0]
    with (
        serve(path, "kv_producer", *TP2) as (prefill, _),
        serve(path, "kv_consumer") as (
            decode,
            decode_proc,
        ),
    ):
        params = prefill_directly(prefill, PROMPT)
        assert decode_directly(decode, PROMPT, params) == expected
        assert metric_value(decode, "pagefleet:kv_transfer_fallbacks_total") == 1
        assert pulls(decode, "nixl") == 0
        log = Path(decode_proc.log_path).read_text(errors="replace")
        assert (
            "heterogeneous TP is not supported: the prefill engine has tensor-parallel size 2, "
            "the decode engine 1"
        ) in log
        wait_until(lambda: held_blocks(prefill) == 0, 10, "the refused pull to release the hold")
