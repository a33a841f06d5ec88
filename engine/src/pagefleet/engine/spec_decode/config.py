"""`--speculative-config`: vLLM's JSON, parsed and validated (pure; no torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pagefleet.engine.json_flag import parse_json_object
from pagefleet.engine.model.config import ModelConfig

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = frozenset(
    {
        "method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "model",
        "draft_tensor_parallel_size",
        "disable_by_batch_size",
    }
)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft checkpoint (draft_model)
    # No drafts while this many requests or more are running (vLLM's key): a full batch
    # already keeps the device busy, and verifying guesses only adds work to every step.
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(
        cls, raw: str | dict[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """A config from the flag's JSON (or LLM(...)'s dict); ValueError saying what is wrong."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        raw = parse_json_object("--speculative-config", raw, _KEYS)
        method = raw.get("method")
        if method not in METHODS:
            raise _error(f"method={method!r}: must be one of {', '.join(METHODS)}")
        k = _int(raw, "num_speculative_tokens", None)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _error(f"num_speculative_tokens={k}: must be in 1..{MAX_SPECULATIVE_TOKENS}")
        config = cls._draft_model(raw, k) if method == "draft_model" else cls._ngram(raw, k)
        if "disable_by_batch_size" not in raw:
            return config
        limit = _int(raw, "disable_by_batch_size", None)
        if limit < 1:
            raise _error(f"disable_by_batch_size={limit}: must be >= 1")
        return replace(config, disable_by_batch_size=limit)

    @classmethod
    def _ngram(cls, raw: dict[str, Any], k: int) -> SpeculativeConfig:
        if "model" in raw or "draft_tensor_parallel_size" in raw:
            raise _error("model and draft_tensor_parallel_size are only for method draft_model")
        lo = _int(raw, "prompt_lookup_min", 1)
        hi = _int(raw, "prompt_lookup_max", max(lo, 4))
        if not 1 <= lo <= hi:
            raise _error(f"prompt_lookup_min={lo}, prompt_lookup_max={hi}: need 1 <= min <= max")
        if hi > 64:
            raise _error(f"prompt_lookup_max={hi}: must be <= 64")
        return cls("ngram", k, lo, hi)

    @classmethod
    def _draft_model(cls, raw: dict[str, Any], k: int) -> SpeculativeConfig:
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise _error("model (the draft checkpoint's path) is required for draft_model")
        if _int(raw, "draft_tensor_parallel_size", 1) != 1:
            raise _error("draft_tensor_parallel_size must be 1 (the draft runs on one device)")
        if "prompt_lookup_min" in raw or "prompt_lookup_max" in raw:
            raise _error("prompt_lookup_min/max are only for method ngram")
        return cls("draft_model", k, model=model)


def _int(raw: dict[str, Any], key: str, default: int | None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise _error(f"{key} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(f"{key}={value!r}: must be an integer")
    return value


def _error(what: str) -> ValueError:
    return ValueError(f"--speculative-config {what}")


def refuse_recurrent_state(cfg: ModelConfig, path: str) -> None:
    """A draft model proposes from its own KV, rolled back by forgetting it; a draft with
    recurrent state (a hybrid's linear-attention layers) would need its state rolled back too,
    which is not built (a hybrid target is: kv_cache/state_cache.py)."""
    if cfg.state_shape() is not None:
        raise ValueError(
            f"--speculative-config model {path!r} ({cfg.architecture}) has linear-attention "
            "layers: a hybrid draft model is not supported (its state cannot roll back "
            "rejected drafts); use a draft without them, or method ngram"
        )
