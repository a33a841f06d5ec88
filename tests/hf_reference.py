"""HF transformers as the oracle: greedy references and the near-tie rule for comparing them."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# (architecture, checkpoint options): together they cover GQA 2:1, MQA, MHA-free head_dim,
# llama3 rope scaling, tied embeddings, q/k/v biases, q/k norms and sharded weights.
ARCH_CASES = {
    "llama": (
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("MistralForCausalLM", {"num_kv_heads": 1, "max_shard_size": "100KB"}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "num_kv_heads": 4}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32, "num_heads": 4, "num_kv_heads": 2}),
}

# Hybrid (Qwen3.5) checkpoints of odd shapes: linear/full patterns (explicit, and every 4th
# layer full), head dims that are not powers of two, grouped value heads (2:1 and 3:1), conv
# kernels 4 and 3, partial rotary 1/4 and 1/2, tied and untied embeddings, the multimodal
# wrapper's weight names.
HYBRID_CASES = {
    "qwen3_5": (
        "Qwen3_5ForCausalLM",
        {
            "num_layers": 5,
            "layer_types": [
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            "hidden_size": 48,
            "intermediate_size": 96,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 24,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 12,
            "linear_value_head_dim": 20,
            "linear_conv_kernel_dim": 4,
        },
    ),
    "qwen3_5_vl": (
        "Qwen3_5ForConditionalGeneration",
        {
            "num_layers": 4,
            "hidden_size": 40,
            "intermediate_size": 72,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 20,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 3,
            "linear_key_head_dim": 12,
            "linear_value_head_dim": 10,
            "linear_conv_kernel_dim": 3,
            "rope_scaling": {"partial_rotary_factor": 0.5},
            "tie_word_embeddings": True,
        },
    ),
}

# Mixture-of-experts checkpoints, apart from ARCH_CASES (their tests are their own): expert
# counts the tensor-parallel size 2 does not divide (5 and 3, so expert parallelism places
# them unevenly), a dense layer among the sparse ones (mlp_only_layers), top-k probabilities
# renormalised (Mixtral and Qwen3.5-MoE always) or not (Qwen3-MoE's default); Qwen3.5-MoE as
# published (the multimodal wrapper): hybrid layers, a shared expert of another width than the
# routed ones, head dims that are not powers of two.
MOE_CASES = {
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {
            "num_layers": 3,
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {"num_local_experts": 3, "num_experts_per_tok": 2, "intermediate_size": 48},
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeForConditionalGeneration",
        {
            "num_layers": 3,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "hidden_size": 48,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 24,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 12,
            "linear_value_head_dim": 20,
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 20,
        },
    ),
}


def hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # No EOS at all: HF neither stops at it nor masks it (min_new_tokens would mask it, which
    # is not what ignore_eos means), so both sides run exactly max_tokens greedy steps.
    model.generation_config.eos_token_id = None
    return model


@functools.lru_cache(maxsize=4096)
def hf_greedy(path: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    from transformers import GenerationConfig

    model = hf_model(path)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return tuple(out[0, len(prompt) :].tolist())


def hf_logprobs(
    path: str, token_ids: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """log-softmax of HF's next-token logits after each position: [len, vocab] (computed in
    `dtype`, returned in float32)."""
    with torch.no_grad():
        logits = hf_model(path, dtype)(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_top1_agrees(
    path: str,
    dtype: torch.dtype,
    prompts: list[list[int]],
    outputs: list[list[int]],
    min_agreement: float = 0.9,
    max_gap: float = 0.05,
) -> float:
    """Half precision cannot match token for token (rounding reorders near-ties, and one
    different token changes everything after it), so: HF in `dtype`, fed our tokens (teacher
    forcing), must pick our token as its top-1 at >= `min_agreement` of the positions, and
    where it does not, our token must be within `max_gap` nats of its top-1 (a near-tie in that
    dtype). Returns the agreement."""
    agree, total = 0, 0
    for prompt, ours in zip(prompts, outputs, strict=True):
        rows = hf_logprobs(path, prompt + ours, dtype)[len(prompt) - 1 : -1]
        for i, (row, token) in enumerate(zip(rows, ours, strict=True)):
            total += 1
            if int(row.argmax()) == token:
                agree += 1
                continue
            gap = (row.max() - row[token]).item()
            assert gap <= max_gap, (
                f"output token {i}: ours {token}, HF {dtype} top-1 {int(row.argmax())}, "
                f"{gap:.3f} nats apart"
            )
    assert agree >= min_agreement * total, f"top-1 agreement {agree}/{total}"
    return agree / total


def assert_greedy_equal(path: str | Path, prompt: list[int], ours: list[int], max_tokens: int):
    """Ours must equal HF's greedy tokens; a divergence passes only as a genuine near-tie: the
    two tokens are each in the other's top-2 and their logprobs differ by < 1e-4 (vLLM's
    check_logprobs_close criterion). Tokens after a near-tie are not compared."""
    path = str(path)
    ref = list(hf_greedy(path, tuple(prompt), max_tokens))
    assert len(ours) == len(ref), (len(ours), len(ref))
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        lp = hf_logprobs(path, prompt + ref[:i])[-1]
        top2 = set(lp.topk(2).indices.tolist())
        gap = abs(lp[a].item() - lp[b].item())
        assert a in top2 and b in top2 and gap < 1e-4, (
            f"diverged from HF at output token {i}: ours {a}, HF {b}, logprob gap {gap:.2e}, "
            f"HF top-2 {sorted(top2)}"
        )
        return


def assert_greedy_matches_hf(path: str | Path, prompt: list[int], ours: list[int]) -> None:
    """assert_greedy_equal's verdict from one HF forward instead of a generation: fed the prompt
    and our tokens, HF's top-1 at every output position must be our token (by induction, that
    is HF's greedy continuation), or a genuine near-tie (the same rule), after which the rest is
    not compared."""
    rows = hf_logprobs(str(path), prompt + ours[:-1])[len(prompt) - 1 :]
    for i, (row, token) in enumerate(zip(rows, ours, strict=True)):
        top = int(row.argmax())
        if top == token:
            continue
        top2 = set(row.topk(2).indices.tolist())
        gap = (row[top] - row[token]).item()
        assert token in top2 and gap < 1e-4, (
            f"diverged from HF at output token {i}: ours {token}, HF {top}, logprob gap "
            f"{gap:.2e}, HF top-2 {sorted(top2)}"
        )
        return


def randomise_biases(file) -> None:
    """Give every bias in a safetensors file random values (HF initialises them to zero, so a
    loader that drops or misplaces a bias would otherwise go unnoticed)."""
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(0)
    weights = load_file(file)
    for name, tensor in weights.items():
        if name.endswith(".bias"):
            weights[name] = torch.randn(tensor.shape, generator=generator) * 0.5
    save_file(weights, file, metadata={"format": "pt"})
