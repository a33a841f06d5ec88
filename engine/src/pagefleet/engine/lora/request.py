"""Which adapter a request runs with, named as vLLM's `LoRARequest`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagefleet.common.names import LORA_NAME_PATTERN

NAME_PATTERN = re.compile(LORA_NAME_PATTERN)


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
