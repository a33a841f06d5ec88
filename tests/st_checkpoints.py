"""Tiny sentence-transformers checkpoints, made from the session's tiny random ones in a moment:
a copy plus the files sentence-transformers reads (modules.json, 1_Pooling/config.json, a
Normalize module), in its 6.x format or the older one most Hub checkpoints carry, optionally
re-saved as a base model (`*Model`: no LM head, no `model.` prefix, as e5-mistral ships).
`sentence-transformers`' own `encode` on the same directory is the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LEGACY_MODES = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens"}
LEGACY_MODES["cls"] = "pooling_mode_cls_token"
ST6_TYPES = {
    "Transformer": "sentence_transformers.base.modules.transformer.Transformer",
    "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    "Normalize": "sentence_transformers.base.modules.normalize.Normalize",
}


def st_checkpoint(
    src: str,
    dst: Path,
    mode: str,
    normalize: bool,
    *,
    legacy: bool = False,
    base_arch: str | None = None,
    max_seq_length: int | None = None,
    **config,
) -> str:
    """`src` copied to `dst` with a Transformer → Pooling(`mode`) [→ Normalize] pipeline;
    `config` keys go into config.json (e.g. matryoshka_dimensions)."""
    shutil.copytree(src, dst)
    hf = json.loads((dst / "config.json").read_text())
    if base_arch is not None:
        _as_base_model(dst)
        hf["architectures"] = [base_arch]
    (dst / "config.json").write_text(json.dumps({**hf, **config}))
    kinds = ["Transformer", "Pooling"] + (["Normalize"] if normalize else [])
    paths = ["", "1_Pooling", "2_Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": paths[i], "type": _type_name(kind, legacy)}
        for i, kind in enumerate(kinds)
    ]
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    width = hf["hidden_size"]
    if legacy:
        pooling = {"word_embedding_dimension": width, **{v: False for v in LEGACY_MODES.values()}}
        pooling[LEGACY_MODES[mode]] = True
    else:
        pooling = {"embedding_dimension": width, "pooling_mode": mode, "include_prompt": True}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        (dst / "2_Normalize").mkdir()
        (dst / "2_Normalize" / "config.json").write_text("{}")
    if max_seq_length is not None:
        bert = {"max_seq_length": max_seq_length, "do_lower_case": False}
        (dst / "sentence_bert_config.json").write_text(json.dumps(bert))
    return str(dst)


def _type_name(kind: str, legacy: bool) -> str:
    return f"sentence_transformers.models.{kind}" if legacy else ST6_TYPES[kind]


def _as_base_model(path: Path) -> None:
    """The weights as a base model saves them: no LM head, names without `model.`."""
    from safetensors.torch import load_file, save_file

    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
        file.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    kept = {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in kept.items()}, path / "model.safetensors")
