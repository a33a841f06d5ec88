"""A Llama checkpoint of any shape whose greedy output copies its context: built, not trained.

Speculative decoding pays on text that quotes its prompt, but a random checkpoint never quotes
anything. Two layers of this one are an induction circuit written by hand; the rest are zero,
so a forward costs exactly what the random checkpoint of the same shape costs:
  layer 0, a previous-token head: queries and keys read a constant direction, the query turned
      back one RoPE step, so each position attends to the one before and copies that token's
      code into a "previous" slot of the residual;
  layer 1, an induction head: position i's token code queries the "previous" slots, finds the
      position j whose predecessor was the same token, and writes j's token code into a "next"
      slot, which the head reads out as logits.
So the model predicts "what followed the last time this token appeared", as an n-gram proposer
does with n = 1 and as trained models do when they quote. Codes are random unit vectors in the
RoPE pairs that barely turn over the context (rope_theta is set high to make room for them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagefleet.engine.model.tiny import write_tiny_checkpoint

ROPE_THETA = 1e12
MAX_CONTEXT = 1024  # content pairs turn at most ~0.3 rad over this many positions
PREV_TOKEN_GAIN = 20.0  # per-pair amplitude of layer 0's query and key (after the norm)
MATCH_GAIN = 20.0  # norm of layer 1's query and key codes
LOGIT_GAIN = 10.0


def write_copying_checkpoint(path: str | Path, seed: int = 0, **shape) -> Path:
    """Write a checkpoint of `shape` (write_tiny_checkpoint's arguments) that copies."""
    if shape.get("num_layers", 2) < 2:
        raise ValueError("the induction circuit needs two layers")
    path = write_tiny_checkpoint(
        path, "LlamaForCausalLM", rope_theta=ROPE_THETA, seed=seed, **shape
    )
    config = json.loads((path / "config.json").read_text())
    (weights_file,) = path.glob("*.safetensors")
    weights = {name: torch.zeros_like(w) for name, w in load_file(weights_file).items()}
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            w.fill_(1.0)
    _build_circuit(weights, config, torch.Generator().manual_seed(seed))
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


def _build_circuit(weights: dict[str, torch.Tensor], config: dict, gen: torch.Generator) -> None:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    half = head_dim // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    still = [i for i in range(half) if inv_freq[i] * MAX_CONTEXT <= 0.3]  # content pairs
    turning = [i for i in range(half) if i not in still]  # the previous-token pattern
    content = still + [i + half for i in still]  # dims of a head that carry a token code
    width = len(content)
    groups = min(kv_heads, 2)  # one code per KV group; more would only repeat the pattern
    if hidden < 3 * groups * width + 1:
        raise ValueError(f"hidden_size {hidden} is too small for codes of width {width}")
    cur = [list(range(g * width, (g + 1) * width)) for g in range(groups)]
    prev = [[d + groups * width for d in dims] for dims in cur]
    const = 2 * groups * width
    nxt = [[d + const + 1 for d in dims] for dims in cur]
    codes = torch.randn(groups, vocab, width, generator=gen, dtype=torch.float64)
    codes /= codes.norm(dim=-1, keepdim=True)

    embed = weights["model.embed_tokens.weight"]
    for g in range(groups):
        embed[:, cur[g]] = codes[g].float()
    embed[:, const] = 1.0
    head_of_group = [g * (heads // kv_heads) for g in range(groups)]  # a query head per group

    def layer(i: int, part: str) -> torch.Tensor:
        return weights[f"model.layers.{i}.self_attn.{part}_proj.weight"]

    # The input norm divides by rms = sqrt(|x|^2 / hidden): |x|^2 counts unit codes and the 1.
    scale0 = math.sqrt((groups + 1) / hidden)  # the input norm divides by this
    for g in range(groups):
        h = head_of_group[g]
        for i in turning:
            theta = float(inv_freq[i])
            layer(0, "k")[g * head_dim + i, const] = PREV_TOKEN_GAIN * scale0
            layer(0, "q")[h * head_dim + i, const] = PREV_TOKEN_GAIN * scale0 * math.cos(theta)
            layer(0, "q")[h * head_dim + i + half, const] = (
                -PREV_TOKEN_GAIN * scale0 * math.sin(theta)
            )
        for j, d in enumerate(content):
            layer(0, "v")[g * head_dim + d, cur[g][j]] = scale0
            layer(0, "o")[prev[g][j], h * head_dim + d] = 1.0

    scale1 = math.sqrt((2 * groups + 1) / hidden)
    for g in range(groups):
        h = head_of_group[g]
        for j, d in enumerate(content):
            layer(1, "q")[h * head_dim + d, cur[g][j]] = MATCH_GAIN * scale1
            layer(1, "k")[g * head_dim + d, prev[g][j]] = MATCH_GAIN * scale1
            layer(1, "v")[g * head_dim + d, cur[g][j]] = scale1
            layer(1, "o")[nxt[g][j], h * head_dim + d] = 1.0

    scale_out = math.sqrt((3 * groups + 1) / hidden)
    head = weights["lm_head.weight"]
    for g in range(groups):
        head[:, nxt[g]] = (LOGIT_GAIN * scale_out * codes[g]).float()
