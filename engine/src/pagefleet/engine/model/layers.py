"""Layers the model families share: RMSNorm, paged attention with fused q/k/v, the gated MLP,
and the tensor-parallel split of each (column-parallel in, row-parallel out).

Every layer attaches its parameters' weight loaders (model/weights.py) as it builds them: it
knows which checkpoint projections fuse into which rows and which slice its rank holds. Linear
layers come from `column_linear`, `output_linear` and `lm_head`, which describe the layer
(`LinearSpec`) and leave its weights to a method (model/linear.py): float unless the
checkpoint's quantization chooses another one for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.model.config import ModelConfig
from pagefleet.engine.model.linear import (
    FLOAT,
    Linear,
    LinearMethod,
    LinearSpec,
    ParallelLMHead,
    RowParallelLinear,
    linear_add,
)
from pagefleet.engine.model.parallel import Collectives, TPLayout, VocabParallelEmbedding
from pagefleet.engine.model.weights import Slice, set_weight_loader, vocab_loader, whole_loader


@dataclass(frozen=True)
class TPParts:
    """A rank's share of the model and the group its layers reduce over (None on one rank)."""

    layout: TPLayout
    group: Collectives
    # How MoE tokens meet experts placed on ranks (--all2all-backend; model/expert_parallel.py).
    all2all_backend: str = "allgather_reducescatter"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        set_weight_loader(self, "weight", whole_loader())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            # numba is imported where a float32 CPU step needs it, not by every importer
            from pagefleet.engine.model import numba_ops

            if numba_ops.norm_applies(x, self.weight):
                return numba_ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def column_linear(
    in_features: int,
    parts: dict[str, int],
    pieces: dict[str, Slice | None],
    bias: bool,
    method: LinearMethod = FLOAT,
) -> Linear:
    """A linear whose output rows stack checkpoint projections (`parts`: rows of each on this
    rank, in order), each read as `pieces[part]` of its checkpoint rows (None: all of it)."""
    return Linear(LinearSpec(in_features, dict(parts), dict(pieces), bias=bias), method)


def output_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    tp: TPParts | None,
    method: LinearMethod = FLOAT,
) -> Linear:
    """o_proj / down_proj: a plain linear on one rank, row-parallel over several (each rank
    reads its `in_features` columns; the bias is whole on every rank, added once)."""
    if tp is None:
        return Linear(LinearSpec(in_features, {None: out_features}, bias=bias), method)
    cols = Slice(1, tp.layout.rank * in_features, in_features)
    full = in_features * tp.layout.size
    spec = LinearSpec(in_features, {None: out_features}, cols=cols, bias=bias, in_full=full)
    return RowParallelLinear(spec, tp.group, method)


def embedding(cfg: ModelConfig, tp: TPParts | None) -> nn.Module:
    if tp is None:
        # Given its weight, nn.Embedding skips the random init, which under the loader's meta
        # device went through torch's reference ops and imported torch._dynamo (0.8 s a start).
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        layer = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        set_weight_loader(layer, "weight", whole_loader())
        return layer
    layer = VocabParallelEmbedding(tp.layout, cfg.hidden_size, tp.group)
    set_weight_loader(layer, "weight", vocab_loader(_vocab_slice(tp.layout)))
    return layer


def lm_head(cfg: ModelConfig, tp: TPParts | None, method: LinearMethod = FLOAT) -> Linear:
    """The LM head: whole on one rank; under tensor parallelism each rank scores its slice of
    the vocabulary (padded on the last rank) and rank 0 gathers them."""
    if tp is None:
        return Linear(LinearSpec(cfg.hidden_size, {None: cfg.vocab_size}), method)
    layout = tp.layout
    spec = LinearSpec(cfg.hidden_size, {None: layout.vocab_per_rank}, {None: _vocab_slice(layout)})
    return ParallelLMHead(spec, layout.vocab_size, tp.group, method)


def _vocab_slice(layout: TPLayout) -> Slice:
    return Slice(0, layout.vocab_start, layout.vocab_end - layout.vocab_start)


class Attention(nn.Module):
    """Self-attention over the paged KV pool: q/k/v in one matmul (loaded from the checkpoint's
    three projections), optional per-head q/k RMSNorm (Qwen3), rotary positions."""

    # Rows of q_proj per query head, in head dims: 1, or 2 where each head's query is followed
    # by its output gate (model/hybrid.py's GatedAttention).
    q_rows_per_head = 1

    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TPParts | None = None) -> None:
        super().__init__()
        self.kv_slot = cfg.kv_slot(layer_index)
        self.num_heads = tp.layout.num_heads if tp else cfg.num_heads
        self.num_kv_heads = tp.layout.num_kv_heads if tp else cfg.num_kv_heads
        self.head_dim = hd = cfg.head_dim
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        self.scale = hd**-0.5
        q_rows = self.q_size * self.q_rows_per_head
        pieces: dict[str, Slice | None] = {"q": None, "k": None, "v": None}
        if tp is not None:
            layout = tp.layout
            kv_piece = Slice(0, layout.first_kv_head * hd, self.kv_size)
            pieces = {"q": Slice(0, layout.rank * q_rows, q_rows), "k": kv_piece}
            pieces["v"] = kv_piece
        sizes = {"q": q_rows, "k": self.kv_size, "v": self.kv_size}
        self.qkv_proj = column_linear(cfg.hidden_size, sizes, pieces, cfg.qkv_bias)
        self.o_proj = output_linear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, positions, rope, backend, kv_caches, meta, residual):
        """residual + this layer's attention output (the residual's storage may be reused)."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k)
        cache = kv_caches[self.kv_slot]  # a LayerKV (attention/backend.py)
        out = backend.forward(q, k, v, cache.k_cache, cache.v_cache, meta, self.scale, cache.scales)
        return linear_add(self.o_proj, out.reshape(-1, self.q_size), residual)

    def prepack(self) -> None:
        self.qkv_proj.prepack()
        self.o_proj.prepack()


class MLP(nn.Module):
    """SiLU-gated MLP: gate and up in one matmul (loaded from the checkpoint's two)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPParts | None = None,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        full = intermediate_size or cfg.intermediate_size
        size = full // tp.layout.size if tp else full
        self.intermediate = size
        piece = Slice(0, tp.layout.rank * size, size) if tp else None
        sizes = {"gate": size, "up": size}
        self.gate_up_proj = column_linear(
            cfg.hidden_size, sizes, {"gate": piece, "up": piece}, cfg.mlp_bias
        )
        self.down_proj = output_linear(size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + this MLP's output (the residual's storage may be reused)."""
        fused = self.gate_up_proj(x)
        # narrow, not split: autograd refuses in-place ops on split's views even where no
        # gradient is wanted (benchmarks call the model outside inference mode).
        gate = fused.narrow(-1, 0, self.intermediate)
        up = fused.narrow(-1, self.intermediate, self.intermediate)
        # SiLU in place over the gate half (a view of the fused output nothing else reads),
        # then one product: one temporary instead of two.
        return linear_add(self.down_proj, torch.mul(F.silu(gate, inplace=True), up), residual)

    def prepack(self) -> None:
        self.gate_up_proj.prepack()
        self.down_proj.prepack()
