"""Per-request generation parameters, named and defaulted as vLLM's `SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint, as vLLM's `structured_outputs` (exactly one field set).

    Plain, hashable data: the grammar engine compiles it off the engine thread and caches the
    compiled grammar by this value. `json` is a JSON schema as canonical JSON text.
    """

    json: str | None = None
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # an EBNF grammar

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        chosen = [
            name
            for name in ("json", "json_object", "regex", "choice", "grammar")
            if getattr(self, name) not in (None, False)
        ]
        if len(chosen) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(chosen) or 'none'}"
            )


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before
    # sampling (a dict is accepted and kept as sorted pairs, so the params stay hashable).
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # Disaggregation (vLLM's kv_transfer_params): {"do_remote_decode": true} on a prefill
    # engine; a prefill engine's returned params (do_remote_prefill ...) on a decode engine.
    kv_transfer_params: dict | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept a single stop string and lists, as vLLM does.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.logit_bias, dict):
            pairs = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias.items()))
            object.__setattr__(self, "logit_bias", pairs or None)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                f"logprobs must be >= 0, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}",
            ),
            (all(self.stop), "stop strings must not be empty"),
            (
                all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias or ()),
                "logit_bias maps token ids to biases in [-100, 100]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
