"""What a request must satisfy to be queued: the one place an engine validates a prompt.

The scheduler applies these rules when a request is added, whoever adds it (`LLM`, `AsyncLLM`
or a test); the HTTP server calls the same rules through the engine's client before it submits
anything, so that a bad request is refused with a 400 before its response starts. Every rule
names the limit and the flag that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


class InvalidRequest(ValueError):
    """A request that can never run here; `param` names the offending field (OpenAI's)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestRules:
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    vocab_size: int | None = None  # unknown to a scheduler run without a model

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest unless the request can run alone in this engine."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty: at least one token is required", "prompt")
        self.check_prompt_len(n)
        for name, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if k is not None and k > MAX_LOGPROBS:
                raise InvalidRequest(f"{name}={k} is more than the maximum, {MAX_LOGPROBS}", name)
        self.check_token_ids(prompt_token_ids, "prompt token ids", "prompt")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids", "stop_token_ids")
        if params.logit_bias:
            if len(params.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequest(
                    f"logit_bias has {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
                    "logit_bias",
                )
            self.check_token_ids([t for t, _ in params.logit_bias], "logit_bias ids", "logit_bias")
        # Every accepted request must be able to finish alone in the whole pool (the
        # scheduler's progress guarantee rests on it). The last token's keys/values are never
        # written, hence the -1.
        final_len = min(n + params.max_tokens, self.max_model_len)
        blocks = -(-(final_len - 1) // self.block_size)
        if blocks > self.num_gpu_blocks:
            raise InvalidRequest(
                f"the request needs up to {blocks} KV blocks ({final_len} tokens) but the pool "
                f"has num_gpu_blocks={self.num_gpu_blocks} (raise --num-gpu-blocks-override,"
                f" --kv-cache-memory or --gpu-memory-utilization, or lower max_tokens)",
                "max_tokens",
            )

    def check_prefill_only(self, prompt_token_ids: list[int]) -> None:
        """A pooling request's rules: a prompt of at most max_model_len tokens (it needs no
        room for output) whose blocks fit the pool."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequest("the input is empty: at least one token is required", "input")
        if n > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens "
                f"(max_model_len, --max-model-len); the input has {n} tokens.",
                "input",
            )
        self.check_token_ids(prompt_token_ids, "input token ids", "input")
        blocks = -(-n // self.block_size)
        if blocks > self.num_gpu_blocks:
            raise InvalidRequest(
                f"the input needs {blocks} KV blocks ({n} tokens) but the pool has "
                f"num_gpu_blocks={self.num_gpu_blocks} (raise --num-gpu-blocks-override or "
                "--kv-cache-memory, or lower --max-model-len)",
                "input",
            )

    def check_token_ids(self, token_ids, what: str, param: str) -> None:
        """Every id must index the vocabulary (when the model is known)."""
        vocab = self.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequest(f"{what} must be in [0, {vocab})", param)

    def check_prompt_len(self, n: int) -> None:
        if n >= self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens "
                f"(max_model_len, --max-model-len); the prompt has {n} tokens, which leaves no "
                "room for output.",
                "prompt",
            )

    def fit_max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """OpenAI's max_tokens: what is left of the context when not given, and an error
        (rather than a silent cap) when the prompt and the request together do not fit."""
        self.check_prompt_len(prompt_len)
        if requested is None:
            return self.max_model_len - prompt_len
        if prompt_len + requested > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} "
                f"tokens. However, you requested {prompt_len + requested} tokens "
                f"({prompt_len} in the prompt, {requested} for the completion).",
                "max_tokens",
            )
        return requested
