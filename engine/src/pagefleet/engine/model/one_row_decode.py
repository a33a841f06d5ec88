"""A dense decoder layer at one row (single-stream decode) as one compiled call, on float32 CPU
weights or a quantized model's codes.

At one row a small model's step is mostly dispatch: SmolLM2-135M's token took 33.7-34.5 ms
on an Intel Xeon, of which its weights alone take 23 ms to read; the rest was a dozen torch
and numba calls per layer, each with its tensor wrapping, checks and launch
(docs/benchmarks.md, issue 38). Here each layer is one numba function composed from the
kernels the layers already run one by one: numba_ops's RMSNorm, GEMV and rotation, and
numba_paged's in-place attention over the block table. The order is the layer's: norm,
q/k/v (+ bias), per-head q/k norm, rotation, the new key and value written into the pool,
attention, o + residual, norm, gate/up, SiLU(gate) * up, down + residual.

It serves layers that declare the plain pre-norm shape (`one_row_fusable`, the Llama family's
DecoderLayer over model/layers.py's Attention and MLP) on one rank, and a step of one
single-token row over a float32 pool without fp8 scales and no LoRA wrapper. Each linear is
read either as a float32 weight kept in its plain layout (model/linear_plan.py keeps them where
`--linear-path auto` fuses) or, for a weight-only quantized one on torch's CPU kernels, as the
codes that kernel keeps (quant/row_codes.py: 8-bit codes a byte each, 4-bit ones in tinygemm's
own packed bytes), in float32 with their exact scales: no second copy. Every other step runs
the layers op by op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numba
import numpy as np
import torch

from pagefleet.engine.attention import numba_paged
from pagefleet.engine.attention.backend import AttentionMetadata, LayerKV
from pagefleet.engine.attention.numba_paged import (
    context_parts,
    paged_decode,
    paged_decode_serial,
    runs_serially,
)
from pagefleet.engine.kernel_cache import match_torch_threads, use_image_kernels
from pagefleet.engine.model import numba_ops
from pagefleet.engine.model.layers import MLP, Attention, RMSNorm
from pagefleet.engine.model.linear import FloatLinearMethod, Linear
from pagefleet.engine.model.numba_ops import _gemv, _rms_norm, _rotate_pair
from pagefleet.engine.model.quant import row_codes
from pagefleet.engine.model.quant.cpu_kernels import CpuIntKernel
from pagefleet.engine.model.quant.row_codes import (
    NO_CODES,
    NO_OFFSETS,
    NO_PLANE,
    OneRowWeight,
    RowCodes,
    gemv_codes,
    gemv_nibbles,
)

logger = logging.getLogger(__name__)

use_image_kernels()  # before the kernel below is defined (and loaded or compiled)
# The kernel below is compiled with these files' kernels: its cached copy is stale when they
# change (kernel_cache.CalleeStamp).
KERNEL_CALLEES = (numba_ops.__file__, numba_paged.__file__, row_codes.__file__)

_FAST = {"reassoc", "contract", "nsz", "arcp"}
_ROWS = numba.float32[:, ::1]
_VECTOR = numba.float32[::1]
_HEADS = numba.float32[:, :, ::1]
_POOL = numba.float32[:, :, :, ::1]
_INT = numba.int64
_SHAPE = numba.types.UniTuple(numba.int64, 4)  # heads, KV heads, head dim, intermediate size
_BLOCKS = numba.float32[:, :, ::1]
# A linear: its float32 weight [out, in], or (weight [0, 0]) its int8 codes or 4-bit plane
# (the other empty) with their scales and offsets (quant/row_codes.py); then its bias (empty:
# none).
_LINEAR = numba.types.Tuple(
    (_ROWS, numba.int8[:, :, ::1], numba.uint8[:, :, ::1], _BLOCKS, _BLOCKS, _VECTOR)
)


@numba.njit(inline="always")
def _linear(linear, x, add, out):
    """out = (or +=) W x + bias, on whichever form the linear is kept in."""
    weight, codes, plane, scales, offsets, bias = linear
    if weight.shape[0]:
        _gemv(weight, x, bias, add, out)
    elif codes.shape[0]:
        gemv_codes(codes, scales, offsets, x, bias, add, out)
    else:
        gemv_nibbles(plane, scales, offsets, x, bias, add, out)


@numba.njit(
    numba.void(
        _ROWS,  # x [1, hidden]: the residual, updated in place
        numba.float32,  # eps
        _VECTOR,  # input norm
        _LINEAR,  # q/k/v
        _VECTOR,  # q norm (empty: none)
        _VECTOR,  # k norm
        _LINEAR,  # o
        _VECTOR,  # post-attention norm
        _LINEAR,  # gate/up
        _LINEAR,  # down
        _HEADS,  # cos [1, 1, rotary]
        _HEADS,  # sin
        _POOL,  # keys [kv heads, blocks, block size, head dim]
        _POOL,  # values
        _INT,  # the new token's pool slot (-1: its key and value are already there)
        numba.int64[:, ::1],  # block table [1, blocks]
        numba.int64[::1],  # context length [1]
        numba.float32,  # attention scale
        _INT,  # runs of blocks per KV head (numba_paged.context_parts)
        numba.boolean,  # attention on the calling thread (numba_paged.runs_serially)
        _SHAPE,
    ),
    fastmath=_FAST,
    cache=True,
)
def _decoder_layer(
    x, eps, norm1, qkv_proj, q_norm, k_norm, o_proj, norm2, gate_up_proj, down_proj,
    cos, sin, keys, values, slot, table, length, scale, parts, serial, shape,
):  # fmt: skip
    heads, kv_heads, head_dim, inter = shape
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    h = np.empty_like(x)
    _rms_norm(x, norm1, eps, h)
    qkv = np.empty(q_size + 2 * kv_size, np.float32)
    _linear(qkv_proj, h[0], False, qkv)
    q_flat, k_flat = qkv[:q_size], qkv[q_size : q_size + kv_size]
    if q_norm.shape[0]:
        q_normed = np.empty((heads, head_dim), np.float32)
        k_normed = np.empty((kv_heads, head_dim), np.float32)
        _rms_norm(q_flat.reshape(heads, head_dim), q_norm, eps, q_normed)
        _rms_norm(k_flat.reshape(kv_heads, head_dim), k_norm, eps, k_normed)
        q_flat, k_flat = q_normed.reshape(-1), k_normed.reshape(-1)
    q = np.empty((1, heads, head_dim), np.float32)
    k = np.empty((1, kv_heads, head_dim), np.float32)
    _rotate_pair(q_flat, q_size, k_flat, kv_size, cos, sin, q, k)
    if slot >= 0:
        block, offset = slot // keys.shape[2], slot % keys.shape[2]
        v_start = q_size + kv_size
        for g in range(kv_heads):
            for d in range(head_dim):
                keys[g, block, offset, d] = k[0, g, d]
                values[g, block, offset, d] = qkv[v_start + g * head_dim + d]
    attended = np.empty((1, heads, head_dim), np.float32)
    if serial:
        paged_decode_serial(q, keys, values, table, length, scale, attended, parts)
    else:
        paged_decode(q, keys, values, table, length, scale, attended, parts)
    _linear(o_proj, attended.reshape(-1), True, x[0])
    _rms_norm(x, norm2, eps, h)
    gate_up = np.empty(2 * inter, np.float32)
    _linear(gate_up_proj, h[0], False, gate_up)
    act = np.empty(inter, np.float32)
    for i in range(inter):
        gate = gate_up[i]
        act[i] = gate / (np.float32(1.0) + np.exp(-gate)) * gate_up[inter + i]
    _linear(down_proj, act, True, x[0])


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights as the kernel reads them (numpy views of the model's tensors),
    and its pool slot and attention scale."""

    kv_slot: int
    eps: np.float32
    scale: np.float32
    arrays: tuple  # norm1 .. down_proj, in the kernel's order (a linear: a tuple, `_LINEAR`)
    shape: tuple[int, int, int, int]


