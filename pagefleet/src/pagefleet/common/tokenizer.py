"""Loading a checkpoint's tokenizer from a local folder or a GGUF file (engines and the router's
prefix hashing must tokenize alike). transformers' tokenizer classes only: no modelling code, no
torch."""

from __future__ import annotations

import sys
from pathlib import Path

# GGUF metadata key (after "tokenizer.") -> the name transformers' GGUF tokenizer builders use.
_GGUF_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.add_space_prefix": "add_prefix_space",
}
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def load_tokenizer(path: str | Path):
    """The tokenizer of a checkpoint folder (tokenizer.json / tokenizer.model) or a GGUF file
    (its vocabulary, merges, special tokens and chat template metadata)."""
    if str(path).endswith(".gguf"):  # gguf_file.is_gguf, without importing numpy and gguf here
        return gguf_tokenizer(Path(path))
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        raise FileNotFoundError(f"{path} has no tokenizer (tokenizer.json or tokenizer.model)")
    # config=None: AutoTokenizer loads the full config itself
    return AutoTokenizer.from_pretrained(
        str(path), local_files_only=True, config=declared_config(path)
    )


# The model config's fields AutoTokenizer reads when tokenizer_config.json names the class.
_TOKENIZER_CONFIG_FIELDS = ("model_type", "model_name", "tokenizer_class")


def declared_config(path: Path):
    """The model config as AutoTokenizer uses it, without its class: where
    tokenizer_config.json names the tokenizer class and neither file brings remote code,
    AutoTokenizer reads only `_TOKENIZER_CONFIG_FIELDS` and the path of the model's config.
    Its own class is not needed, and its module's imports (transformers.activations, and
    through it torch.distributed.tensor) are 1.2-2.4 s of every engine start. None where
    AutoTokenizer would use more (the full config is then loaded as before)."""
    from pagefleet.common.capacity import read_hf_config  # a JSON object, or ValueError

    try:
        declared = read_hf_config(path / "tokenizer_config.json")
        model = read_hf_config(path / "config.json")
    except (OSError, ValueError):
        return None
    if not isinstance(declared.get("tokenizer_class"), str):
        return None
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # An unknown model type (AutoConfig's fallback names the config differently), remote code,
    # or a versioned config file (AutoConfig reads another file) take the full path.
    model_type = model.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        return None
    if {"auto_map", "configuration_files"} & model.keys() or "auto_map" in declared:
        return None

    config = PreTrainedConfig()
    for field in _TOKENIZER_CONFIG_FIELDS:
        if field in model:
            setattr(config, field, model[field])
    config._name_or_path = str(path)
    return config


def gguf_tokenizer(path: Path):
    """A GGUF's tokenizer, built by transformers' GGUF tokenizer builders from metadata this
    package read (transformers' own GGUF reading imports torch, which the router must not)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from pagefleet.common.gguf_file import GGUFError, read_header

    header = read_header(path)
    meta = header.metadata
    found = {name: meta[f"tokenizer.{key}"] for key, name in _GGUF_TOKENIZER_KEYS.items()
             if f"tokenizer.{key}" in meta}  # fmt: skip
    tokens = found.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{path.name}: no tokenizer.ggml.tokens: pass --tokenizer DIR")
    config: dict = {}
    for flag in ("add_bos_token", "add_eos_token"):
        if isinstance(meta.get(f"tokenizer.ggml.{flag}"), bool):
            config[flag] = meta[f"tokenizer.ggml.{flag}"]
    if found.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to such vocabularies
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    try:
        backend, extra = convert_gguf_tokenizer(header.architecture, found)
    except (KeyError, ValueError, TypeError) as e:
        raise GGUFError(f"{path.name}: its tokenizer metadata cannot be used ({e})") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def keep_model_stack_out() -> None:
    """Called first by processes that never run a model (router, operator). transformers imports
    torch whenever it is installed, only to learn whether it may return tensors; hiding it keeps
    such a process as small where torch is installed (a development venv) as in its own image."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # find_spec("torch") is then None: "not installed"
