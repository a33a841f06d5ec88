"""The tiny random demo checkpoint in pagefleet's cache ($PAGEFLEET_CACHE or ~/.cache/pagefleet),
for tests, benchmarks and `--tiny` demos; the trained demo model is common/demo_model.py's."""

from __future__ import annotations

import sys
from pathlib import Path

from pagefleet.common.demo_model import SMOLLM2, cache_dir, ensure_demo_model

__all__ = ["cache_dir", "demo_checkpoint", "model_to_serve"]
TINY_SERVED_NAME = "demo"


def model_to_serve(model: str | None, tiny: bool, served_name: str | None) -> tuple[str, str]:
    """What `pagefleet up` and `pagefleet demo` serve and its name in the API: `--model`, the
    tiny random checkpoint (`--tiny`), or by default the trained demo model, fetched the first
    time (common/demo_model.py) with its progress on stderr."""
    if model and tiny:
        raise ValueError("--model and --tiny name two models: give one")
    if model or tiny:
        return str(model or demo_checkpoint()), served_name or TINY_SERVED_NAME
    path = ensure_demo_model(cache_dir(), out=sys.stderr)
    return str(path), served_name or SMOLLM2.served_name


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
