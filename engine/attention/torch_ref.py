"""Reference paged attention in vectorised torch: the CPU backend and the tests' oracle.

Single-token rows are batched: their blocks are gathered into one padded tensor and attended
with grouped matmuls (each KV head read once for its query heads). Prompt chunks go one
request at a time through scaled_dot_product_attention; a step holds few of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefleet.engine.attention.backend import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        write_cache(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        n = meta.num_single
        if n:
            out[:n] = self._single(q[:n], k_cache, v_cache, meta, scale)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            out[rows] = self._chunk(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
        return out

    def _single(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        num, num_heads, head_dim = q.shape
        num_kv = k_cache.shape[2]
        tables = meta.single_block_tables
        # [num, blocks, block_size, kv, d] -> [num, kv, ctx, d]
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2)
        values = v_cache[tables].flatten(1, 2).transpose(1, 2)
        queries = q.view(num, num_kv, num_heads // num_kv, head_dim)
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # [num, kv, group, ctx]
        scores.masked_fill_(~meta.single_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).view(num, num_heads, head_dim)

    def _chunk(self, q, k, v, k_cache, v_cache, chunk, scale: float):
        n = chunk.num_tokens
        if chunk.num_computed == 0:
            keys, values, mask, causal = k, v, None, True
        else:
            ctx = chunk.num_computed + n
            keys = k_cache[chunk.block_ids].flatten(0, 1)[:ctx]
            values = v_cache[chunk.block_ids].flatten(0, 1)[:ctx]
            query_pos = torch.arange(chunk.num_computed, ctx).unsqueeze(1)
            mask, causal = torch.arange(ctx).unsqueeze(0) <= query_pos, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
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
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)
