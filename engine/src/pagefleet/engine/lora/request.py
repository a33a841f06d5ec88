"""Which adapter a request runs with, named as vLLM's `LoRARequest`."""

from __future__ import annotations

import re
from dataclasses import dataclass

# An adapter's name is a request's `model`, a metric label and part of its blocks' hashes:
# short, printable, no separators the metrics' comma-joined lists or paths would misread.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter: its name (what clients put in `model`), the engine's integer id for it
    (unique while the engine runs, never reused) and the folder of its PEFT files."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None


def check_name(name: object) -> str:
    """`name` if it can name an adapter, else ValueError saying what a name may hold."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"LoRA adapter name {name!r}: 1-128 characters of letters, digits and . _ : / @ + -, "
            "starting with a letter or digit"
        )
    return name
