"""The Triton attention backend against the torch reference, and the CUDA-graph decode path.

Triton chooses interpreter or GPU compiler when a kernel module is imported, so the kernels run
in one spawned worker process that sets TRITON_INTERPRET=1 before importing them (see
triton_interpret_cases.py). Setting the variable in this process instead would depend on import
order and leak into every later test and child process (a GPU run would silently interpret).
The pure parts (tile and split choices, graph sizes, flags) are tested here directly.
"""

from __future__ import annotations

import random

import pytest
import torch
import triton_interpret_cases as cases

from hf_reference import assert_greedy_equal, assert_greedy_matches_hf
from pagefleet.common.cli import build_parser
from pagefleet.engine.attention.backend import PagedBatch, select_backend
from pagefleet.engine.attention.triton_backend import work_list
from pagefleet.engine.attention.triton_kernels import choose_num_splits, tile_config
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.cuda_graph import DecodeBuffers, graph_batch_sizes, padded_batch_size
from pagefleet.engine.server.serve import engine_args_from

F32 = {"rtol": 1e-5, "atol": 1e-5}


# ---------------------------------------------------------------- kernels vs torch reference

STEPS = {
    # Decodes only, MHA: contexts around block edges (partial last blocks, exactly full ones).
    "decode-mha": cases.StepSpec([(0, 1), (14, 1), (15, 1), (16, 1), (40, 1)], 4, 4),
    # GQA 4: decodes, a fresh prompt chunk and a chunk after a cached prefix, in one batch.
    "mixed-gqa4": cases.StepSpec([(3, 1), (33, 1), (0, 21), (16, 9)], 8, 2, seed=1),
    # GQA 8, block size 32: a chunk continuing a 40-token prefix (causal within the chunk).
    "chunk-gqa8-bs32": cases.StepSpec([(40, 23), (70, 1), (5, 1)], 8, 1, block_size=32, seed=2),
    # A full prefix hit recomputes its last token: attended, but its slot is not written.
    "prefix-hit-row": cases.StepSpec([(31, 1), (0, 5), (12, 1)], 4, 2, prefix_hit=[0], seed=3),
    # head_dim 32 (Qwen3-like) and a bfloat16 pool under float32 queries.
    "bf16-pool-d32": cases.StepSpec(
        [(20, 1), (9, 14)], 4, 2, head_dim=32, kv_dtype=torch.bfloat16, seed=4
    ),
    # The production head dims, and 128-token blocks (a key tile lies inside one block).
    "d128-gqa4": cases.StepSpec([(70, 1), (18, 6)], 8, 2, head_dim=128, seed=6),
    "d256-gqa4": cases.StepSpec([(33, 1), (0, 3)], 4, 1, head_dim=256, seed=7),
    "d64-bs128": cases.StepSpec(
        [(130, 1), (100, 40)], 4, 2, head_dim=64, block_size=128, num_blocks=8, seed=8
    ),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_attention_and_cache_writes_match_torch_reference(interpreter, name):
    result = interpreter(cases.attention_case, STEPS[name])
    torch.testing.assert_close(result["ours"], result["ref"], **F32)
    # Every written slot holds the same keys/values; untouched slots stay as they were.
    assert torch.equal(result["ours_pool"], result["ref_pool"])


@pytest.mark.parametrize("splits", [2, 4])
def test_split_kv_matches_torch_reference(interpreter, splits):
    # Long-ish contexts and few requests: the flash-decoding shape, plus a chunk and a context
    # shorter than a split (empty splits must not disturb the merge).
    spec = cases.StepSpec([(300, 1), (129, 1), (2, 1), (60, 7)], 4, 1, num_blocks=48, seed=5)
    result = interpreter(cases.attention_case, spec, num_splits=splits)
    torch.testing.assert_close(result["ours"], result["ref"], **F32)
    assert torch.equal(result["ours_pool"], result["ref_pool"])


# ---------------------------------------------------------------- end to end vs HF


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 17, 33)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_hf_with_triton_backend(interpreter, tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    prompts = _prompts(7)
    prompts.append(prompts[2][:32])  # two full blocks cached: a full prefix hit
    # A 16-token budget splits the longer prompts into chunks over cached prefixes.
    outs, graph_steps = interpreter(
        cases.greedy_case,
        path,
        prompts,
        6,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
        num_gpu_blocks_override=32,
    )
    assert graph_steps == 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(path, prompt, out, 6)


def test_static_decode_path_with_padding_equals_hf(interpreter, tiny_checkpoints):
    """The CUDA-graph path (static buffers, padded batch) run eagerly: 3 requests decode in a
    batch padded to 4, then 2 after one finishes."""
    path = tiny_checkpoints["llama"]
    prompts = _prompts(8)
    outs, graph_steps = interpreter(
        cases.greedy_case,
        path,
        prompts,
        5,
        static_decode=True,
        max_num_seqs=4,
        max_model_len=64,
        num_gpu_blocks_override=32,
    )
    assert graph_steps >= 4  # every decode-only step went through the static buffers
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(path, prompt, out, 5)


@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "graph-path"])
def test_speculation_on_triton_equals_hf(interpreter, tiny_checkpoints, static_decode):
    """n-gram drafts verified by the Triton kernels (a verification is 1 + k single rows, the
    pool written before any row attends); graph-path: verify steps through the CUDA-graph
    path's static buffers (sized for max_num_seqs x (1 + k) rows), run eagerly."""
    path = tiny_checkpoints["llama"]
    prompts = [[11, 12, 13] * 5, [5, 6, 7, 8] * 4]  # repetitive: drafts get accepted
    outs, graph_steps, accepted = interpreter(
        cases.speculative_greedy_case,
        path,
        prompts,
        12,
        static_decode,
        max_num_seqs=2,
        max_model_len=64,
        num_gpu_blocks_override=32,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert accepted > 0
    assert (graph_steps > 0) == static_decode
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(path, prompt, out, 12)


# ---------------------------------------------------------------- pure parts


def test_tile_config_groups_query_heads_per_kv_head():
    decode = tile_config(group=8, head_dim=128, max_query_len=1)
    assert (decode.block_m, decode.block_q, decode.block_d) == (16, 2, 128)
    prefill = tile_config(group=4, head_dim=64, max_query_len=300)
    assert (prefill.block_m, prefill.block_q) == (64, 16)
    wide = tile_config(group=32, head_dim=256, max_query_len=1)
    assert (wide.block_m, wide.block_q, wide.tile_n) == (32, 1, 32)
    assert tile_config(group=1, head_dim=96, max_query_len=1).block_d == 128
    # More warps only where the accumulator outgrows four warps' registers.
    assert (decode.num_warps, prefill.num_warps) == (4, 4)
    assert tile_config(group=4, head_dim=256, max_query_len=9).num_warps == 8


def test_work_list_covers_every_query_row_once():
    seqs, firsts = work_list([1, 5, 1, 16], block_q=4)
    rows = sorted((s, f + i) for s, f in zip(seqs, firsts, strict=True) for i in range(4))
    wanted = [(s, r) for s, n in enumerate([1, 5, 1, 16]) for r in range(n)]
    assert set(wanted) <= set(rows)
    assert seqs == [0, 1, 1, 2, 3, 3, 3, 3]


def test_split_kv_only_for_long_contexts_on_idle_devices():
    assert choose_num_splits(num_programs=8, max_context=4096, num_sms=132) == 8
    assert choose_num_splits(num_programs=8, max_context=65536, num_sms=132) == 16
    assert choose_num_splits(num_programs=256, max_context=4096, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_context=512, num_sms=132) == 1
    for programs in range(1, 140):
        n = choose_num_splits(programs, 8192, 132)
        assert n & (n - 1) == 0 and 1 <= n <= 16


def test_graph_batch_sizes_and_padding():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = graph_batch_sizes(48)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 33, 48, 49)] == [1, 4, 8, 48, 48, None]


