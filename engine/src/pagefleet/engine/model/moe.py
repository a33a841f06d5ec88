"""The mixture-of-experts layer the MoE families share: a top-k router, the experts
(model/experts.py), an optional shared expert behind a sigmoid gate (Qwen3.5-MoE), and the
combine over ranks (one all-reduce; model/expert_parallel.py for the alternatives). Also the
decoder layer and model those families build, and the router's load counters (/metrics).

Checkpoint names: `experts.{e}.gate_proj|up_proj|down_proj` (Qwen) or `w1|w3|w2` (Mixtral) load
into the stacked `experts.w13` / `experts.w2` with (expert id, projection) as the part;
`experts.gate_up_proj` / `experts.down_proj` (every expert in one tensor) fill all at once.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.model.causal_lm import FUSED_PROJECTIONS, CausalLM
from pagefleet.engine.model.config import ModelConfig
from pagefleet.engine.model.expert_load import ExpertLoadStats, summarise
from pagefleet.engine.model.expert_parallel import make_dispatch
from pagefleet.engine.model.experts import GATE_UP, FusedExperts, count_per_expert
from pagefleet.engine.model.layers import MLP, Attention, RMSNorm, TPParts, column_linear
from pagefleet.engine.model.packed import pack_children
from pagefleet.engine.model.parallel import ExpertShard, expert_ranges
from pagefleet.engine.model.weights import Slice, set_weight_loader, whole_loader


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, expert ids [tokens, top_k]): the top-k
    of the softmax, taken in float32, renormalised to sum to 1 when `normalize`; each token's
    experts in ascending id order (the order their outputs are summed in, as HF's loop)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    ids, slots = ids.sort(dim=-1)
    return top.gather(-1, slots).to(logits.dtype), ids


def _plain_linear(in_features: int, out_features: int, piece: Slice | None = None) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    set_weight_loader(layer, "weight", whole_loader(piece))
    return layer


class SharedExpert(nn.Module):
    """Qwen3.5-MoE's expert every token goes through, its output scaled by sigmoid(gate(x)).
    Tensor-parallel like the dense MLP, but its down projection is left unreduced: the MoE
    block sums it with the routed experts' partial in the layer's one all-reduce."""

    def __init__(self, cfg: ModelConfig, size: int, tp: TPParts | None) -> None:
        super().__init__()
        ranks, rank = (tp.layout.size, tp.layout.rank) if tp else (1, 0)
        self.columns = cols = size // ranks
        piece = Slice(0, rank * cols, cols) if ranks > 1 else None
        self.gate_up_proj = column_linear(
            cfg.hidden_size, {"gate": cols, "up": cols}, {"gate": piece, "up": piece}, False
        )
        down_piece = Slice(1, rank * cols, cols) if ranks > 1 else None
        self.down_proj = _plain_linear(cols, cfg.hidden_size, down_piece)
        self.gate = _plain_linear(cfg.hidden_size, 1)  # checkpoint: shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        act = F.silu(h[:, : self.columns]) * h[:, self.columns :]
        return torch.sigmoid(self.gate(x)) * self.down_proj(act)

    def prepack(self) -> None:
        pack_children(self, ("gate_up_proj", "down_proj", "gate"))


class SparseMoeBlock(nn.Module):
    """Router → experts (+ shared expert) → one all-reduce over ranks → added to the residual.
    Counts the (token, expert) assignments of every step for the load metrics."""

    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TPParts | None = None) -> None:
        super().__init__()
        spec = cfg.moe
        assert spec is not None
        self.layer_index = layer_index
        self.num_experts, self.top_k, self.normalize = (
            spec.num_experts,
            spec.top_k,
            spec.norm_topk_prob,
        )
        self.gate = _plain_linear(cfg.hidden_size, spec.num_experts)  # replicated router
        shard = tp.layout.experts if tp else None
        shard = shard or ExpertShard(0, spec.num_experts, 0, spec.intermediate_size)
        self.experts = FusedExperts(cfg.hidden_size, spec, shard)
        size = spec.shared_expert_intermediate_size
        self.shared_expert = SharedExpert(cfg, size, tp) if size else None
        self.group = tp.group if tp else None
        ep = bool(tp and tp.layout.expert_parallel)
        backend = tp.all2all_backend if tp else ""
        self.dispatch = make_dispatch(self.group, spec.num_experts, ep, backend)
        self.routed: torch.Tensor | None = None  # assignments per expert, made on first use

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + this layer's output (the residual's storage may be reused)."""
        weights, ids = route(self.gate(x), self.top_k, self.normalize)
        counts = count_per_expert(ids, self.num_experts)
        if self.routed is None:
            self.routed = torch.zeros_like(counts)
        self.routed += counts
        out = self.dispatch(self.experts, x, weights, ids, counts)
        shared = self.shared_expert(x) if self.shared_expert is not None else None
        if self.group is not None and self.dispatch.reduces:
            if shared is not None:
                out += shared
            out = self.group.all_reduce(out)
        elif shared is not None:
            out += self.group.all_reduce(shared) if self.group is not None else shared
        return residual.add_(out)

    def prepack(self) -> None:
        self.experts.prepack()
        pack_children(self, ("gate",))
        if self.shared_expert is not None:
            self.shared_expert.prepack()


