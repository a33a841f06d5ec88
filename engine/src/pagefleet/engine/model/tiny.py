"""Write tiny random Hugging Face checkpoints (config, safetensors, tokenizer, chat template).

Used by tests, examples and the local demo: made with `transformers` and `tokenizers` on the
spot, never downloaded. The tokenizer is a byte-level BPE trained on a small built-in corpus,
so any text encodes and decodes exactly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WORDS = (
    "the a an of to in on for with by from cache block token page pool model serve request "
    "router engine prefill decode batch queue memory key value attention layer head prompt "
    "user assistant system hello world what is how does why can you tell me about please "
    "write short story poem list three reasons fast slow large small good bad new old first "
    "last one two three four five six seven eight nine ten cat dog tree river mountain sky "
    "blue green red time day night water fire light dark question answer because and or not"
).split()

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
# Multimodal architectures: the language model's config is their text_config, beside a vision
# tower made as small as the config allows (its weights are written, never served).
MULTIMODAL = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
}
TINY_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "patch_size": 2,
    "temporal_patch_size": 1,
    "spatial_merge_size": 1,
    "num_position_embeddings": 4,
}


def _corpus(seed: int, lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


def write_tiny_checkpoint(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.1,
    max_shard_size: str | None = None,
    seed: int = 0,
    **extra_config,
) -> Path:
    """Write a random checkpoint of `architecture` to `path` and return the path.

    `vocab_size` defaults to the tokenizer's size; a larger one pads the embedding like real
    models do. `max_shard_size` (e.g. "100KB") splits the weights into indexed shards. Other
    keyword arguments go to the HF config (e.g. attention_bias, mlp_bias, sliding_window).
    """
    import torch
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; one of {sorted(ARCHITECTURES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed=seed)
    vocab = vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer ({len(tokenizer)})")
    model_type = ARCHITECTURES[architecture]
    config_cls = transformers.AutoConfig.for_model(MULTIMODAL.get(architecture, model_type))
    config_cls = config_cls.__class__
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    # A config without a dense MLP (Qwen3.5-MoE's: experts in every layer) is not given one.
    fields = getattr(config_cls, "__dataclass_fields__", None)
    if fields is None or "intermediate_size" in fields:
        extra_config["intermediate_size"] = intermediate_size
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        rope_parameters=rope,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra_config,
    )
    if architecture in MULTIMODAL:
        vision = {**TINY_VISION, "out_hidden_size": hidden_size}
        outer = transformers.AutoConfig.for_model(model_type).__class__
        config = outer(
            text_config=config.to_dict(),
            vision_config=vision,
            tie_word_embeddings=tie_word_embeddings,
        )
    torch.manual_seed(seed)
    model_cls = getattr(transformers, architecture)
    model = model_cls(config).to(torch.float32)
    # Random biases (HF starts them at 0), so a loader or kernel that drops one fails the
    # equality tests: Qwen2's q/k/v, and Llama's o and MLP ones where the config asks.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, initializer_range)
    if model_type.startswith("qwen3_5"):
        # Norms start at 0 (zero-centred: applied as 1 + w) or 1 (the gated norm), and dt_bias
        # at 1: random values, so a norm loaded without its offset, or swapped with another,
        # fails the equality tests.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("norm.weight", "dt_bias")):
                    param.add_(torch.randn(param.shape) * 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tokenizer.save_pretrained(path)
    meta = json.loads((path / "config.json").read_text())
    assert meta["architectures"] == [architecture], meta["architectures"]
    return path
