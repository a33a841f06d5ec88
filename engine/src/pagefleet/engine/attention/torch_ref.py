"""Reference paged attention in vectorised torch: the CPU backend and the tests' oracle.

Cache layout per layer: [kv_heads, num_blocks, block_size, head_dim] (head-major), so the
blocks of a block table, gathered for one head, are already one contiguous [context, head_dim]
matrix for the matmuls: one copy per step, not two.

Single-token rows are batched in groups of similar context length (see SingleGroup): each
group's blocks are gathered into one padded tensor and attended with grouped matmuls (each KV
head read once for its query heads). Small groups keep the gathered keys in cache, which on
CPU is ~5x faster than one gather for the whole batch. Prompt chunks go one
request at a time through scaled_dot_product_attention; a step holds few of them.

An fp8 cache (`kv_scale` given: the layer's (k_scale, v_scale)) is written quantised and read
back dequantised, prompt chunks included, so every token attends to the values decodes see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefleet.engine.attention.backend import AttentionMetadata, SingleGroup
from pagefleet.engine.kv_cache.fp8 import (
    LayerScales,
    dequantize,
    gather_blocks,
    quantize,
    scatter_slots,
)


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: LayerScales | None = None,
    ):
        write_cache(k, v, k_cache, v_cache, meta, kv_scale)
        groups = meta.single_groups
        if not meta.prefills and len(groups) == 1 and groups[0].end - groups[0].start == len(q):
            # A decode-only step of one group (a step of few requests): its rows are the output,
            # with no copy into a buffer of the step's shape.
            return self._single(q, k_cache, v_cache, groups[0], scale, kv_scale)
        out = torch.empty_like(q)
        for group in meta.single_groups:
            rows = slice(group.start, group.end)
            out[rows] = self._single(q[rows], k_cache, v_cache, group, scale, kv_scale)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            out[rows] = self._chunk(
                q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale, kv_scale
            )
        return out

    def _single(
        self, q, k_cache, v_cache, group: SingleGroup, scale: float, kv_scale: LayerScales | None
    ):
        num, num_heads, head_dim = q.shape
        num_kv, _, block_size, _ = k_cache.shape
        tables = group.block_tables
        ctx = tables.shape[1] * block_size
        # [kv, num * blocks, block_size, d] -> [kv, num, ctx, d], contiguous
        keys = gather_blocks(k_cache, tables.flatten()).view(num_kv, num, ctx, head_dim)
        values = gather_blocks(v_cache, tables.flatten()).view(num_kv, num, ctx, head_dim)
        keys, values = _read(keys, values, q.dtype, kv_scale)  # the KV dtype may differ
        queries = q.view(num, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)
        scores = torch.matmul(queries, keys.transpose(-1, -2))  # [kv, num, group, ctx]
        scores.mul_(scale).masked_fill_(~group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values)  # [kv, num, group, d]
        return out.transpose(0, 1).reshape(num, num_heads, head_dim)

    def _chunk(self, q, k, v, k_cache, v_cache, chunk, scale: float, kv_scale: LayerScales | None):
        n = chunk.num_tokens
        if chunk.num_computed == 0 and kv_scale is None:
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            ctx = chunk.num_computed + n
            num_kv, _, block_size, head_dim = k_cache.shape
            span = len(chunk.block_ids) * block_size
            keys = gather_blocks(k_cache, chunk.block_ids).view(num_kv, span, head_dim)[:, :ctx]
            values = gather_blocks(v_cache, chunk.block_ids).view(num_kv, span, head_dim)[:, :ctx]
            keys, values = _read(keys, values, q.dtype, kv_scale)
            query_pos = torch.arange(chunk.num_computed, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= query_pos
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)


def _read(keys, values, dtype: torch.dtype, kv_scale: LayerScales | None):
    if kv_scale is None:
        return keys.to(dtype), values.to(dtype)
    return dequantize(keys, kv_scale[0], dtype), dequantize(values, kv_scale[1], dtype)


def write_cache(
    k, v, k_cache, v_cache, meta: AttentionMetadata, kv_scale: LayerScales | None = None
) -> None:
    """Scatter new keys/values into their pool slots (reshape_and_cache in vLLM's terms),
    quantised with the layer's scales for an fp8 cache."""
    if meta.write_rows is not None:
        k = k[meta.write_rows]
        v = v[meta.write_rows]
    num_kv, _, _, head_dim = k_cache.shape
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    if kv_scale is None:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    else:
        k, v = quantize(k, kv_scale[0]), quantize(v, kv_scale[1])
    scatter_slots(k_cache.view(num_kv, -1, head_dim), meta.slot_mapping, k)
    scatter_slots(v_cache.view(num_kv, -1, head_dim), meta.slot_mapping, v)
