"""What the engine knows of a model's shape, whatever its family: `ModelConfig`.

A family module (model/registry.py) builds one from the checkpoint's config.json; families with
more to say subclass it (their extra fields keep defaults, so the common ones stay positional).
The runner, KV sizing and tensor-parallel layout read only these fields (and, for a model with
recurrent layers, its `state_shape`). A mixture-of-experts family fills `moe` (`MoESpec`):
which layers route each token to a few of many experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SequenceStateShape:
    """One rank's fixed-size state per sequence in a model's recurrent layers (a hybrid's linear
    attention): per layer, the causal convolution's last `conv_width` inputs over
    `conv_channels`, and a key x value matrix per value head. Constant in the context length."""

    num_layers: int
    conv_channels: int
    conv_width: int
    num_heads: int
    key_dim: int
    value_dim: int

    @property
    def values_per_layer(self) -> int:
        return self.conv_channels * self.conv_width + self.num_heads * self.key_dim * self.value_dim

    @property
    def values(self) -> int:
        """Values of one sequence's state over all recurrent layers."""
        return self.num_layers * self.values_per_layer


@dataclass(frozen=True)
class MoESpec:
    """The experts of a mixture-of-experts model (the same in every sparse layer)."""

    num_experts: int
    top_k: int  # experts each token is routed to
    intermediate_size: int  # of each expert's gated MLP
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    sparse_layers: tuple[int, ...]  # decoder layers with experts (the others: a dense MLP)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3.5-MoE has one)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be from 1 to the {self.num_experts} experts"
            )
        if self.intermediate_size < 1:
            raise ValueError(f"expert intermediate size {self.intermediate_size} must be >= 1")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # decoder layers (all of them keep KV in the dense families)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    hidden_act: str = "silu"
    # Layers that attend over the paged KV pool, in order (None: every layer). A hybrid family
    # lists its full-attention layers here; the pool has one plane per listed layer.
    kv_layer_indices: tuple[int, ...] | None = field(default=None)
    moe: MoESpec | None = None  # None: a dense model

    @property
    def num_kv_layers(self) -> int:
        """Layers with a plane in the KV pool."""
        return self.num_layers if self.kv_layer_indices is None else len(self.kv_layer_indices)

    def is_sparse(self, layer_index: int) -> bool:
        """Whether decoder layer `layer_index` routes tokens to experts."""
        return self.moe is not None and layer_index in self.moe.sparse_layers

    def kv_slot(self, layer_index: int) -> int:
        """The pool plane of decoder layer `layer_index` (which must attend over the pool)."""
        if self.kv_layer_indices is None:
            return layer_index
        return self.kv_layer_indices.index(layer_index)

    def state_shape(self, tp_size: int = 1) -> SequenceStateShape | None:
        """One rank's per-sequence recurrent state, or None: the model keeps only paged KV."""
        return None

    def split_sizes(self) -> dict[str, int]:
        """What tensor parallelism splits evenly over the ranks, by name (families with more
        split dimensions add theirs); KV heads have their own rule (model/parallel.py)."""
        sizes = {"attention heads": self.num_heads}
        if self.moe is None or len(self.moe.sparse_layers) < self.num_layers:  # a dense MLP
            sizes["intermediate_size"] = self.intermediate_size
        return sizes
