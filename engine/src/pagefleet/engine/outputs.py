"""What generation returns, in vLLM's shapes: `RequestOutput` holding `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One entry per generated (or prompt) token: token id -> Logprob, the chosen token included.
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # A prefill engine's answer to do_remote_decode: where a decode engine reads the blocks.
    kv_transfer_params: dict | None = None


@dataclass
class PoolingOutput:
    data: object  # the pooled vector: a 1-D float32 CPU torch.Tensor (None if aborted)

    @property
    def embedding(self) -> list[float]:
        """The vector as floats (vLLM's EmbeddingOutput.embedding)."""
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's shape), sent once it finished (or aborted)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    finish_reason: str = "stop"  # "abort" when it ended early
    metrics: RequestMetrics | None = None
