"""Per-request pooling parameters, named and defaulted as vLLM's `PoolingParams`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    # Matryoshka truncation of the vector (then renormalised if the model normalises); None:
    # the engine's --pooler-config dimensions, else the full vector.
    dimensions: int | None = None
    # Keep only the last k prompt tokens (left truncation, as vLLM); -1: the last
    # max_model_len; None: a longer prompt is refused.
    truncate_prompt_tokens: int | None = None

    @property
    def n(self) -> int:
        """One vector per prompt (the engine client counts sequences as n per request)."""
        return 1

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError("dimensions must be at least 1")
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as it will run: its last k tokens when truncation is asked for."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        if k > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={k} is more than max_model_len ({max_model_len})"
            )
        return token_ids[-(max_model_len if k == -1 else k) :]
