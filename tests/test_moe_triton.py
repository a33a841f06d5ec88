"""The Triton fused experts (model/fused_moe.py) against the torch grouped path, in one
spawned worker with TRITON_INTERPRET=1 (see test_triton_attention.py for why a worker): random
routing over prompt- and decode-sized batches, every token on the same experts (three idle),
and an expert-parallel rank's share (pairs of the other rank's experts add nothing)."""

from __future__ import annotations

import moe_interpret_cases as cases
import pytest
import torch

from pagefleet.engine.model.fused_moe import align_pairs

CASES = {
    "prompt-random": ("random", 37, 0, 5),
    "decode-one-token": ("random", 1, 0, 5),
    "same-experts": ("same-experts", 9, 0, 5),
    "rank-1-of-2": ("random", 11, 3, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_kernel_equals_the_grouped_path(interpreter, name):
    fused, reference = interpreter(cases.run, *CASES[name])
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    assert reference.abs().sum() > 0


def test_pairs_are_laid_out_in_whole_blocks_per_expert():
    """Experts 1..3 of this rank, blocks of 4 rows: expert 1 has pairs 0, 3, 4 (one block),
    expert 2 none, expert 3 pairs 2 and 5 (one block); pair 1 is expert 0's, another rank's."""
    ids = torch.tensor([[1, 0], [3, 1], [1, 3]])
    pairs, block_expert = align_pairs(ids, first=1, count=3, block_m=4)
    none = ids.numel()
    assert block_expert[:2].tolist() == [0, 2] and (block_expert[2:] == -1).all()
    assert pairs[:8].tolist() == [0, 3, 4, none, 2, 5, none, none]
    assert (pairs[8:] == none).all()
