"""The decoder-only language model every family builds on: embedding, a stack of decoder
layers the family supplies, final norm, LM head, rotary table, and the map from checkpoint
tensor names to this model's parameters.

Tokens arrive flattened (no padding); layers that attend go through an `AttentionBackend` over
the paged KV pool. Under tensor parallelism the model is one rank's shard, whose
`compute_logits` returns the full logits on rank 0 and None on the others.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from pagefleet.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    DecodeShape,
    LayerKV,
)
from pagefleet.engine.model.config import ModelConfig
from pagefleet.engine.model.layers import RMSNorm, TPParts, embedding, lm_head
from pagefleet.engine.model.linear import process_weights
from pagefleet.engine.model.linear_plan import PACK_ALL, LinearPlan
from pagefleet.engine.model.packed import prepack_supported
from pagefleet.engine.model.rope import RotaryEmbedding

# Checkpoint projections that load into one fused parameter: (ours, part).
FUSED_PROJECTIONS: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}

LayerFactory = Callable[[ModelConfig, int, TPParts | None], nn.Module]


class CausalLM(nn.Module):
    """Embedding → decoder layers (`make_layer(cfg, index, tp)`) → norm → LM head.

    A decoder layer's forward is `(x, positions, rope, backend, kv_caches, meta) -> x`, `rope`
    the step's `Rotation` (model/rope.py: `rope(q, k)` rotates the step's tokens); its
    linears come from model/layers.py's factories (model/linear.py), and an optional
    `prepack()` processes whatever else it loaded (packed experts)."""

    # Checkpoint name pieces renamed to ours (families with more fused layers extend it).
    fused_projections: dict[str, tuple[str, str]] = FUSED_PROJECTIONS

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: TPParts | None,
        make_layer: LayerFactory,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        # The weights' format as capacity names it (float32, int4, fp8...; set by the loader).
        self.weights_format = ""
        self.max_positions = max_positions
        self.embed_tokens = embedding(cfg, tp)
        self.layers = nn.ModuleList(make_layer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head(cfg, tp)
        self.tie_weights()
        # On the meta device the table waits for `materialize`: computing it there would be
        # wasted, and meta arithmetic runs torch's reference ops, which import torch._dynamo.
        meta = torch.get_default_device().type == "meta"
        self.rope = None if meta else self.make_rope()
        # The layers as one compiled call each at one row, where the plan fused them
        # (model/one_row_decode.py; set by process_weights).
        self.one_row_decoder = None

    def make_rope(self) -> nn.Module:
        cfg = self.config
        return RotaryEmbedding(cfg.head_dim, self.max_positions, cfg.rope)

    def tie_weights(self) -> None:
        """A tied LM head reads the embedding's weight (a float one: a quantized head keeps
        its own)."""
        if self.config.tie_word_embeddings and hasattr(self.lm_head, "weight"):
            self.lm_head.weight = self.embed_tokens.weight

    def drop_lm_head(self) -> None:
        """A pooling model (pooling/) reads the final hidden states: it has no LM head to hold,
        and skips one its checkpoint carries."""
        self.lm_head = None

    def materialize(self, device: torch.device) -> None:
        """After the parameters left the meta device: re-tie the embeddings and compute the
        buffers no checkpoint holds (the rotary table)."""
        self.tie_weights()
        self.rope = self.make_rope().to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        x = self.embed_tokens(input_ids)
        rotation = self.rope.at(positions, x.dtype)
        fused = self.one_row_decoder
        if fused is not None and fused.takes(self, x, backend, kv_caches, meta):
            return self.norm(fused(x, rotation, kv_caches, meta))
        for layer in self.layers:
            x = layer(x, positions, rotation, backend, kv_caches, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def process_weights(self, plan: LinearPlan = PACK_ALL) -> None:
        """Once, after the weights are loaded: every linear layer's weights into the form its
        method's kernel reads (model/linear.py), float32 CPU weights oneDNN-packed where `plan`
        says (model/linear_plan.py); where the plan packs the unmeasured parts too, the layers
        then pack what else they hold (`prepack()`: a MoE's experts, a linear-attention
        layer's plain linears; the seam's linears are processed by then and keep the plan's
        choice). Where the plan fuses the layers at one row, their plain weights and the LM
        head's move into huge-page memory (model/one_row_decode.py). PACK_NONE keeps the
        plain float reference."""
        process_weights(self, plan.packs, plan.one_row_path)
        if plan.one_row_layers:
            self.fuse_one_row_layers()
        weight = self.embed_tokens.weight
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            from pagefleet.engine.model import numba_ops  # the norms' and rotations' kernels

            numba_ops.warm_up()  # at load, not in the first request
        if plan.others and prepack_supported(weight.device, weight.dtype):
            for layer in self.layers:
                hook = getattr(layer, "prepack", None)
                if hook is not None:
                    hook()

    def fuse_one_row_layers(self, budget: int | None = None, coded_head: bool = False) -> None:
        """The decoder layers as one compiled call each at one row where they can run so
        (model/one_row_decode.py; a quantized model's byte codes within `budget` bytes, None:
        the budget for second copies). The LM head is read whole at every such step too: on
        the exact 8-bit codes its float weight holds where `coded_head` finds them (a GGUF's
        Q8_0 token embedding, a quarter of the float bytes), else that weight moves into
        huge-page memory beside the layers'."""
        from pagefleet.engine.model import one_row_decode  # numba's

        decoder = one_row_decode.OneRowDecoder.build(self, budget, coded_head)
        self.one_row_decoder = decoder
        head = getattr(self.lm_head, "weight", None)
        if decoder is None or head is None:
            return
        if decoder.head_codes is not None:
            decoder.head_codes.hold_in(self.lm_head, "one_row")
            self.lm_head.one_row = decoder.head_codes.one_row
        elif head.dtype == torch.float32 and head.device.type == "cpu":
            one_row_decode.in_huge_pages([head])

    def checkpoint_target(self, name: str) -> tuple[str, Hashable] | None:
        """(parameter name, part) a checkpoint tensor loads into, or None for tensors the model
        does not keep (rotary tables, a tied LM head)."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and (self.config.tie_word_embeddings or self.lm_head is None):
            return None
        for theirs, (ours, part) in self.fused_projections.items():
            if f".{theirs}." in name:
                return name.replace(theirs, ours), part
        return name, None

    def checkpoint_modules(self, name: str, parts: list[Hashable]) -> list[str]:
        """The checkpoint's module names (HF's: `model.layers.0.self_attn.q_proj`) whose
        weights load into our module `name`, one per fused part (the inverse of
        `checkpoint_target`; quantization configs name layers so)."""
        found = []
        for part in parts:
            theirs = name
            for checkpoint, (ours, ours_part) in self.fused_projections.items():
                if ours_part == part and name.endswith("." + ours):
                    theirs = name[: -len(ours)] + checkpoint
            found.append(theirs if theirs == "lm_head" else "model." + theirs)
        return found

    @property
    def num_kv_heads(self) -> int:
        """KV heads this model (or rank) keeps in its pool."""
        return self.tp.layout.num_kv_heads if self.tp else self.config.num_kv_heads

    def decode_shape(self, block_size: int, kv_dtype: torch.dtype) -> DecodeShape:
        """What this model's (or rank's) decode attention reads from a pool of `kv_dtype`."""
        cfg = self.config
        heads = self.tp.layout.num_heads if self.tp else cfg.num_heads
        dtype = self.embed_tokens.weight.dtype
        return DecodeShape(heads, self.num_kv_heads, cfg.head_dim, block_size, dtype, kv_dtype)
