"""A simulated model runner: the real scheduler, KV cache, metrics and events, no forward pass.

Each step sleeps for what a calibrated time model says it would take (prefill time linear in
computed prompt tokens; decode time linear in batch size and KV tokens read), then emits
deterministic filler tokens. Many of these fit on a small machine, which makes fleet-level
experiments (routing, autoscaling) measurable without GPUs.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from pagefleet.engine.scheduler import SchedulerOutput

# Tokens below this id are left alone (special tokens live there in our tokenizers).
FIRST_FILLER_TOKEN = 16
_NOT_CHOSEN = -1e4  # finite, so logprobs stay JSON numbers


@dataclass(frozen=True)
class SimulationProfile:
    """Step time = overhead + prefill x prompt tokens + decode x sequences + kv x KV tokens
    read, all divided by `speedup`. Defaults are shaped like an 8B model on one H100."""

    step_overhead_s: float = 0.004
    prefill_s_per_token: float = 0.00007
    decode_s_per_seq: float = 0.00008
    decode_s_per_kv_token: float = 2.5e-8
    num_gpu_blocks: int = 26_000
    speedup: float = 1.0

    @classmethod
    def load(cls, spec: str | None) -> SimulationProfile:
        """From a JSON object or a path to a JSON file; None gives the defaults."""
        if not spec:
            return cls()
        text = Path(spec).read_text() if Path(spec).is_file() else spec
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--simulate-profile is neither a JSON file nor JSON: {e}") from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--simulate-profile: unknown keys {unknown}; known {sorted(known)}")
        profile = cls(**raw)
        if (
            profile.speedup <= 0
            or min(
                profile.step_overhead_s,
                profile.prefill_s_per_token,
                profile.decode_s_per_seq,
                profile.decode_s_per_kv_token,
            )
            < 0
        ):
            raise ValueError("--simulate-profile: times must be >= 0 and speedup > 0")
        return profile

    def step_seconds(self, prompt_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        busy = (
            prompt_tokens * self.prefill_s_per_token
            + decode_seqs * self.decode_s_per_seq
            + kv_tokens * self.decode_s_per_kv_token
        )
        return (self.step_overhead_s + busy) / self.speedup


def filler_token(request_id: str, position: int, vocab_size: int) -> int:
    """Deterministic per request and position, never a special token."""
    span = max(vocab_size - FIRST_FILLER_TOKEN, 1)
    return FIRST_FILLER_TOKEN + (zlib.crc32(request_id.encode()) + 7919 * position) % span


class SimulatedRunner:
    kv_cache_dtype = "bfloat16"  # what the modelled engine would hold

    def __init__(
        self,
        profile: SimulationProfile,
        vocab_size: int,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.profile = profile
        self.vocab_size = vocab_size
        self.sleep = sleep
        self.simulated_seconds = 0.0

    def execute(self, out: SchedulerOutput):
        prompt_tokens = decode_seqs = kv_tokens = 0
        sample_reqs = []
        for req, n in out.scheduled:
            if req.num_computed_tokens + n >= req.num_tokens:
                sample_reqs.append(req)
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                decode_seqs += 1
                kv_tokens += req.num_computed_tokens + 1
            else:
                prompt_tokens += n
        seconds = self.profile.step_seconds(prompt_tokens, decode_seqs, kv_tokens)
        self.simulated_seconds += seconds
        self.sleep(seconds)
        logits = torch.full((len(sample_reqs), self.vocab_size), _NOT_CHOSEN)
        for row, req in enumerate(sample_reqs):
            logits[row, filler_token(req.request_id, req.num_tokens, self.vocab_size)] = 0.0
        return logits, sample_reqs, {}
