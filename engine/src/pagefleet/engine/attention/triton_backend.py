"""The GPU attention backend: the torch backend's interface on Triton kernels.

Each step's metadata is flattened once (see PagedBatch) and reused by every layer; CUDA-graph
decode hands in a PagedBatch of static buffers instead. On CPU the kernels run only under
Triton's interpreter (TRITON_INTERPRET=1 before the kernels are imported), which is how tests
check them against the torch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton import knobs

from pagefleet.engine.attention.backend import AttentionMetadata, PagedBatch
from pagefleet.engine.attention.triton_kernels import (
    choose_num_splits,
    paged_attention,
    reshape_and_cache,
    tile_config,
)


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, num_sms: int, num_splits: int | None = None) -> None:
        self.num_sms = num_sms
        self.num_splits = num_splits  # None: choose per step (choose_num_splits)
        # The last step's flat batch: layers after the first reuse it.
        self._last: tuple[AttentionMetadata, PagedBatch] | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> TritonAttentionBackend:
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return cls(props.multi_processor_count)
        if knobs.runtime.interpret:
            return cls(num_sms=1)
        raise ValueError(
            "the Triton attention backend needs a CUDA device; use --attention-backend torch on "
            "CPU (tests run the kernels on CPU with TRITON_INTERPRET=1)"
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        num_kv_heads = k_cache.shape[0]
        group = q.shape[1] // num_kv_heads
        batch = meta.paged if meta.paged is not None else self._flat(meta, group, q.shape[2])
        reshape_and_cache(k, v, k_cache, v_cache, batch.slots, kv_scale)
        tiles = tile_config(group, q.shape[2], batch.max_query_len)
        splits = self.num_splits or choose_num_splits(
            batch.work_seq.shape[0] * num_kv_heads, batch.max_context, self.num_sms
        )
        return paged_attention(
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start,
            batch.work_seq,
            batch.work_q,
            tiles,
            splits,
            scale,
            kv_scale=kv_scale,
        )

    def _flat(self, meta: AttentionMetadata, group: int, head_dim: int) -> PagedBatch:
        if self._last is None or self._last[0] is not meta:
            self._last = (meta, flatten_metadata(meta, group, head_dim))
        return self._last[1]


def flatten_metadata(meta: AttentionMetadata, group: int, head_dim: int) -> PagedBatch:
    """The step's single rows and prompt chunks as flat sequences, with the attention
    kernel's work list for the tile shape this batch will use."""
    lens: list[torch.Tensor] = []
    tables: list[torch.Tensor] = []
    query_lens: list[int] = []
    max_context = 0
    for g in meta.single_groups:
        rows = g.end - g.start
        lens.append(g.mask.reshape(rows, -1).sum(-1))  # the mask is `position < context`
        tables.append(g.block_tables)
        query_lens.extend([1] * rows)
        max_context = max(max_context, g.mask.shape[-1])
    chunk_lens = [c.num_computed + c.num_tokens for c in meta.prefills]
    for chunk in meta.prefills:
        tables.append(chunk.block_ids.view(1, -1))
        query_lens.append(chunk.num_tokens)
    max_context = max([max_context, *chunk_lens])
    device = meta.slot_mapping.device
    if chunk_lens:
        lens.append(torch.tensor(chunk_lens).to(device))
    max_query_len = max(query_lens, default=1)
    block_q = tile_config(group, head_dim, max_query_len).block_q
    work_seq, work_q = work_list(query_lens, block_q)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    width = max((t.shape[1] for t in tables), default=1)
    padded = [F.pad(t, (0, width - t.shape[1])) for t in tables]
    return PagedBatch(
        query_start=_int32(starts, device),
        seq_lens=torch.cat(lens).to(torch.int32) if lens else _int32([], device),
        block_tables=(
            torch.cat(padded).to(torch.int32)
            if padded
            else torch.zeros(0, 1, dtype=torch.int32, device=device)
        ),
        slots=_row_slots(meta, starts[-1]),
        work_seq=_int32(work_seq, device),
        work_q=_int32(work_q, device),
        max_query_len=max_query_len,
        max_context=max_context,
    )


def work_list(query_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """(sequence, first query row) of each attention program: block_q rows per program."""
    seqs: list[int] = []
    firsts: list[int] = []
    for seq, n in enumerate(query_lens):
        for first in range(0, n, block_q):
            seqs.append(seq)
            firsts.append(first)
    return seqs, firsts


def _row_slots(meta: AttentionMetadata, num_rows: int) -> torch.Tensor:
    """The slot of every row, -1 for rows that are not written."""
    if meta.write_rows is None:
        return meta.slot_mapping
    slots = torch.full((num_rows,), -1, dtype=torch.int64, device=meta.slot_mapping.device)
    slots[meta.write_rows] = meta.slot_mapping
    return slots


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device)
