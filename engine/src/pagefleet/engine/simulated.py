"""The stand-in model: the real scheduler, KV cache, metrics and events, no forward pass.

Its next token is a deterministic function of the sequence so far (`stand_in_token`), so it
never depends on the batch: preemption, chunking and prefix hits cannot change what a request
generates, and the scheduler's tests and the demo check exactly that with `run_step`.
`SimulatedRunner` serves the same tokens behind `--simulate`: each step sleeps for what a
calibrated time model says it would take (prefill time linear in computed prompt tokens;
decode time linear in batch size and KV tokens read). Many of these fit on a small machine,
which makes fleet-level experiments (routing, autoscaling) measurable without GPUs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from pagefleet.engine.request import Request
from pagefleet.engine.scheduler import Scheduler, SchedulerOutput

# Tokens below this id are left alone (special tokens live there in our tokenizers).
FIRST_FILLER_TOKEN = 16
_NOT_CHOSEN = -1e4  # finite, so logprobs stay JSON numbers
STAND_IN_VOCAB = 32000  # the vocabulary of scheduler-only runs (no model, no tokenizer)


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


def stand_in_token(token_ids: list[int], vocab_size: int, first: int = 0) -> int:
    """The next token after `token_ids`: a function of the sequence so far (its last token
    and length), never of the batch; in [first, vocab_size)."""
    span = max(vocab_size - first, 1)
    return first + (token_ids[-1] * 1103515245 + len(token_ids)) % span


def run_step(
    scheduler: Scheduler, out: SchedulerOutput, vocab_size: int = STAND_IN_VOCAB
) -> list[Request]:
    """Finish one scheduled step as the stand-in model: a token for every request whose
    prompt is done. Returns the requests that finished."""
    sampled = [stand_in_token(r.all_token_ids, vocab_size) for r in out.samples()]
    return scheduler.update_from_output(out, sampled)


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

    def state_config(self) -> None:
        """No recurrent state: a simulated hybrid runs its scheduler as a dense model's."""
        return None

    def expert_load(self) -> None:
        """No router runs here (ModelRunner.expert_load)."""
        return None

    def execute(self, out: SchedulerOutput):
        """Sleep for the step's modelled time; returns (logits that make the stand-in token
        the only choice, the requests that sample, no prompt logprobs), as ModelRunner."""
        prompt_tokens = decode_seqs = kv_tokens = 0
        sample_reqs = out.samples()
        for req, n in out.scheduled:
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
            token = stand_in_token(req.all_token_ids, self.vocab_size, FIRST_FILLER_TOKEN)
            logits[row, token] = 0.0
        return logits, sample_reqs, {}
