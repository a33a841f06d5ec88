"""`load_tokenizer` hands AutoTokenizer the model config's declared fields instead of the config
class (common/tokenizer.declared_config): the tokenizer it builds must be the one AutoTokenizer
builds from the full config, for every architecture we load and for each kind of declared
tokenizer class (AutoTokenizer's branches on model type and class)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagefleet.common.tokenizer import declared_config, load_tokenizer

TEXTS = ["Hello world, the river and the mountain.", "  spaces\tand\nlines ", "ünïcödé 東京 🙂"]


def fingerprint(tokenizer) -> dict:
    """What an engine uses of a tokenizer: its class, vocabulary, special tokens, template,
    and what it makes of some text (with and without special tokens) and back."""
    return {
        "class": type(tokenizer).__name__,
        "vocab": tokenizer.get_vocab(),
        "special": tokenizer.all_special_tokens,
        "bos_eos": (tokenizer.bos_token_id, tokenizer.eos_token_id),
        "template": tokenizer.chat_template,
        "ids": [tokenizer.encode(t) for t in TEXTS],
        "bare": [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS],
        "text": [tokenizer.decode(tokenizer.encode(t)) for t in TEXTS],
    }


def full(path: str):
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_every_architectures_tokenizer_is_the_one_the_full_config_gives(
    tiny_checkpoints, hybrid_checkpoints, moe_checkpoints
):
    checkpoints = {**tiny_checkpoints, **hybrid_checkpoints, **moe_checkpoints}
    for name, path in checkpoints.items():
        assert declared_config(Path(path)) is not None, name  # the fast path is taken
        assert fingerprint(load_tokenizer(path)) == fingerprint(full(path)), name


def with_declared(
    source: str, path: Path, tokenizer_class: str, model_type: str, **config: object
) -> str:
    """A copy of `source` at `path` whose tokenizer_config.json names `tokenizer_class` and
    whose config.json says `model_type` (and `config`)."""
    shutil.copytree(source, path)
    for name, change in (
        ("tokenizer_config.json", {"tokenizer_class": tokenizer_class}),
        ("config.json", {"model_type": model_type, **config}),
    ):
        data = json.loads((path / name).read_text())
        data.update(change)
        (path / name).write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "tokenizer_class, model_type",
    [
        ("LlamaTokenizerFast", "llama"),  # a declared Llama class over a ByteLevel tokenizer.json
        ("LlamaTokenizer", "mistral"),
        ("GPT2Tokenizer", "qwen2"),  # declared class differs from the model type's own
        ("Qwen2TokenizerFast", "qwen2"),
        ("PreTrainedTokenizerFast", "llama"),
        ("NoSuchTokenizer", "llama"),  # unknown class: AutoTokenizer's fallback
    ],
)
def test_each_declared_class_gives_the_full_configs_tokenizer(
    tiny_checkpoints, tmp_path, tokenizer_class, model_type
):
    path = with_declared(tiny_checkpoints["llama"], tmp_path / "c", tokenizer_class, model_type)
    assert fingerprint(load_tokenizer(path)) == fingerprint(full(path))


def test_the_model_name_and_the_checkpoints_name_choose_as_with_the_full_config(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """AutoTokenizer overrides a declared class by the config's `model_name` and by the name
    the checkpoint is loaded under (hub ids it knows to be declared wrongly): both must reach
    it as they would from the full config."""
    named = with_declared(
        tiny_checkpoints["llama"], tmp_path / "named", "GPT2Tokenizer", "gemma", model_name="qwen2"
    )
    assert fingerprint(load_tokenizer(named)) == fingerprint(full(named))
    monkeypatch.chdir(tmp_path)
    with_declared(
        tiny_checkpoints["llama"], Path("deepseek-ai/deepseek-coder-tiny"), "GPT2Tokenizer", "llama"
    )
    tokenizer = load_tokenizer("deepseek-ai/deepseek-coder-tiny")
    assert type(tokenizer).__name__ == "TokenizersBackend"  # not the declared GPT2Tokenizer
    assert fingerprint(tokenizer) == fingerprint(full("deepseek-ai/deepseek-coder-tiny"))


@pytest.mark.parametrize(
    "file, change",
    [
        ("tokenizer_config.json", {"tokenizer_class": None}),  # class from the config's type
        ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}),
        ("config.json", {"auto_map": {"AutoConfig": "x.Config"}}),
        ("config.json", {"model_type": None}),
        ("config.json", {"model_type": "no-such-model-type"}),  # AutoConfig's fallback
        ("config.json", {"model_type": ["llama"]}),
        ("config.json", {"configuration_files": ["config.v5.json"]}),
    ],
)
def test_a_tokenizer_that_needs_more_of_the_config_gets_the_full_one(
    tiny_checkpoints, tmp_path, file, change
):
    path = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoints["llama"], path)
    data = json.loads((path / file).read_text())
    data.update(change)
    (path / file).write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    assert declared_config(path) is None
