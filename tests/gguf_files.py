"""Small GGUF files for tests, written with the `gguf` library as llama.cpp's converter writes
them: a tiny HF checkpoint's weights under llama.cpp's names (q/k rows interleaved for the
`llama` architecture), its hyper-parameters and its byte-level BPE tokenizer as metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def interleave_rotary(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a llama q/k projection's rows."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


# The float16 scale fields of the k-quant blocks (byte offset, value), set when a test writes
# random blocks of a type the `gguf` library cannot quantize: values then stay near 0.1.
K_QUANT_SCALES = {
    T.Q4_K: ((0, 1e-4), (2, 1e-4)),
    T.Q5_K: ((0, 5e-5), (2, 5e-5)),
    T.Q6_K: ((208, 2e-5),),
}


def random_blocks(rows: int, cols: int, qtype: T, seed: int) -> np.ndarray:
    """Random `qtype` blocks for a `[rows, cols]` tensor, with sane scales."""
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // values, nbytes))
    data = data.astype(np.uint8)
    for offset, value in K_QUANT_SCALES[qtype]:
        data[:, :, offset : offset + 2] = np.array([value], np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def write_gguf_of(
    hf_dir: str | Path,
    out: str | Path,
    weight_type: T = T.F32,
    types: dict[str, T] | None = None,
) -> Path:
    """The checkpoint at `hf_dir` as a GGUF file: 2-D weights in `weight_type` (a projection
    named in `types`, e.g. {"v_proj": T.Q6_K}, in its own; a k-quant as random blocks), the
    rest F32."""
    from safetensors.numpy import load_file

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), arch)
    _hyper_parameters(writer, config)
    _tokenizer(writer, hf_dir)
    weights = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, tensor in sorted(weights.items()):
        values = tensor.astype(np.float32)
        projection = name.split(".")[-2]
        if arch == "llama" and projection in heads:
            values = interleave_rotary(values, heads[projection])
        qtype = (types or {}).get(projection, weight_type) if values.ndim == 2 else T.F32
        if qtype in K_QUANT_SCALES:
            data = random_blocks(*values.shape, qtype, seed=len(name))
        else:
            data = gguf.quants.quantize(values, qtype) if qtype != T.F32 else values
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _hyper_parameters(writer: gguf.GGUFWriter, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))


def _tokenizer(writer: gguf.GGUFWriter, hf_dir: Path) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    settings = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    writer.add_bos_token_id(vocab[settings["bos_token"]])
    writer.add_eos_token_id(vocab[settings["eos_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template((hf_dir / "chat_template.jinja").read_text())