def sparse_or_dense_mlp(cfg: ModelConfig, layer_index: int, tp: TPParts | None) -> nn.Module:
    if cfg.is_sparse(layer_index):
        return SparseMoeBlock(cfg, layer_index, tp)
    return MLP(cfg, tp)


class MoEDecoderLayer(nn.Module):
    """Pre-norm attention then a pre-norm MoE block (or, in a dense layer, MLP)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TPParts | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = sparse_or_dense_mlp(cfg, layer_index, tp)

    def forward(self, x, positions, rope, backend, kv_caches, meta):
        h = self.input_layernorm(x)
        x = self.self_attn(h, positions, rope, backend, kv_caches, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    def prepack(self) -> None:
        self.self_attn.prepack()
        self.mlp.prepack()


# One expert's projection: (our stacked parameter, the projection's name in it).
EXPERT_PROJECTIONS = {
    "gate_proj": ("w13", "gate"),
    "up_proj": ("w13", "up"),
    "down_proj": ("w2", "down"),
    "w1": ("w13", "gate"),  # Mixtral
    "w3": ("w13", "up"),
    "w2": ("w2", "down"),
}
_ONE_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
# An expert's tensor other than a float weight: a quantized format's (qweight, scales...).
_QUANTIZED_EXPERT = re.compile(r"\.experts\.(\d+\.)?\w+\.(?!weight$)\w+$")
# Every expert in one tensor: (our parameter, the projections it stacks along dim 1).
_ALL_EXPERTS = {"gate_up_proj": ("w13", GATE_UP), "down_proj": ("w2", ("down",))}


class MoECausalLM(CausalLM):
    """A decoder whose sparse layers hold experts: checkpoint names of experts map to the
    stacked parameters, and the router's counts summarise into `expert_load()`."""

    fused_projections: ClassVar[dict[str, tuple[str, str]]] = {
        **FUSED_PROJECTIONS,
        "shared_expert.gate_proj": ("shared_expert.gate_up_proj", "gate"),
        "shared_expert.up_proj": ("shared_expert.gate_up_proj", "up"),
    }
    # Checkpoint name pieces of a family's own naming, replaced by ours first.
    renames: ClassVar[dict[str, str]] = {".shared_expert_gate.": ".shared_expert.gate."}

    def checkpoint_target(self, name: str) -> tuple[str, Hashable] | None:
        for theirs, ours in self.renames.items():
            name = name.replace(theirs, ours)
        if _QUANTIZED_EXPERT.search(name):
            raise ValueError(
                f"{name}: quantized experts are not supported yet (the experts load float "
                "weights only); serve the checkpoint's float (or bf16) release"
            )
        one = _ONE_EXPERT.match(name)
        if one and one.group(3) in EXPERT_PROJECTIONS:
            param, proj = EXPERT_PROJECTIONS[one.group(3)]
            return f"{one.group(1)}.{param}".removeprefix("model."), (int(one.group(2)), proj)
        prefix, _, last = name.rpartition(".")
        if prefix.endswith(".experts") and last in _ALL_EXPERTS:
            param, projections = _ALL_EXPERTS[last]
            return f"{prefix}.{param}".removeprefix("model."), (None, projections)
        return super().checkpoint_target(name)

    def expert_load(self) -> ExpertLoadStats:
        """Assignments per expert of every sparse layer since start (rank 0 routes every
        token, whatever the parallelism, so its counts are the model's)."""
        blocks = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        counts = {
            b.layer_index: b.routed.tolist() if b.routed is not None else [0] * b.num_experts
            for b in blocks
        }
        ranges = None
        if self.tp is not None and self.tp.layout.expert_parallel:
            ranges = expert_ranges(self.config.moe.num_experts, self.tp.layout.size)
        return summarise(counts, ranges)

    def reset_expert_load(self) -> None:
        """Forget the counts (after start-up's profiling and graph-capture passes)."""
        for m in self.modules():
            if isinstance(m, SparseMoeBlock) and m.routed is not None:
                m.routed.zero_()


def build(cfg: ModelConfig, max_positions: int, tp: TPParts | None = None) -> MoECausalLM:
    return MoECausalLM(cfg, max_positions, tp, MoEDecoderLayer)