def fusable_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers where every one can run fused, else [] (a tensor-parallel
    shard, a family without the plain pre-norm layer, a model not in float32 on the CPU,
    linears neither float32 nor on torch's CPU integer kernels with codes the fused layers
    read, a LoRA wrapper)."""
    layers = list(getattr(model, "layers", ()))
    if getattr(model, "tp", None) is not None or not layers:
        return []
    for layer in layers:
        if not getattr(layer, "one_row_fusable", False):
            return []
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention or type(mlp) is not MLP:
            return []
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(_float32_linear(linear) or _coded(linear) for linear in linears):
            return []
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
        vectors = [n.weight for n in norms if n is not None] + [
            linear.bias for linear in linears if linear.bias is not None
        ]
        if not all(v.dtype == torch.float32 and v.device.type == "cpu" for v in vectors):
            return []  # a bfloat16 model's quantized linears: the kernel is float32's
    return layers


def fusable_shapes(model: torch.nn.Module) -> frozenset[tuple[int, int]]:
    """The (out, in) float weight shapes the fused layers read, or none where they do not
    apply."""
    return frozenset(
        (linear.out_features, linear.in_features)
        for layer in fusable_layers(model)
        for linear in _linears(layer)
        if _float32_linear(linear)
    )


def _linears(layer) -> tuple[Linear, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _float32_linear(linear) -> bool:
    weight = getattr(linear, "weight", None)
    return (
        type(linear) is Linear
        and isinstance(linear.method, FloatLinearMethod)
        and weight is not None
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def _coded(linear) -> bool:
    kernel = getattr(linear, "kernel", None)
    return (
        type(linear) is Linear
        and isinstance(kernel, CpuIntKernel)
        and kernel.row_codes() is not None
    )


class OneRowDecoder:
    """The model's decoder layers run fused at one row (see the module doc)."""

    def __init__(
        self,
        layers: list[torch.nn.Module],
        coded: dict[Linear, OneRowWeight],
        head_codes: RowCodes | None = None,
    ) -> None:
        self.layers = layers
        # The LM head's codes, where its float weight holds exact 8-bit ones (the model's
        # one-row logits then read them: CausalLM.fuse_one_row_layers).
        self.head_codes = head_codes
        self.linears = [_linears(layer) for layer in layers]
        self.pointers = [_data(linears) for linears in self.linears]
        self.weights = [_layer_weights(layer, coded) for layer in layers]
        self._pools: tuple[list[LayerKV], list[tuple[np.ndarray, np.ndarray]]] | None = None

    @classmethod
    def build(
        cls, model: torch.nn.Module, budget: int | None = None, coded_head: bool = False
    ) -> OneRowDecoder | None:
        """The fused layers where they apply to the model as processed (its plain float
        weights kept, its quantized ones' codes as their kernels keep them), else None. With
        `coded_head`, the 8-bit codes its LM head's float weight holds exactly (a GGUF's Q8_0
        token embedding) where that copy fits in `budget` bytes (None: linear_plan's budget
        for second copies)."""
        layers = fusable_layers(model)
        coded = _row_codes(layers) if layers else None
        if coded is None:
            return None
        head = _head_codes(model) if coded_head else None
        if head is not None and not _codes_fit(head.nbytes(), budget):
            head = None
        in_huge_pages(_float_weights_of(layers))
        decoder = cls(layers, coded, head)
        decoder.warm_up()
        return decoder

    def takes(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        backend,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> bool:
        """Whether this step runs fused: one single-token row of one group (no prompt chunk,
        no recurrent state, no batch already flat for a captured graph), float32 without
        gradients, attention on the CPU's in-place kernel or on torch's where the measurement
        chose it (an explicit `--attention-backend torch` keeps its own), the pool float32
        without fp8 scales, and the model's layers, linears and weights still those the fused
        layers read (no LoRA wrapper or reload took their place)."""
        if not (
            x.shape[0] == 1
            and meta.num_single == 1
            and not meta.prefills
            and meta.states is None
            and meta.paged is None
            and len(meta.single_groups) == 1
            and meta.single_groups[0].seq_lens is not None
            and _leaves_attention(backend)
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.is_contiguous()
            and not torch.is_grad_enabled()
        ):
            return False
        first = kv_caches[self.weights[0].kv_slot]
        if first.scales is not None or first.k_cache.dtype != torch.float32:
            return False
        return self._intact(model)

    def _intact(self, model: torch.nn.Module) -> bool:
        layers = model.layers
        return len(layers) == len(self.layers) and all(
            current is layer and _linears(layer) == linears and _data(linears) == pointers
            for current, layer, linears, pointers in zip(
                layers, self.layers, self.linears, self.pointers, strict=True
            )
        )

    def __call__(self, x, rotation, kv_caches: list[LayerKV], meta: AttentionMetadata):
        """x [1, hidden] after every layer (in place)."""
        group = meta.single_groups[0]
        table = group.block_tables.contiguous().numpy()
        length = group.seq_lens.contiguous().numpy()
        slot = int(meta.slot_mapping[0]) if _writes_its_row(meta) else -1
        pools = self._pool_arrays(kv_caches)
        keys = pools[self.weights[0].kv_slot][0]
        _check_bounds(keys, slot, table, int(length[0]), rotation.cos, self.weights[0].shape[2])
        threads = match_torch_threads()
        cos, sin = rotation.cos.contiguous().numpy(), rotation.sin.contiguous().numpy()
        out = x.numpy()
        kv_heads = self.weights[0].shape[1]  # every layer's: one Attention config
        parts = context_parts(1, kv_heads, threads, table.shape[1])
        serial = parts == 1 and runs_serially(1, kv_heads, threads)
        for w in self.weights:
            keys, values = pools[w.kv_slot]
            _decoder_layer(
                out, w.eps, *w.arrays, cos, sin, keys, values, slot, table, length,
                w.scale, parts, serial, w.shape,
            )  # fmt: skip
        return x

    def _pool_arrays(self, kv_caches: list[LayerKV]) -> list[tuple[np.ndarray, np.ndarray]]:
        """numpy views of each layer's pool, made once per list of caches (the runner's)."""
        if self._pools is None or self._pools[0] is not kv_caches:
            views = [(c.k_cache.numpy(), c.v_cache.numpy()) for c in kv_caches]
            self._pools = (kv_caches, views)
        return self._pools[1]

    def warm_up(self) -> None:
        """One call on a throwaway pool: the kernel compiled or loaded at load, not in the
        first request."""
        w = self.weights[0]
        _, kv_heads, head_dim, _ = w.shape
        x = np.zeros((1, w.arrays[0].shape[0]), np.float32)
        pool = np.zeros((kv_heads, 1, 1, head_dim), np.float32)
        rotary = np.zeros((1, 1, head_dim), np.float32)
        table, length = np.zeros((1, 1), np.int64), np.ones(1, np.int64)
        _decoder_layer(
            x, w.eps, *w.arrays, rotary, rotary, pool, pool.copy(), 0, table, length,
            w.scale, 1, True, w.shape,
        )  # fmt: skip


def _leaves_attention(backend) -> bool:
    """Whether the step's backend lets the fused layers attend on the in-place kernel: its
    own kernel, or a CPU backend the measurement chose over it for batches (at one row the
    in-place kernel measured faster on every CPU so far: docs/benchmarks.md, issue 38)."""
    name = getattr(backend, "name", None)
    return name == "numba" or (name == "torch" and not getattr(backend, "explicit", True))


def _data(linears: tuple[Linear, ...]) -> tuple[int, ...]:
    """Where the linears' weights live (their numpy views are the fused layers'), or the
    kernel a quantized one's codes belong to (held here, so compared by identity)."""
    weights = [getattr(linear, "weight", None) for linear in linears]
    return tuple(
        linear.kernel if weight is None else weight.data_ptr()
        for linear, weight in zip(linears, weights, strict=True)
    )


def _check_bounds(keys: np.ndarray, slot: int, table: np.ndarray, length: int, cos, head_dim):
    """The kernel checks no bounds: what the step would make it read or write is checked
    here (the runner keeps all of it in range; a mistake raises instead of writing anywhere)."""
    blocks, block_size = keys.shape[1], keys.shape[2]
    if not (
        -1 <= slot < blocks * block_size
        and 0 < length <= table.shape[1] * block_size
        and table.shape[0] == 1
        and table[0, : -(-length // block_size)].min() >= 0
        and table[0, : -(-length // block_size)].max() < blocks
        and cos.shape[0] == 1
        and cos.shape[2] <= head_dim
    ):
        raise ValueError(
            f"one-row step out of the pool's bounds: slot {slot}, context {length}, "
            f"table {table.tolist()}, {blocks} blocks of {block_size}"
        )


def _writes_its_row(meta: AttentionMetadata) -> bool:
    """Whether the step writes its row's key and value (not when a full prefix hit left them
    in a shared cached block)."""
    return meta.write_rows is None or meta.write_rows.numel() > 0


def in_huge_pages(params: list[torch.Tensor]) -> None:
    """Move float32 CPU parameters into one array, in their order, each `.data` rebound to its
    view of it (every reference to the parameter sees the move; the old storage is freed).

    numpy asks the kernel to back a large array with 2 MiB pages (madvise, where transparent
    huge pages are on "madvise", as on most distributions); torch's allocator does not. A
    weight streamed from memory at one row then takes fewer TLB misses: the fused layers of
    SmolLM2 ran 12% faster from such a copy than from the loader's tensors on an Intel Xeon."""
    sizes = [-(-p.numel() // _LINE) * _LINE for p in params]  # each on its own cache line
    arena = np.empty(sum(sizes) + _LINE, np.float32)
    start = (-arena.ctypes.data // 4) % _LINE
    for param, size in zip(params, sizes, strict=True):
        view = torch.from_numpy(arena[start : start + param.numel()]).view(param.shape)
        view.copy_(param.detach())
        param.data = view
        start += size


_LINE = 16  # float32s in a 64-byte cache line


def _float_weights_of(layers) -> list[torch.Tensor]:
    return [
        linear.weight for layer in layers for linear in _linears(layer) if _float32_linear(linear)
    ]


def _row_codes(layers) -> dict[Linear, OneRowWeight] | None:
    """The codes of the layers' quantized linears as the fused layers read them (none where
    all are float), or None where a weight has none (quant/cpu_kernels.py's `row_codes`)."""
    coded = {}
    for layer in layers:
        for linear in _linears(layer):
            if not _float32_linear(linear):
                codes = linear.kernel.row_codes()
                if codes is None:
                    logger.info(
                        "decoder layers at one row: op by op (no codes for a %dx%d weight)",
                        linear.out_features,
                        linear.in_features,
                    )
                    return None
                coded[linear] = codes
    if coded:
        logger.info(
            "decoder layers at one row: one compiled call each, %d quantized linears on "
            "their own codes",
            len(coded),
        )
    return coded


def _head_codes(model: torch.nn.Module) -> RowCodes | None:
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if head is None or head.device.type != "cpu" or getattr(model, "tp", None) is not None:
        return None
    return RowCodes.exact_int8(head)


def _codes_fit(size: int, budget: int | None) -> bool:
    """Whether the LM head's codes, `size` bytes, fit in `budget` (None: linear_plan's
    budget for second copies). Logs the choice."""
    from pagefleet.engine.model.linear_plan import second_layout_budget

    budget = second_layout_budget() if budget is None else budget
    fits = size <= budget
    logger.info(
        "LM head at one row: %s (%d MiB of codes, %d MiB for second copies)",
        "on its 8-bit codes" if fits else "float",
        size >> 20,
        budget >> 20,
    )
    return fits


def _layer_weights(layer, coded: dict[Linear, OneRowWeight]) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp

    hidden, inter = layer.input_layernorm.weight.shape[0], mlp.intermediate
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim

    def linear(module: Linear, shape: tuple[int, int]) -> tuple:
        """The kernel sizes its buffers by the layer's shape and checks no bounds: each
        weight (or its codes) and bias is checked against that shape here."""
        bias = _optional(module.bias)
        codes = coded.get(module)
        if codes is None:
            found = tuple(module.weight.shape)
            arrays = (_array(module.weight), NO_CODES, NO_PLANE, NO_OFFSETS, NO_OFFSETS, bias)
        else:
            found = (codes.out_features, codes.in_features)
            arrays = (_NO_WEIGHT, *codes.fused_arrays(), bias)
        if found != shape or bias.shape[0] not in (0, shape[0]):
            raise ValueError(f"a {found} weight (bias {bias.shape}) where the layer reads {shape}")
        return arrays

    arrays = (
        _array(layer.input_layernorm.weight),
        linear(attn.qkv_proj, (q_size + 2 * kv_size, hidden)),
        _norm(attn.q_norm),
        _norm(attn.k_norm),
        linear(attn.o_proj, (hidden, q_size)),
        _array(layer.post_attention_layernorm.weight),
        linear(mlp.gate_up_proj, (2 * inter, hidden)),
        linear(mlp.down_proj, (hidden, inter)),
    )
    return LayerWeights(
        attn.kv_slot,
        np.float32(layer.input_layernorm.eps),
        np.float32(attn.scale),
        arrays,
        (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate),
    )


_NO_WEIGHT = np.zeros((0, 0), np.float32)


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().contiguous().numpy()


def _optional(tensor: torch.Tensor | None) -> np.ndarray:
    return numba_ops._NO_BIAS if tensor is None else _array(tensor)


def _norm(norm: RMSNorm | None) -> np.ndarray:
    return numba_ops._NO_BIAS if norm is None else _array(norm.weight)
