"""Where pagefleet keeps generated files (the demo checkpoint): $PAGEFLEET_CACHE or ~/.cache."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("PAGEFLEET_CACHE") or Path.home() / ".cache" / "pagefleet"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def demo_checkpoint() -> Path:
    """The tiny demo model, written on first use (random weights; never downloaded)."""
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    path = cache_dir() / "demo-llama"
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + ".partial")
        write_tiny_checkpoint(
            tmp,
            "LlamaForCausalLM",
            hidden_size=128,
            intermediate_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
        )
        tmp.rename(path)
    return path
