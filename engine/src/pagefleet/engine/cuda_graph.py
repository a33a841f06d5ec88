"""CUDA graphs for decode-only steps: the model forward captured once per padded batch size at
start-up, then replayed with the step's inputs copied into static buffers.

A decode step launches a few hundred small kernels; replaying a graph removes their launch cost,
which dominates at small batches. Steps with prompt chunks, or more rows than the largest
captured size, run eagerly. Padding rows have context length 0 and slot -1: the kernels skip them.
`--enforce-eager` turns all of this off.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from pagefleet.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKV,
    PagedBatch,
)

logger = logging.getLogger("pagefleet.engine")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_rows, or None when none does."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """Static inputs every captured graph reads (each size uses a leading slice)."""

    input_ids: torch.Tensor  # [max] int64
    positions: torch.Tensor  # [max] int64
    slots: torch.Tensor  # [max] int64
    seq_lens: torch.Tensor  # [max] int32
    block_tables: torch.Tensor  # [max, max_blocks] int32
    query_start: torch.Tensor  # [max + 1] int32, fixed: one query row per sequence
    work_seq: torch.Tensor  # [max] int32, fixed: program i takes sequence i
    work_q: torch.Tensor  # [max] int32, fixed zeros

    @classmethod
    def allocate(cls, max_rows: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_rows),
            positions=zeros(max_rows),
            slots=torch.full((max_rows,), -1, dtype=torch.int64, device=device),
            seq_lens=zeros(max_rows, dtype=torch.int32),
            block_tables=zeros(max_rows, max_blocks, dtype=torch.int32),
            query_start=torch.arange(max_rows + 1, dtype=torch.int32, device=device),
            work_seq=torch.arange(max_rows, dtype=torch.int32, device=device),
            work_q=zeros(max_rows, dtype=torch.int32),
        )

    def batch(self, size: int, max_context: int) -> PagedBatch:
        return PagedBatch(
            query_start=self.query_start[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slots=self.slots[:size],
            work_seq=self.work_seq[:size],
            work_q=self.work_q[:size],
            max_query_len=1,
            max_context=max_context,
        )

    def fill(self, input_ids, positions, flat: PagedBatch, size: int) -> None:
        """Copy a step of n rows in; rows n..size become padding."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(flat.slots)
        self.slots[n:size].fill_(-1)
        self.seq_lens[:n].copy_(flat.seq_lens)
        self.seq_lens[n:size].fill_(0)
        width = flat.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(flat.block_tables)


class DecodeGraphs:
    """The model's decode forward at each padded batch size, as CUDA graphs (or, with
    use_graphs=False, the same static-buffer forward run eagerly: what CPU tests check)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[LayerKV],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        max_blocks = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, size: int) -> torch.Tensor:
        buf = self.buffers
        # The split-KV choice depends on max_context: use the longest possible, so one graph
        # serves every context length.
        meta = AttentionMetadata(
            slot_mapping=buf.slots[:size],
            write_rows=None,
            num_single=size,
            single_groups=[],
            prefills=[],
            paged=buf.batch(size, self.max_model_len),
        )
        return self.model(
            buf.input_ids[:size], buf.positions[:size], self.backend, self.kv_caches, meta
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            # Warm-up on a side stream (as torch.cuda.graph's docs advise): compiles the
            # kernels and settles allocations before capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "Captured CUDA graphs for decode batch sizes %s in %.1f s",
            self.sizes,
            time.perf_counter() - start,
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Hidden states of a decode-only step, or None when the step must run eagerly."""
        n = input_ids.shape[0]
        size = padded_batch_size(n, self.sizes)
        if meta.prefills or n == 0 or size is None:
            return None
        flat = meta.paged
        if flat is None:
            from pagefleet.engine.attention.triton_backend import flatten_metadata

            flat = flatten_metadata(meta, group=1, head_dim=1)  # decode rows: tiles unused
        self.buffers.fill(input_ids, positions, flat, size)
        if self.use_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
