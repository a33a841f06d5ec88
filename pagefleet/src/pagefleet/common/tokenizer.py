"""Loading a checkpoint's tokenizer from a local folder (engines and the router's prefix hashing
must tokenize alike). transformers' tokenizer classes only: no modelling code, no torch."""

from __future__ import annotations

import sys
from pathlib import Path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        raise FileNotFoundError(f"{path} has no tokenizer (tokenizer.json or tokenizer.model)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def keep_model_stack_out() -> None:
    """Called first by processes that never run a model (router, operator). transformers imports
    torch whenever it is installed, only to learn whether it may return tensors; hiding it keeps
    such a process as small where torch is installed (a development venv) as in its own image."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # find_spec("torch") is then None: "not installed"
