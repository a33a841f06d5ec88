"""Reference paged attention in vectorised torch: the CPU backend and the tests' oracle.

Cache layout per layer: [kv_heads, num_blocks, block_size, head_dim] (head-major), so the
blocks of a block table, gathered for one head, are already one contiguous [context, head_dim]
matrix for the matmuls: one copy per step, not two.

Single-token rows are batched in groups of similar context length (see SingleGroup): each
group's blocks are gathered into one padded tensor and attended with grouped matmuls (each KV
head read once for its query heads). Small groups keep the gathered keys in cache, which on
CPU is ~5x faster than one gather for the whole batch. Prompt chunks go one
request at a time through scaled_dot_product_attention; a step holds few of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefleet.engine.attention.backend import AttentionMetadata, SingleGroup


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        write_cache(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        for group in meta.single_groups:
            rows = slice(group.start, group.end)
            out[rows] = self._single(q[rows], k_cache, v_cache, group, scale)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            out[rows] = self._chunk(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
        return out

    def _single(self, q, k_cache, v_cache, group: SingleGroup, scale: float):
        num, num_heads, head_dim = q.shape
        num_kv, _, block_size, _ = k_cache.shape
        tables = group.block_tables
        ctx = tables.shape[1] * block_size
        # [kv, num * blocks, block_size, d] -> [kv, num, ctx, d], contiguous
        keys = k_cache.index_select(1, tables.flatten()).view(num_kv, num, ctx, head_dim)
        values = v_cache.index_select(1, tables.flatten()).view(num_kv, num, ctx, head_dim)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # the KV dtype may differ
        queries = q.view(num, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)
        scores = torch.matmul(queries, keys.transpose(-1, -2))  # [kv, num, group, ctx]
        scores.mul_(scale).masked_fill_(~group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values)  # [kv, num, group, d]
        return out.transpose(0, 1).reshape(num, num_heads, head_dim)

    def _chunk(self, q, k, v, k_cache, v_cache, chunk, scale: float):
        n = chunk.num_tokens
        if chunk.num_computed == 0:
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            ctx = chunk.num_computed + n
            num_kv, _, block_size, head_dim = k_cache.shape
            span = len(chunk.block_ids) * block_size
            keys = k_cache.index_select(1, chunk.block_ids).view(num_kv, span, head_dim)[:, :ctx]
            values = v_cache.index_select(1, chunk.block_ids).view(num_kv, span, head_dim)[:, :ctx]
            keys, values = keys.to(q.dtype), values.to(q.dtype)
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


def write_cache(k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
    """Scatter new keys/values into their pool slots (reshape_and_cache in vLLM's terms)."""
    if meta.write_rows is not None:
        k = k[meta.write_rows]
        v = v[meta.write_rows]
    num_kv, _, _, head_dim = k_cache.shape
    flat_k = k_cache.view(num_kv, -1, head_dim)
    flat_v = v_cache.view(num_kv, -1, head_dim)
    flat_k.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    flat_v.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
