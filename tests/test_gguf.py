"""GGUF checkpoints: every tensor type pagefleet loads dequantizes to the `gguf` library's
reference values, the metadata of llama, qwen2 and qwen3 files becomes the config their HF
checkpoint has and serves the same greedy tokens as transformers, and hostile files are refused
with one line before anything large is allocated."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from gguf_files import write_gguf_of
from hf_reference import hf_greedy
from pagefleet.common.gguf_file import GGUFError, map_file, read_header
from pagefleet.common.tokenizer import load_tokenizer
from pagefleet.engine.model.checkpoint import read_config
from pagefleet.engine.model.gguf import GGUFTensorSource

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
LOADED_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]
PROMPT = (5, 17, 42, 99, 7, 300, 12, 64, 8, 150, 3, 77)


def _blocks_with_scales(qtype: T, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks of a k-quant whose float16 scale fields are finite (the rest of a block is
    bits, any value of which is valid)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale_at = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
    for at in scale_at:
        scales = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _encoded(qtype: T, values: np.ndarray, rng) -> np.ndarray:
    if qtype == T.F32:
        return values
    if qtype == T.F16:
        return values.astype(np.float16)
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):  # the library can decode these, not encode them
        return _blocks_with_scales(qtype, *values.shape, rng)
    return gguf.quants.quantize(values, qtype)


def test_every_loaded_tensor_type_dequantizes_to_the_gguf_reference(tmp_path):
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "types.gguf"), "llama")
    for qtype in LOADED_TYPES:
        values = rng.standard_normal((3, 512)).astype(np.float32)
        writer.add_tensor(qtype.name, _encoded(qtype, values, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reference = gguf.GGUFReader(str(tmp_path / "types.gguf"))
    header = read_header(tmp_path / "types.gguf")
    file = map_file(tmp_path / "types.gguf")
    for tensor in reference.tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        source = GGUFTensorSource(tensor.name, header.tensors[tensor.name], file)
        assert source.ggml_type == tensor.tensor_type
        assert source.shape == (3, 512)
        got = source.read()
        assert got.dtype == torch.float32
        assert torch.equal(got, torch.tensor(expected).reshape(3, 512)), tensor.name
    assert {t.tensor_type for t in reference.tensors} == set(LOADED_TYPES)


# (architecture, tiny checkpoint options): GQA with interleaved q/k rows (llama), q/k/v biases
# and tied embeddings (qwen2), q/k norms and a head_dim that is not hidden/heads (qwen3).
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "num_kv_heads": 4}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32, "num_heads": 4, "num_kv_heads": 2}),
}
CONFIG_KEYS = [
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
]


@pytest.fixture(scope="module")
def family_files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (HF checkpoint dir, the same weights as an F32 GGUF)."""
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("gguf-families")
    files = {}
    for name, (arch, opts) in FAMILIES.items():
        hf_dir = write_tiny_checkpoint(root / name, arch, **opts)
        files[name] = (str(hf_dir), str(write_gguf_of(hf_dir, root / f"{name}.gguf")))
    return files


