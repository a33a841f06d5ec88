"""The attention interface between model code and paged-attention implementations.

A step's tokens are flattened: first the single-token rows (decodes, and the one-token
recompute after a full prefix hit), then each prompt chunk. Keys/values are written into the
paged pool through `slot_mapping`; reads go through block tables. Backends differ only in how
they do these two things (torch reference on CPU, Triton on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    num_computed: int  # tokens of the request already in the cache before this chunk
    block_ids: torch.Tensor  # [ceil((num_computed + num_tokens) / block_size)] int64


@dataclass
class SingleGroup:
    """Consecutive single-token rows attended together. Rows are sorted by context length and
    grouped so a group's gathered keys stay small (cache-resident) and padding stays low."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, max_blocks] int64, padded with block 0
    mask: torch.Tensor  # [1, rows, 1, max_blocks * block_size] bool, True = attend
    # Context length of each row, on the host (the in-place kernel's bound); None: read the mask.
    seq_lens: torch.Tensor | None = None  # [rows] int64
    # What a backend works out once for all the layers of the step, by its key (the in-place
    # kernel's plan per KV-head count: attention/numba_paged.py). Filled on first use.
    plans: dict = field(default_factory=dict, compare=False, repr=False)


# A group of single rows holds at most this many padded context tokens (about 2.5 MB of keys
# and values for a 57M model's layer) or this many rows.
GROUP_TOKENS = 16 * 640
GROUP_ROWS = 32


def single_groups(
    tables: list[list[int]], lens: torch.Tensor, block_size: int, device: torch.device
) -> list[SingleGroup]:
    """A step's single-token rows (sorted by context length: `tables` their block tables,
    `lens` their context lengths) in groups of at most GROUP_ROWS rows and GROUP_TOKENS padded
    tokens."""
    groups: list[SingleGroup] = []
    start = 0
    while start < len(tables):
        end = start + 1
        # Rows are sorted by length, so the last row of a group has its longest table.
        while (
            end < len(tables)
            and end - start < GROUP_ROWS
            and (end + 1 - start) * len(tables[end]) * block_size <= GROUP_TOKENS
        ):
            end += 1
        width = max(len(t) for t in tables[start:end])  # the last's, sorted by length
        padded = [t + [0] * (width - len(t)) for t in tables[start:end]]
        mask = torch.arange(width * block_size).unsqueeze(0) < lens[start:end].unsqueeze(1)
        groups.append(
            SingleGroup(
                start,
                end,
                torch.tensor(padded, dtype=torch.int64, device=device),
                mask.view(1, end - start, 1, width * block_size).to(device),
                lens[start:end],
            )
        )
        start = end
    return groups


@dataclass
class PagedBatch:
    """The step as flat sequences, for kernels that take the whole batch in one launch (the
    Triton backend). Sequence s owns query rows query_start[s]:query_start[s + 1] and attends to
    its first seq_lens[s] tokens; programs of the attention kernel are listed as (sequence,
    first query row within it). Padding sequences have seq_len 0 and slot -1."""

    query_start: torch.Tensor  # [seqs + 1] int32
    seq_lens: torch.Tensor  # [seqs] int32
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, padded with block 0
    slots: torch.Tensor  # [rows] int64, -1 = do not write the row
    work_seq: torch.Tensor  # [programs] int32
    work_q: torch.Tensor  # [programs] int32
    max_query_len: int
    max_context: int  # an upper bound of seq_lens, known on the host


@dataclass
class AttentionMetadata:
    # Pool slot of each written row; rows in `skip_write_rows` are not written (their
    # keys/values are already in a shared cached block).
    slot_mapping: torch.Tensor  # [rows written] int64
    write_rows: torch.Tensor | None  # rows to write, or None for all rows
    num_single: int  # leading rows that attend alone (query length 1)
    single_groups: list[SingleGroup]
    prefills: list[PrefillChunk]
    # Set by whoever already has the batch in flat form (CUDA-graph decode); otherwise the
    # Triton backend derives it from the fields above once per step.
    paged: PagedBatch | None = None
    # A hybrid model's linear-attention layers: each sequence's state slot and the step's
    # state moves (linear_attn.state.StepStates); None for a model with attention only.
    states: object | None = None


class KVCache(Protocol):
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerKV(NamedTuple):
    """One layer's views of the pool, and its (k_scale, v_scale) when the pool is fp8 (values
    are stored divided by the scale; None: stored as they are)."""

    k_cache: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor
    scales: tuple[float, float] | None = None


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: tuple[float, float] | None = None,  # an fp8 cache's (k_scale, v_scale)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


@dataclass(frozen=True)
class DecodeShape:
    """What a decode step's attention reads, per layer of this rank: query and KV heads, head
    size, block size, and the dtypes of the queries and of the pool."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype

    def subject(self) -> str:
        kv = str(self.kv_dtype).removeprefix("torch.")
        q = str(self.dtype).removeprefix("torch.")
        return (
            f"attention {self.num_heads}/{self.num_kv_heads} heads x {self.head_dim}, "
            f"block {self.block_size}, {q} over {kv}"
        )


BACKENDS = ("torch", "numba", "triton")
NUMBA_KV_DTYPES = (torch.float32, torch.bfloat16)  # the pools the in-place kernel reads


def default_backend_name(device: torch.device, shape: DecodeShape | None = None) -> str:
    """triton on CUDA. On CPU, the torch gather path or the in-place paged kernel ("numba"),
    whichever measures faster on this machine for `shape` (attention/cpu_auto.py); torch where
    no shape is given."""
    if device.type == "cuda":
        return "triton"
    if device.type != "cpu" or shape is None:
        return "torch"
    from pagefleet.engine.attention.cpu_auto import cpu_backend_choice

    return cpu_backend_choice(shape).name


def select_backend(
    name: str | None, device: torch.device, shape: DecodeShape | None = None
) -> AttentionBackend:
    """The backend for `--attention-backend` (None or "auto": see default_backend_name). Its
    `explicit` says whether the flag named it: a backend the measurement chose leaves a
    single-stream step's attention to model/one_row_decode.py's fused layers."""
    measured = name in (None, "auto")
    backend = _backend_named(
        default_backend_name(device, shape) if measured else name, device, shape
    )
    backend.explicit = not measured
    return backend


def _backend_named(name: str, device: torch.device, shape: DecodeShape | None):
    if name == "torch":
        from pagefleet.engine.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "numba":
        from pagefleet.engine.attention.numba_paged import NumbaAttentionBackend

        return NumbaAttentionBackend(shape.kv_dtype if shape is not None else None)
    if name == "triton":
        from pagefleet.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend.for_device(device)
    raise ValueError(
        f"attention backend {name!r} is not available (--attention-backend): "
        f"one of {', '.join(BACKENDS)}"
    )
