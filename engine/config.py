"""Engine configuration: cache and scheduler limits, named and meant as vLLM's engine args."""

from __future__ import annotations

from dataclasses import dataclass


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid ({_flag(name)}): {rule}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int = 0  # the pool's size; sized from memory by the runner when 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(bs >= 1 and bs & (bs - 1) == 0, "block_size", bs, "must be a power of two")
        _require(self.num_gpu_blocks >= 0, "num_gpu_blocks", self.num_gpu_blocks, "must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # Requests whose prompt is split over several steps at once (vLLM's name and default).
    max_num_partial_prefills: int = 1
    # Most prompt tokens one request may compute in one step; 0 means no cap beyond the budget.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be >= 1",
        )
        _require(self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
        _require(
            self.max_num_partial_prefills >= 1,
            "max_num_partial_prefills",
            self.max_num_partial_prefills,
            "must be >= 1",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            "must be >= 0",
        )
        if not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= max_model_len ({self.max_model_len}) without chunked prefill",
            )
