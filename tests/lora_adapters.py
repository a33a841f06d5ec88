"""Random PEFT LoRA adapters for the tiny checkpoints, written with `peft` itself, and
transformers + peft as the oracle of each adapter's greedy output.

The adapters differ where the engine could go wrong: rank (2, 4, 8; one of 16 for the rank
limit), targets (attention only, MLP only, all seven projections: fused q/k/v and gate/up
parts present or absent) and scaling (alpha / r, and rsLoRA's alpha / sqrt(r)).
`init_lora_weights=False` makes B random too, so every adapter changes the greedy output.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "sql": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "chat": {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS, "use_rslora": True},
    "math": {"r": 2, "lora_alpha": 4, "target_modules": ["gate_proj", "down_proj"]},
    "wide": {"r": 16, "lora_alpha": 16, "target_modules": ["o_proj", "up_proj"]},
}


def write_adapter(base: str, folder: Path, seed: int, **lora_config) -> str:
    """A random adapter of `base` (a tiny checkpoint) saved by peft into `folder`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(init_lora_weights=False, **lora_config)
    get_peft_model(model, config).save_pretrained(str(folder))
    return str(folder)


def write_adapters(base: str, root: Path) -> dict[str, str]:
    return {
        name: write_adapter(base, root / name, seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items(), start=1)
    }


@functools.lru_cache(maxsize=8)
def peft_model(base: str, adapter: str | None):
    from peft import PeftModel

    from hf_reference import hf_model

    model = hf_model(base)
    if adapter is None:
        return model
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    fresh.generation_config.eos_token_id = None
    return PeftModel.from_pretrained(fresh, adapter).eval()


@functools.lru_cache(maxsize=256)
def peft_greedy(
    base: str, adapter: str | None, prompt: tuple[int, ...], max_tokens: int
) -> tuple[int, ...]:
    """transformers + peft's greedy tokens for `prompt` with `adapter` (None: the base)."""
    model = peft_model(base, adapter)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tuple(out[0, len(prompt) :].tolist())


def assert_peft_greedy_equal(
    base: str, adapter: str | None, prompt: list[int], ours: list[int], max_tokens: int
) -> None:
    """Ours equal to transformers + peft's greedy tokens; a divergence passes only as a
    genuine near-tie (hf_reference.assert_greedy_equal's rule, on the adapted model)."""
    ref = list(peft_greedy(base, adapter, tuple(prompt), max_tokens))
    assert len(ours) == len(ref), (len(ours), len(ref))
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        with torch.no_grad():
            logits = peft_model(base, adapter)(torch.tensor([prompt + ref[:i]])).logits[0, -1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        top2 = set(lp.topk(2).indices.tolist())
        gap = abs(lp[a].item() - lp[b].item())
        assert a in top2 and b in top2 and gap < 1e-4, (
            f"adapter {adapter}: diverged from transformers + peft at output token {i}: "
            f"ours {a}, theirs {b}, logprob gap {gap:.2e}"
        )
        return


def peft_text(base: str, adapter: str | None, prompt: list[int], max_tokens: int) -> str:
    """transformers + peft's greedy continuation as the engine's API returns it: text, special
    tokens skipped."""
    from pagefleet.common.tokenizer import load_tokenizer

    tokens = peft_greedy(base, adapter, tuple(prompt), max_tokens)
    return load_tokenizer(base).decode(list(tokens), skip_special_tokens=True)
