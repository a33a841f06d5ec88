"""The device side of per-sequence recurrent state: one rank's state pool (a slot per running
sequence and per prefix snapshot, every linear-attention layer's part of it), what one step
tells the layers (`StepStates`: each sequence's rows and slot, where to snapshot mid-chunk) and
the moves around the forward pass (`StateMoves`: zero, copy, and to or from KV blocks).

Which slot is whose is the KV manager's decision (kv_cache/state_cache.py); this module only
carries it out. Under tensor parallelism every rank holds its heads' share of the same slots.

P/D: a state crosses engines inside KV blocks (`to_blocks` / `from_blocks`), so the transfer
path (NIXL, TCP, every rank's shard) moves it like any block; its bytes are laid out as
`kv_pool[:, :, :, block_ids]` reads, identical on both sides of a compatible pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagefleet.engine.kv_cache.pool_memory import zeroed
from pagefleet.engine.kv_cache.state_cache import StateMoves, StateStep
from pagefleet.engine.model.config import SequenceStateShape

if TYPE_CHECKING:
    from pagefleet.engine.request import Request


@dataclass
class StateChunk:
    """A prompt chunk's rows [start, start + num_tokens), its sequence's slot, and the offsets
    inside the chunk (1..num_tokens - 1) after which the state is copied to another slot."""

    start: int
    num_tokens: int
    slot: int
    saves: tuple[tuple[int, int], ...] = ()  # (offset, destination slot)


class StatePool:
    """Per linear-attention layer: conv [slots, channels, width] and recurrent
    [slots, heads, key_dim, value_dim] state, in the model's dtype."""

    def __init__(
        self, shape: SequenceStateShape, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape = shape
        self.num_slots = num_slots
        s = shape
        conv_shape = (s.num_layers, num_slots, s.conv_channels, s.conv_width)
        self.conv = zeroed(conv_shape, dtype, device)
        ssm_shape = (s.num_layers, num_slots, s.num_heads, s.key_dim, s.value_dim)
        self.ssm = zeroed(ssm_shape, dtype, device)

    @property
    def bytes_per_slot(self) -> int:
        return self.shape.values * self.conv.element_size()

    def apply(self, moves: StateMoves, kv_pool: torch.Tensor) -> None:
        for slot in moves.resets:
            self.conv[:, slot].zero_()
            self.ssm[:, slot].zero_()
        for slot, blocks in moves.loads:
            self.from_blocks(slot, kv_pool, blocks)
        for src, dst in moves.copies:
            self.conv[:, dst] = self.conv[:, src]
            self.ssm[:, dst] = self.ssm[:, src]
        for slot, blocks in moves.stores:
            self.to_blocks(slot, kv_pool, blocks)

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """The slot's state as bytes: every layer's conv state, then every layer's matrices."""
        parts = (self.conv[:, slot].contiguous(), self.ssm[:, slot].contiguous())
        return torch.cat([p.view(-1).view(torch.uint8) for p in parts])

    def to_blocks(self, slot: int, kv_pool: torch.Tensor, blocks: list[int]) -> None:
        data = self.slot_bytes(slot)
        view = block_bytes_view(kv_pool)
        ids = torch.tensor(blocks, device=kv_pool.device)
        room = torch.zeros(view[:, :, :, ids].shape, dtype=torch.uint8, device=kv_pool.device)
        room.view(-1)[: len(data)] = data
        view[:, :, :, ids] = room

    def from_blocks(self, slot: int, kv_pool: torch.Tensor, blocks: list[int]) -> None:
        ids = torch.tensor(blocks, device=kv_pool.device)
        data = block_bytes_view(kv_pool)[:, :, :, ids].reshape(-1)
        conv_bytes = self.conv[:, slot].numel() * self.conv.element_size()
        dtype = self.conv.dtype
        conv = data[:conv_bytes].view(dtype).view(self.conv[:, slot].shape)
        ssm = data[conv_bytes : conv_bytes + self.bytes_per_slot - conv_bytes].view(dtype)
        self.conv[:, slot] = conv
        self.ssm[:, slot] = ssm.view(self.ssm[:, slot].shape)


def block_bytes_view(kv_pool: torch.Tensor) -> torch.Tensor:
    """The KV pool [layers, 2, heads, blocks, block_size, head_dim] as bytes in its last dim."""
    return kv_pool.view(torch.uint8)


def blocks_for_state(state_bytes: int, block_bytes: int) -> int:
    """KV blocks one sequence's state needs to travel in (P/D)."""
    return -(-state_bytes // block_bytes)


@dataclass
class StepStates:
    """What the linear-attention layers read in one step: `num_single` sequences of one token
    (rows 0.. in order, or `single_rows`; a slot each), then runs of rows read in order
    (prompt chunks, and a verification's rows under speculative decoding); `before` and
    `after` are the slot moves around the forward pass (the runner applies them)."""

    num_single: int
    single_slots: torch.Tensor  # [num_single] int64
    chunks: list[StateChunk]
    single_slot_list: list[int] = field(default_factory=list)  # the same, on the host
    single_rows: list[int] | None = None  # None: rows 0..num_single - 1
    before: StateMoves = field(default_factory=StateMoves)
    after: StateMoves = field(default_factory=StateMoves)
    pool: StatePool | None = None  # this rank's, attached by its runner
    kernels: object = None  # LinearAttnKernels (linear_attn/kernels.py), attached likewise
    scratch: dict = field(default_factory=dict)  # what kernels derive once per step

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state, recurrent state) of linear-attention layer `index`, every slot."""
        return self.pool.conv[index], self.pool.ssm[index]


def step_states(
    step: StateStep | None,
    singles: list[Request],
    chunks: list[tuple[Request, int, int]],
    device: torch.device,
) -> StepStates:
    """The layers' view of a step: single-token rows (one sequence each, in row order), then
    chunks (request, first row, tokens). A snapshot at a chunk's first position is a copy
    before the forward pass, at its end a copy after it, in between a split of the chunk."""
    step = step or StateStep()
    before = StateMoves(list(step.before.resets), list(step.before.loads), list(step.before.copies))
    after = StateMoves(stores=list(step.after.stores))
    # A request with several single rows (verifying drafts, its rows together) is a run.
    runs: list[tuple[Request, int, int]] = []
    for row, req in enumerate(singles):
        if runs and runs[-1][0] is req:
            runs[-1] = (req, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((req, row, 1))
    alone = [(req, row) for req, row, n in runs if n == 1]
    chunks = [run for run in runs if run[2] > 1] + chunks
    spans = [(req, req.num_computed_tokens, 1) for req, _ in alone]
    spans += [(req, req.num_computed_tokens, n) for req, _, n in chunks]
    inside: dict[str, list[tuple[int, int]]] = {}
    for req, start, n in spans:
        for position, dst in step.saves.get(req.request_id, ()):
            if position == start:
                before.copies.append((req.state_slot, dst))
            elif position == start + n:
                after.copies.append((req.state_slot, dst))
            else:
                inside.setdefault(req.request_id, []).append((position - start, dst))
    slots = [req.state_slot for req, _ in alone]
    rows = [row for _, row in alone]
    return StepStates(
        num_single=len(alone),
        single_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        chunks=[
            StateChunk(row, n, req.state_slot, tuple(inside.get(req.request_id, ())))
            for req, row, n in chunks
        ],
        single_slot_list=slots,
        single_rows=None if rows == list(range(len(rows))) else rows,
        before=before,
        after=after,
    )


# ---------------------------------------------------------------------------- to worker ranks


def encode_states(states: StepStates) -> list[int]:
    """The step's state metadata as host ints, for the tensor-parallel step broadcast: single
    slots, chunks (start, tokens, slot, saves, then each save's offset and slot), then the
    moves before and after the forward pass."""
    rows = states.single_rows
    out = [states.num_single, *states.single_slot_list, -1 if rows is None else len(rows)]
    out += [*(rows or ()), len(states.chunks)]
    for c in states.chunks:
        out += [c.start, c.num_tokens, c.slot, len(c.saves), *(x for save in c.saves for x in save)]
    for moves in (states.before, states.after):
        out += [len(moves.resets), *moves.resets]
        out += _encode_block_moves(moves.loads)
        out += [len(moves.copies), *(x for pair in moves.copies for x in pair)]
        out += _encode_block_moves(moves.stores)
    return out


def _encode_block_moves(moves: list[tuple[int, list[int]]]) -> list[int]:
    out = [len(moves)]
    for slot, blocks in moves:
        out += [slot, len(blocks), *blocks]
    return out


class _Ints:
    def __init__(self, ints: list[int]) -> None:
        self.ints, self.at = ints, 0

    def take(self, n: int) -> list[int]:
        self.at += n
        return self.ints[self.at - n : self.at]

    def one(self) -> int:
        return self.take(1)[0]

    def pairs(self) -> list[tuple[int, int]]:
        flat = self.take(2 * self.one())
        return list(zip(flat[::2], flat[1::2], strict=True))

    def block_moves(self) -> list[tuple[int, list[int]]]:
        out = []
        for _ in range(self.one()):
            slot = self.one()
            out.append((slot, self.take(self.one())))
        return out


def decode_states(ints: list[int], device: torch.device) -> StepStates:
    """`encode_states`' inverse (the worker attaches its own pool and kernels)."""
    data = _Ints(ints)
    singles = data.take(data.one())
    num_rows = data.one()
    rows = None if num_rows < 0 else data.take(num_rows)
    chunks = []
    for _ in range(data.one()):
        start, n, slot = data.take(3)
        chunks.append(StateChunk(start, n, slot, tuple(data.pairs())))
    moves = []
    for _ in range(2):
        resets = data.take(data.one())
        loads = data.block_moves()
        copies = data.pairs()
        moves.append(StateMoves(resets, loads, copies, data.block_moves()))
    return StepStates(
        num_single=len(singles),
        single_slots=torch.tensor(singles, dtype=torch.int64, device=device),
        chunks=chunks,
        single_slot_list=singles,
        single_rows=rows,
        before=moves[0],
        after=moves[1],
    )


def single_row_index(states: StepStates, device: torch.device) -> slice | torch.Tensor:
    """The rows of the one-token sequences, for indexing (a slice in the common case)."""
    if states.single_rows is None:
        return slice(0, states.num_single)
    rows = states.scratch.get("single_rows")
    if rows is None:
        rows = torch.tensor(states.single_rows, dtype=torch.int64, device=device)
        states.scratch["single_rows"] = rows
    return rows
