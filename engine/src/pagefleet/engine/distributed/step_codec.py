"""One step's forward inputs as one flat int64 tensor, for rank 0 to broadcast to the worker
ranks (two broadcasts a step: a 3-int head, then the body; no pickling). The same head also
says stop, or announces a KV-transfer command (distributed/kv_ranks.py).

Body: descriptors (counts, then (start, end, width) per single-row group and (start, tokens,
computed, blocks) per prompt chunk), then the data: input ids, positions, slots, write rows,
each group's block tables and context lengths (workers rebuild its mask from them and keep
them as the group's seq_lens, the in-place kernel's bound), each chunk's block
ids, and the rows whose logits are computed (sampled rows, then prompt-logprob rows); for a hybrid
model, last, the step's state metadata (linear_attn/state.py's encode_states).
A request verifying k drafts is already 1 + k single rows and 1 + k logit rows here: the
workers run rank 0's rows as given and never need the drafts themselves.
"""

from __future__ import annotations

import torch

from pagefleet.engine.attention.backend import AttentionMetadata, PrefillChunk, SingleGroup
from pagefleet.engine.linear_attn.state import decode_states, encode_states

OP_STOP = 0
OP_STEP = 1
OP_KV = 2  # a KV-transfer command for the ranks' NIXL agents: a uint8 body (kv_ranks.py)
HEAD_LEN = 3  # (op, body length, descriptor length)
# rows, slots, write rows (-1: all), num_single, groups, chunks, logit rows, state ints (-1: none)
_COUNTS = 8


def encode_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    logit_rows: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, body) on the inputs' device: every piece is joined in one cat, with no copy to
    the host (the descriptors come from host-side ints)."""
    device = input_ids.device
    groups, chunks = meta.single_groups, meta.prefills
    writes = -1 if meta.write_rows is None else len(meta.write_rows)
    states = [] if meta.states is None else encode_states(meta.states)
    desc = [
        len(input_ids),
        len(meta.slot_mapping),
        writes,
        meta.num_single,
        len(groups),
        len(chunks),
        len(logit_rows),
        -1 if meta.states is None else len(states),
    ]
    for g in groups:
        desc += [g.start, g.end, g.block_tables.shape[1]]
    for c in chunks:
        desc += [c.start, c.num_tokens, c.num_computed, len(c.block_ids)]
    pieces = [
        torch.tensor(desc, dtype=torch.int64, device=device),
        input_ids,
        positions,
        meta.slot_mapping,
    ]
    if meta.write_rows is not None:
        pieces.append(meta.write_rows)
    for g in groups:
        lens = g.mask.view(g.end - g.start, -1).sum(1) if g.seq_lens is None else g.seq_lens
        pieces += [g.block_tables.flatten(), lens.to(device)]
    pieces += [c.block_ids for c in chunks]
    pieces.append(torch.tensor(logit_rows, dtype=torch.int64, device=device))
    pieces.append(torch.tensor(states, dtype=torch.int64, device=device))
    body = torch.cat(pieces)
    head = torch.tensor([OP_STEP, len(body), len(desc)], dtype=torch.int64, device=device)
    return head, body


def stop_head(device: torch.device) -> torch.Tensor:
    return torch.tensor([OP_STOP, 0, 0], dtype=torch.int64, device=device)


def kv_head(num_bytes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([OP_KV, num_bytes, 0], dtype=torch.int64, device=device)


def decode_step(
    body: torch.Tensor, desc_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(input_ids, positions, meta, logit_rows) from a body, on the body's device."""
    desc = body[:desc_len].tolist()
    rows, num_slots, writes, num_single, num_groups, num_chunks, num_logits, num_state = desc[
        :_COUNTS
    ]
    at = _COUNTS
    group_desc = [desc[at + 3 * i : at + 3 * i + 3] for i in range(num_groups)]
    at += 3 * num_groups
    chunk_desc = [desc[at + 4 * i : at + 4 * i + 4] for i in range(num_chunks)]
    data = _Reader(body, desc_len)
    input_ids, positions = data.take(rows), data.take(rows)
    slots = data.take(num_slots)
    write_rows = None if writes < 0 else data.take(writes)
    groups = []
    for start, end, width in group_desc:
        tables = data.take((end - start) * width).view(end - start, width)
        lens = data.take(end - start)
        span = torch.arange(width * block_size, device=body.device)
        mask = (span.unsqueeze(0) < lens.unsqueeze(1)).view(1, end - start, 1, width * block_size)
        groups.append(SingleGroup(start, end, tables, mask, lens))
    chunks = [
        PrefillChunk(start, n, computed, data.take(blocks))
        for start, n, computed, blocks in chunk_desc
    ]
    logit_rows = data.take(num_logits)
    meta = AttentionMetadata(
        slot_mapping=slots,
        write_rows=write_rows,
        num_single=num_single,
        single_groups=groups,
        prefills=chunks,
    )
    if num_state >= 0:
        meta.states = decode_states(data.take(num_state).tolist(), body.device)
    return input_ids, positions, meta, logit_rows


class _Reader:
    """Consecutive slices of the body."""

    def __init__(self, body: torch.Tensor, offset: int) -> None:
        self.body, self.offset = body, offset

    def take(self, n: int) -> torch.Tensor:
        piece = self.body[self.offset : self.offset + n]
        self.offset += n
        return piece
