"""The in-place paged decode kernel (numba backend) against the torch reference backend.

The torch backend's decode path (gather the blocks, then matmuls and softmax) is the oracle:
on random paged batches, scattered block tables and context lengths on both sides of block
edges, the kernel must give the same attention to float32 tolerance for every GQA group size,
head size and block size the engine runs, read a bfloat16 pool exactly as float32, and see the
keys/values a step writes before its rows attend (speculative verify rows depend on that). The
end-to-end tests run the engine on each CPU backend and compare greedy output with HF.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hf_reference import assert_greedy_equal
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.attention.backend import AttentionMetadata, SingleGroup
from pagefleet.engine.attention.numba_paged import (
    MIN_RUN_BLOCKS,
    NumbaAttentionBackend,
    _exp_shifted,
    context_parts,
    decode_attention,
    kernel_takes,
    runs_serially,
)
from pagefleet.engine.attention.torch_ref import TorchAttentionBackend

NUM_KV = 2
NUM_BLOCKS = 64


def edge_lengths(block_size: int, rows: int, rng: random.Random) -> list[int]:
    """Context lengths at, just below and just above block edges, plus random ones."""
    edges = [1, 2, block_size - 1, block_size, block_size + 1, 3 * block_size, 3 * block_size + 5]
    return sorted(edges + [rng.randint(1, 6 * block_size) for _ in range(rows - len(edges))])


def paged_group(lens: list[int], block_size: int, rng: random.Random, with_lens: bool = True):
    """A SingleGroup as the runner builds it: each row's blocks drawn at random from the pool
    (scattered, not in order), tables padded with block 0, the mask covering the context."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = []
    for length in lens:
        need = -(-length // block_size)
        tables.append([free.pop() for _ in range(need)])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    mask = torch.arange(width * block_size).unsqueeze(0) < seq_lens.unsqueeze(1)
    mask = mask.view(1, len(lens), 1, width * block_size)
    return SingleGroup(0, len(lens), padded, mask, seq_lens if with_lens else None)


@pytest.fixture(scope="module")
def numba_backend() -> NumbaAttentionBackend:
    return NumbaAttentionBackend()


@pytest.mark.parametrize("group_size", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_torch_reference(numba_backend, group_size, head_dim, block_size):
    rng = random.Random(group_size * 1000 + head_dim + block_size)
    torch.manual_seed(rng.randrange(1 << 30))
    lens = edge_lengths(block_size, 10, rng)
    group = paged_group(lens, block_size, rng)
    k_cache = torch.randn(NUM_KV, NUM_BLOCKS, block_size, head_dim)
    v_cache = torch.randn(NUM_KV, NUM_BLOCKS, block_size, head_dim)
    q = torch.randn(len(lens), NUM_KV * group_size, head_dim) * 2  # peaked softmaxes too
    scale = head_dim**-0.5
    assert kernel_takes(q, k_cache, None)
    ours = numba_backend._single(q, k_cache, v_cache, group, scale, None)
    ref = TorchAttentionBackend()._single(q, k_cache, v_cache, group, scale, None)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_the_kernels_exponentials_are_float32_exp_to_a_few_ulp():
    """The kernel's own exp (a polynomial LLVM vectorises) against float64 exp of the same
    float32 difference: within 3 float32 ulp wherever a weight counts (down to exp(-80)), and
    never above exp(-80) below it (a score that far under the row's max weighs nothing next
    to the max's 1)."""
    shifted = np.concatenate([np.linspace(-120.0, 0.0, 20001), -np.geomspace(1e-8, 80.0, 5001)])
    shift = np.float32(3.25)
    scores = (shifted + shift).astype(np.float32)
    out = np.empty_like(scores)
    _exp_shifted(scores, shift, len(scores) - 1, out)  # the last one left as it was
    exact = np.exp((scores - shift).astype(np.float64))
    counted = exact[:-1] >= np.exp(-80.0)
    relative = np.abs(out[:-1] - exact[:-1]) / exact[:-1]
    assert relative[counted].max() < 3 * np.finfo(np.float32).eps
    assert (out[:-1][~counted] <= np.exp(-80.0) * 1.01).all() and (out[:-1] >= 0).all()


@pytest.mark.parametrize("rows", [1, 9])
def test_the_serial_the_threaded_and_the_split_kernel_agree(numba_backend, rows):
    """Decode steps with fewer work items than two per thread run on the calling thread or
    with each context cut into runs of blocks merged afterwards: the reference's attention
    either way, including runs left without blocks (more runs than a short row has)."""
    rng = random.Random(rows)
    lens = edge_lengths(16, 9, rng)[-rows:]
    group = paged_group(lens, 16, rng)
    k_cache, v_cache = torch.randn(2, NUM_KV, NUM_BLOCKS, 16, 64).unbind(0)
    q = torch.randn(rows, 8, 64)
    lens_t = torch.tensor(lens)
    tables = group.block_tables
    serial = decode_attention(q, k_cache, v_cache, tables, lens_t, 0.125, True, 1)
    threaded = decode_attention(q, k_cache, v_cache, tables, lens_t, 0.125, False, 1)
    torch.testing.assert_close(serial, threaded, rtol=1e-6, atol=1e-7)
    ref = TorchAttentionBackend()._single(q, k_cache, v_cache, group, 0.125, None)
    torch.testing.assert_close(serial, ref, rtol=1e-5, atol=1e-5)
    for parts in (2, 3, 7):
        split = decode_attention(q, k_cache, v_cache, tables, lens_t, 0.125, False, parts)
        torch.testing.assert_close(split, ref, rtol=1e-5, atol=1e-5)


def test_each_step_s_groups_get_their_own_plan():
    """The backend plans a group's kernel call once for all the layers of its step (each
    group keeps its own plan): groups of other rows and lengths, taken in turn as a step's
    layers take them, each attend over their own contexts."""
    backend = NumbaAttentionBackend()
    rng = random.Random(5)
    k_cache, v_cache = torch.randn(2, NUM_KV, NUM_BLOCKS, 16, 64).unbind(0)
    reference = TorchAttentionBackend()
    one_long = paged_group([40 * 16 - 3], 16, rng)  # a context the plan cuts into runs
    several = paged_group([5, 17, 33], 16, rng)
    for group in (one_long, several, one_long, one_long):
        q = torch.randn(group.end - group.start, NUM_KV * 4, 64)
        ours = backend._single(q, k_cache, v_cache, group, 0.125, None)
        ref = reference._single(q, k_cache, v_cache, group, 0.125, None)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_few_work_items_run_serially_and_enough_run_on_the_threads():
    assert runs_serially(rows=1, num_kv_heads=3, threads=2)  # single stream, 3 KV heads
    assert not runs_serially(rows=1, num_kv_heads=8, threads=2)
    assert not runs_serially(rows=2, num_kv_heads=2, threads=2)  # two items per thread
    assert runs_serially(rows=64, num_kv_heads=8, threads=1024)


def test_few_work_items_cut_their_contexts_until_each_thread_has_two():
    runs = MIN_RUN_BLOCKS
    assert context_parts(rows=1, num_kv_heads=3, threads=2, blocks=64) == 2  # 6 runs
    assert context_parts(rows=1, num_kv_heads=1, threads=4, blocks=8 * runs) == 8
    assert context_parts(rows=1, num_kv_heads=1, threads=4, blocks=3 * runs) == 3
    assert context_parts(rows=1, num_kv_heads=3, threads=2, blocks=2 * runs - 1) == 1  # short
    assert context_parts(rows=2, num_kv_heads=2, threads=2, blocks=64) == 1  # enough items
    assert context_parts(rows=1, num_kv_heads=1, threads=1, blocks=64) == 1  # one thread


def test_lengths_read_off_the_mask_when_not_given(numba_backend):
    """Tensor-parallel ranks rebuild groups from the step codec without seq_lens: the kernel
    must then take each row's context from the mask, not attend to a padded table's tail."""
    rng = random.Random(7)
    lens = edge_lengths(16, 8, rng)
    with_lens = paged_group(lens, 16, random.Random(1))
    without = paged_group(lens, 16, random.Random(1), with_lens=False)
    k_cache, v_cache = torch.randn(2, NUM_KV, NUM_BLOCKS, 16, 64).unbind(0)
    q = torch.randn(len(lens), 8, 64)
    a = numba_backend._single(q, k_cache, v_cache, with_lens, 0.125, None)
    b = numba_backend._single(q, k_cache, v_cache, without, 0.125, None)
    ref = TorchAttentionBackend()._single(q, k_cache, v_cache, without, 0.125, None)
    assert torch.equal(a, b)
    torch.testing.assert_close(b, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_pool_is_read_exactly(numba_backend):
    """A bfloat16 pool is widened bit for bit: the kernel equals the reference run on the same
    pool converted to float32."""
    rng = random.Random(3)
    lens = edge_lengths(16, 9, rng)
    group = paged_group(lens, 16, rng)
    k_cache, v_cache = torch.randn(2, NUM_KV, NUM_BLOCKS, 16, 64).to(torch.bfloat16).unbind(0)
    q = torch.randn(len(lens), 8, 64)
    assert kernel_takes(q, k_cache, None)
    ours = numba_backend._single(q, k_cache, v_cache, group, 0.125, None)
    ref = TorchAttentionBackend()._single(q, k_cache.float(), v_cache.float(), group, 0.125, None)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_rows_see_keys_written_in_the_same_step(numba_backend):
    """Verify rows of speculation are decode rows whose own and preceding keys/values are
    written in the same step: forward must write the pool before any row attends. Rows here
    attend to positions written only by this forward call (the pool starts at zero there)."""
    rng = random.Random(5)
    block_size, head_dim = 16, 64
    # One request verifying 3 drafts at positions 15..18 (across a block edge), one decode.
    lens = [16, 17, 18, 19, 33]
    group = paged_group(lens, block_size, rng)
    tables = group.block_tables
    tables[:4] = tables[3]  # the verifying request's four rows share its blocks
    slots = [
        int(tables[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
        for r, n in enumerate(lens)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        write_rows=None,
        num_single=len(lens),
        single_groups=[group],
        prefills=[],
    )
    q = torch.randn(len(lens), 8, head_dim)
    k = torch.randn(len(lens), NUM_KV, head_dim)
    # v as the model passes it: a strided view of the fused q/k/v projection's output
    v = torch.randn(len(lens), 3, NUM_KV, head_dim)[:, 1]
    outs, pools = [], []
    for backend in (numba_backend, TorchAttentionBackend()):
        torch.manual_seed(11)
        k_cache = torch.randn(NUM_KV, NUM_BLOCKS, block_size, head_dim)
        v_cache = torch.randn(NUM_KV, NUM_BLOCKS, block_size, head_dim)
        for slot in slots:  # stale values where this step writes
            k_cache.view(NUM_KV, -1, head_dim)[:, slot] = 0
            v_cache.view(NUM_KV, -1, head_dim)[:, slot] = 0
        outs.append(backend.forward(q, k, v, k_cache, v_cache, meta, 0.125))
        pools.append((k_cache, v_cache))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    # The kernel stores the step's keys and values itself: the same pool, bit for bit.
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    # The last row attends to its own fresh value: with a huge score it copies it.
    q_peak = k[-1].repeat_interleave(4, dim=0).unsqueeze(0) * 1e3
    k_cache = torch.zeros(NUM_KV, NUM_BLOCKS, block_size, head_dim)
    v_cache = torch.zeros_like(k_cache)
    last = numba_backend.forward(torch.cat([q[:-1], q_peak]), k, v, k_cache, v_cache, meta, 1.0)[-1]
    torch.testing.assert_close(last, v[-1].repeat_interleave(4, dim=0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_greedy_equals_hf_on_each_cpu_backend(tiny_checkpoints, backend):
    """Both CPU backends through the engine: decode rows of every context length up to ~90
    tokens, block size 16, batched and preempted, give HF's greedy tokens."""
    path = tiny_checkpoints["llama"]
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 15, 16, 17, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(path, num_gpu_blocks_override=512, max_model_len=128, attention_backend=backend)
    assert llm.engine.runner.backend.name == backend
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, 24)


def test_a_request_at_the_context_limit_stays_inside_its_blocks_on_the_kernel(tiny_checkpoints):
    """The in-place kernel has no bounds checks of its own: what a client sends must never
    give it a context past its block table. A request asking past max_model_len decodes HF's
    tokens up to the limit and stops there ("length"); a prompt that fills the limit is refused
    before any step runs."""
    path = tiny_checkpoints["llama"]
    llm = LLM(path, num_gpu_blocks_override=64, max_model_len=48, attention_backend="numba")
    assert llm.engine.runner.backend.name == "numba"
    prompt = [random.Random(9).randrange(5, 500) for _ in range(41)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (7, "length")
    assert_greedy_equal(path, prompt, out.token_ids, 7)
    with pytest.raises(ValueError, match="maximum context length is 48"):
        llm.generate([prompt + prompt[:7]], params, use_tqdm=False)
    llm.engine.close()