def test_decode_buffers_pad_rows_as_no_ops():
    buf = DecodeBuffers.allocate(8, max_blocks=4, device=torch.device("cpu"))
    buf.seq_lens.fill_(99)  # stale values from an earlier, larger step
    buf.slots.fill_(7)
    flat = PagedBatch(
        query_start=torch.arange(4, dtype=torch.int32),
        seq_lens=torch.tensor([5, 17, 1], dtype=torch.int32),
        block_tables=torch.tensor([[3, 0], [4, 5], [6, 0]], dtype=torch.int32),
        slots=torch.tensor([52, 80, -1]),
        work_seq=torch.arange(3, dtype=torch.int32),
        work_q=torch.zeros(3, dtype=torch.int32),
        max_query_len=1,
        max_context=32,
    )
    buf.fill(torch.tensor([10, 11, 12]), torch.tensor([4, 16, 0]), flat, size=4)
    batch = buf.batch(4, max_context=64)
    assert batch.seq_lens.tolist() == [5, 17, 1, 0]
    assert batch.slots.tolist() == [52, 80, -1, -1]
    assert batch.block_tables[:3, :2].tolist() == [[3, 0], [4, 5], [6, 0]]
    assert batch.query_start.tolist() == [0, 1, 2, 3, 4]
    assert buf.input_ids[:3].tolist() == [10, 11, 12]