def _greedy(model: str, max_tokens: int = 8, **engine_args) -> tuple[int, ...]:
    from pagefleet.engine.llm import LLM
    from pagefleet.engine.sampling_params import SamplingParams

    llm = LLM(model, dtype="float32", kv_cache_memory=0.05, max_model_len=256, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([list(PROMPT)], params, use_tqdm=False)[0].outputs[0].token_ids
    return tuple(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_metadata_is_the_hf_config_and_greedy_equals_transformers(family_files, family):
    hf_dir, gguf_file = family_files[family]
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    config = read_config(gguf_file)
    assert {k: config[k] for k in CONFIG_KEYS} == {k: hf_config[k] for k in CONFIG_KEYS}
    heads = hf_config["num_attention_heads"]
    assert config["head_dim"] == hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    assert config["tie_word_embeddings"] == hf_config.get("tie_word_embeddings", False)
    assert config["rms_norm_eps"] == pytest.approx(hf_config["rms_norm_eps"], rel=1e-6)
    assert config["rope_theta"] == hf_config.get("rope_theta", 10000.0)
    assert _greedy(gguf_file) == hf_greedy(hf_dir, PROMPT, 8)


def test_quantized_gguf_greedy_equals_transformers_loading_the_same_file(family_files, tmp_path):
    """Q4_1 weights (the demo model's type): transformers dequantizes the file itself."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf_dir, _ = family_files["llama"]
    file = write_gguf_of(hf_dir, tmp_path / "llama-q4_1.gguf", T.Q4_1)
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=file.name, dtype=torch.float32
    ).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([PROMPT]), generation_config=config)[0, len(PROMPT) :]
    assert _greedy(str(file)) == tuple(theirs.tolist())


def test_gguf_tokenizer_is_the_checkpoints_and_tokenizer_flag_takes_a_folder(family_files):
    hf_dir, gguf_file = family_files["qwen2"]
    ours, theirs = load_tokenizer(gguf_file), load_tokenizer(hf_dir)
    text = "Hello world, what is a cache?  Two  spaces\n\nand <|im_end|> a special token"
    assert ours(text).input_ids == theirs(text).input_ids
    chat = [{"role": "user", "content": "what is a block?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == (
        theirs.apply_chat_template(chat, add_generation_prompt=True)
    )
    assert (ours.eos_token, ours.bos_token) == (theirs.eos_token, theirs.bos_token)

    from pagefleet.engine.llm import LLM

    llm = LLM(gguf_file, tokenizer=hf_dir, kv_cache_memory=0.05, max_model_len=256)
    assert llm.get_tokenizer().name_or_path == hf_dir


# ------------------------------------------------------------------------------ hostile files


@pytest.fixture(scope="module")
def good_gguf(family_files) -> bytes:
    return Path(family_files["llama"][1]).read_bytes()


def _field_after(data: bytes, key: bytes) -> int:
    """Offset just past the string `key` (a metadata key or a tensor name) in the header."""
    at = data.index(struct.pack("<Q", len(key)) + key)
    return at + 8 + len(key)


def _patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt) :]


def _tensor_field(data: bytes, name: bytes, field: str) -> int:
    """Offset of a tensor entry's `type` or `offset` field (after its 2 dims)."""
    dims_at = _field_after(data, name) + 4
    return dims_at + 16 + (0 if field == "type" else 4)


def _rewritten(family_files, tmp_path, arch: str = "llama", **changes) -> bytes:
    """The llama GGUF written again with some metadata changed or tensors added."""
    hf_dir = Path(family_files["llama"][0])
    config = json.loads((hf_dir / "config.json").read_text())
    copy = tmp_path / "hf"
    copy.mkdir()
    for f in hf_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    out = write_gguf_of(copy, tmp_path / "rewritten.gguf")
    data = out.read_bytes()
    if arch != "llama":  # as long as "llama": its key prefixes and its name change together
        data = data.replace(b"llama", arch.encode())
    return data


HOSTILE = {
    "wrong magic": (lambda d, ff, tp: b"GGUX" + d[4:], "not a GGUF file"),
    "cut in the header": (lambda d, ff, tp: d[:200], "truncated"),
    "cut in the tensor data": (lambda d, ff, tp: d[: len(d) * 2 // 3], "truncated: tensor"),
    "empty": (lambda d, ff, tp: b"", "truncated"),
    "version 99": (lambda d, ff, tp: _patched(d, 4, "<I", 99), "GGUF version 99"),
    "2^62 tensors": (lambda d, ff, tp: _patched(d, 8, "<Q", 1 << 62), "declares"),
    "2^62 metadata entries": (lambda d, ff, tp: _patched(d, 16, "<Q", 1 << 62), "declares"),
    "a 2^60-byte key": (lambda d, ff, tp: _patched(d, 24, "<Q", 1 << 60), "string of"),
    "2^50 tokens": (
        lambda d, ff, tp: _patched(d, _field_after(d, b"tokenizer.ggml.tokens") + 8, "<Q", 1 << 50),
        "declares",
    ),
    "unknown tensor type": (
        lambda d, ff, tp: _patched(d, _tensor_field(d, b"output.weight", "type"), "<I", 999),
        "unknown ggml type 999",
    ),
    "tensor past the end": (
        lambda d, ff, tp: _patched(d, _tensor_field(d, b"output.weight", "offset"), "<Q", 1 << 40),
        "truncated: tensor",
    ),
    "unsupported tensor type": (
        lambda d, ff, tp: _patched(d, _tensor_field(d, b"output.weight", "type"), "<I", 6),
        "Q5_0, which pagefleet does not load",
    ),
    "a 2^30-wide model in a small file": (
        lambda d, ff, tp: _rewritten(ff, tp, hidden_size=1 << 30),
        "has shape",
    ),
    "unsupported architecture": (
        lambda d, ff, tp: _rewritten(ff, tp, arch="gemma"),
        "architecture 'gemma' is not supported",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_gguf_is_refused_in_one_line_without_a_large_allocation(
    case, good_gguf, family_files, tmp_path
):
    make, expected = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(make(good_gguf, family_files, tmp_path))
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError) as refused:
            read_config(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert expected in message and "\n" not in message, message
    assert peak < 8 << 20, f"{peak} bytes allocated before refusing"


def test_pagefleet_serve_refuses_a_hostile_gguf_with_exit_2_and_one_line(good_gguf, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(good_gguf[: len(good_gguf) // 2])
    run = subprocess.run(
        [PAGEFLEET, "serve", str(path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith(f"pagefleet serve: error: {path.name}: truncated: "), run.stderr
    assert "Traceback" not in run.stderr
