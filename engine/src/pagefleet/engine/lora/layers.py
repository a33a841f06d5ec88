"""LoRA on the model's linear layers: each targetable `Linear` (model/linear.py) is wrapped by
a `LoRALinear` that calls the layer and adds the step's batched delta (ops.py).

A wrapper keeps every resident adapter's weights for its layer stacked by slot, sliced for
this rank as the layer's `LinearSpec` says: a column-parallel layer (q/k/v, gate/up) keeps
its rank's rows of each part's B and all of A; a row-parallel one (o, down) its columns of A
and all of B, and all-reduces the shrink between the halves. `LoRAState` is what the wrappers
of one model share: the slot count, the rank, the kernels, and the step's `LoRABatch`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagefleet.engine.lora.adapter import TARGETS, LoRAWeight, Target
from pagefleet.engine.lora.ops import LoRABatch
from pagefleet.engine.model.config import ModelConfig
from pagefleet.engine.model.linear import (
    FloatLinearMethod,
    Linear,
    RowParallelLinear,
    linear_add,
)


@dataclass
class LoRAState:
    """Shared by the wrappers of one model: set `batch` before each forward."""

    max_loras: int
    max_rank: int
    kernels: type
    batch: LoRABatch | None = None
    wrappers: dict[str, LoRALinear] = field(default_factory=dict)  # by the model's layer name


class LoRALinear(nn.Module):
    """`base(x)` plus the delta of each row's adapter (see the module docstring)."""

    def __init__(self, base: Linear, state: LoRAState, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.base = base
        self.state = state
        spec = base.spec
        self.spec = spec
        self.parts: list[Hashable] = list(spec.parts)
        self.offsets = spec.offsets()
        self.width = len(self.parts) * state.max_rank
        columns = state.max_loras * self.width
        self.register_buffer(
            "lora_a",
            torch.zeros(columns, spec.in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(spec.out_features, columns, dtype=dtype, device=device),
            persistent=False,
        )
        self.present = [False] * state.max_loras
        self.reduce = base.group.all_reduce if isinstance(base, RowParallelLinear) else None

    def install(self, slot: int, weights: dict[Hashable, LoRAWeight]) -> None:
        """Put an adapter's weights for this layer (checkpoint-shaped, by part) in `slot`."""
        first = slot * self.width
        self.lora_a[first : first + self.width].zero_()
        self.lora_b[:, first : first + self.width].zero_()
        rank, cols = self.state.max_rank, self.spec.cols
        for i, part in enumerate(self.parts):
            weight = weights.get(part)
            if weight is None:
                continue
            a, b = weight.a, weight.b
            if cols is not None:
                a = a.narrow(1, cols.start, cols.length)
            rows = self.spec.part_rows(part)
            if rows is not None:
                b = b.narrow(0, rows.start, rows.length)
            at, r = first + i * rank, a.shape[0]
            self.lora_a[at : at + r].copy_(a)
            offset = self.offsets[part]
            self.lora_b[offset : offset + b.shape[0], at : at + r].copy_(b)
        self.present[slot] = bool(weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_delta(x, self.base(x))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self._add_delta(x, linear_add(self.base, x, residual))

    def _add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.state.batch
        # Every rank sees the same batch and adapters, so all take the same branch (the
        # row-parallel all-reduce below is a collective).
        if batch is None or not any(self.present[s] for s in batch.slots):
            return y
        kernels = self.state.kernels
        t = kernels.shrink(x, self.lora_a, batch, self.width, self.present)
        if self.reduce is not None:
            t = self.reduce(t)
        kernels.expand(t, self.lora_b, batch, self.width, self.present, y)
        return y

    def extra_repr(self) -> str:
        return f"slots={self.state.max_loras}, max_rank={self.state.max_rank}"


def wrap_linears(model: nn.Module, names: set[str], state: LoRAState, dtype, device) -> None:
    """Wrap the model's linear layers `names` (those adapters may target, see lora_targets)
    in a `LoRALinear`; `state.wrappers` lists them by name."""
    for full in sorted(names):
        parent, _, child_name = full.rpartition(".")
        module = model.get_submodule(parent)
        wrapper = LoRALinear(getattr(module, child_name), state, dtype, device)
        setattr(module, child_name, wrapper)
        state.wrappers[full] = wrapper


def lora_targets(model, cfg: ModelConfig) -> dict[str, Target]:
    """The projections an adapter may target, by their checkpoint name (PEFT's module names
    less `base_model.model.`): the linear layer (model/linear.py) that computes each, its part
    and its full shape. Projections outside that seam are not targets, so an adapter naming
    one is refused (adapter.check_adapter): a mixture-of-experts layer's experts and router,
    linear-attention layers, and a gated attention's query (its rows interleave each head's
    gate: PEFT's delta would not be the query's)."""
    hidden, hd = cfg.hidden_size, cfg.head_dim
    shapes = {
        "self_attn.q_proj": (cfg.num_heads * hd, hidden),
        "self_attn.k_proj": (cfg.num_kv_heads * hd, hidden),
        "self_attn.v_proj": (cfg.num_kv_heads * hd, hidden),
        "self_attn.o_proj": (hidden, cfg.num_heads * hd),
        "mlp.gate_proj": (cfg.intermediate_size, hidden),
        "mlp.up_proj": (cfg.intermediate_size, hidden),
        "mlp.down_proj": (hidden, cfg.intermediate_size),
    }
    assert {k.rsplit(".", 1)[1] for k in shapes} == set(TARGETS)
    targets = {}
    for i in range(cfg.num_layers):
        for projection, (out_features, in_features) in shapes.items():
            checkpoint = f"model.layers.{i}.{projection}"
            found = model.checkpoint_target(f"{checkpoint}.weight")
            if found is None:
                continue
            module, part = found[0].rsplit(".", 1)[0], found[1]
            if _seam_linear(model, module, part):
                targets[checkpoint] = Target(module, part, out_features, in_features)
    return targets


def _seam_linear(model: nn.Module, module: str, part) -> bool:
    """Whether `module` is a linear layer of the seam (not a MoE block's plain router or
    experts, nor missing: a sparse layer has no gate_up_proj) whose `part` is the plain
    projection."""
    try:
        layer = model.get_submodule(module)
    except AttributeError:
        return False
    if not isinstance(layer, Linear):
        return False
    owner = model.get_submodule(module.rpartition(".")[0])
    return not (part == "q" and getattr(owner, "q_rows_per_head", 1) != 1)


def refuse_quantized(model: nn.Module, targets: dict[str, Target]) -> None:
    """LoRA runs over float weights only: a layer whose method is quantized (model/quant/) is
    refused at start-up, naming it, rather than computed untested against PEFT."""
    for target in targets.values():
        method = model.get_submodule(target.module).method
        if not isinstance(method, FloatLinearMethod):
            raise ValueError(
                f"--enable-lora: LoRA over a quantized base model is not supported "
                f"({target.module} stores {method.name} weights); serve the float checkpoint "
                f"(or merge the adapter into it) instead"
            )