def test_backend_selection_and_flags(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # Without a decode shape to measure (no model), auto on CPU is torch.
    assert select_backend(None, torch.device("cpu")).name == "torch"
    assert select_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="not available"):
        select_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="--attention-backend"):
        EngineArgs(model="m", attention_backend="flash")

    parser = build_parser()
    args = engine_args_from(parser.parse_args(["serve", "m"]))
    assert (args.attention_backend, args.enforce_eager) == ("auto", False)
    args = engine_args_from(
        parser.parse_args(["serve", "m", "--attention-backend", "torch", "--enforce-eager"])
    )
    assert (args.attention_backend, args.enforce_eager) == ("torch", True)


# ---------------------------------------------------------------- linear attention (hybrids)

LINEAR_STEPS = {
    # Decodes with a verification of 3 drafts among them (its state saved after each row),
    # two prompt chunks with snapshots inside the first, GVA 2:1, head dims that are not
    # powers of two (32-token tiles).
    "decodes-verify-chunks-snapshots": cases.LinearStepSpec(
        [0, 3, 5], [(1, 40, [(9, 7), (32, 8)]), (2, 5, [])], [(6, 4, [(1, 9), (2, 10), (3, 11)])]
    ),
    # GVA 3:1, a conv of width 2, a chunk of two 64-token pieces after a snapshot after its
    # first token, bfloat16 state.
    "gva3-long-chunk-bf16": cases.LinearStepSpec(
        [4],
        [(1, 80, [(1, 9)])],
        key_heads=1,
        value_heads=3,
        key_dim=16,
        value_dim=8,
        conv_width=2,
        state_dtype=torch.bfloat16,
        seed=1,
    ),
}


@pytest.mark.parametrize("name", list(LINEAR_STEPS))
def test_linear_attention_kernels_match_torch(interpreter, name):
    """The Triton conv (update, chunk outputs, kept inputs at snapshots) and delta rule
    (recurrent, chunked with its scan) against linear_attn/torch_ops.py: outputs, every
    slot's conv and recurrent state (snapshot slots included, untouched ones unchanged)."""
    result = interpreter(cases.linear_attn_case, LINEAR_STEPS[name])
    tol = F32 if LINEAR_STEPS[name].state_dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for ours, ref in zip(result["triton"], result["torch"], strict=True):
        torch.testing.assert_close(ours, ref, **tol)


def test_hybrid_greedy_equals_hf_with_triton_kernels(interpreter, hybrid_checkpoints):
    """A Qwen3.5 checkpoint end to end on the Triton attention backend and Triton linear-
    attention kernels: chunked prompts over a 16-token budget (the second admitted once the
    first passed its snapshot boundary at 32, which it hits), then decodes."""
    path = hybrid_checkpoints["qwen3_5"]
    prompts = [list(range(40, 80)), list(range(40, 75))]
    outs, _ = interpreter(
        cases.greedy_case,
        path,
        prompts,
        3,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
        num_gpu_blocks_override=32,
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_matches_hf(path, prompt, out)
