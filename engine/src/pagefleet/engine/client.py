"""The engine as its server sees it: limits, counts, a stats snapshot, generate and abort.

`AsyncLLM` implements `EngineClient` (vLLM's name for the same seam). The HTTP server and its
metrics depend on this and nothing deeper, so the scheduler, the KV cache and the core loop
can change without the server noticing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagefleet.engine.model.expert_load import ExpertLoadStats
from pagefleet.engine.outputs import PoolingRequestOutput, RequestOutput
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.spec_decode.stats import SpecDecodeStats
from pagefleet.engine.validation import RequestRules

if TYPE_CHECKING:
    from pagefleet.engine.pooling.config import PoolingModel
    from pagefleet.engine.pooling.params import PoolingParams


@dataclass(frozen=True)
class EngineLimits:
    """What an engine is, fixed at start-up."""

    rules: RequestRules  # what a request must satisfy (max_model_len, vocabulary, pool)
    max_num_seqs: int
    enable_prefix_caching: bool
    kv_cache_dtype: str
    max_loras: int = 0  # LoRA adapters one step runs; 0: LoRA is off
    pooling: PoolingModel | None = None  # set on a pooling engine (--runner pooling)

    @property
    def runner(self) -> str:
        return "generate" if self.pooling is None else "pooling"

    @property
    def max_model_len(self) -> int:
        return self.rules.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.rules.vocab_size

    @property
    def block_size(self) -> int:
        return self.rules.block_size

    @property
    def num_gpu_blocks(self) -> int:
        return self.rules.num_gpu_blocks


@dataclass(frozen=True)
class KVTransferStats:
    """Cumulative KV pulls of a decode engine."""

    bytes: int
    transfers: int
    failures: int
    fallbacks: int


@dataclass(frozen=True)
class KVOffloadStats:
    """Cumulative work of the CPU offload tier (blocks and bytes), and the blocks it holds."""

    held_blocks: int
    queried_blocks: int  # looked up in the tier after a device-pool miss
    hit_blocks: int
    loaded_blocks: int  # copied host -> device
    stored_blocks: int  # copied device -> host
    evicted_blocks: int  # dropped from the tier to make room
    loads: int  # requests whose prefix came back from the tier
    bytes: int  # copied both ways
    block_size: int


@dataclass(frozen=True)
class LoRAStats:
    """The LoRA adapters of the requests running and waiting (names, sorted), the adapters
    one step can run (--max-loras), and cumulative adapter loads into slots and from disk."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int
    slot_loads: int = 0
    disk_loads: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's live state, read at scrape time (ints and lengths read
    off the engine thread's objects: each is exact, together they are near-simultaneous)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by live requests
    num_cached_free_blocks: int  # free blocks still holding reusable prefixes
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    num_preemptions: int
    num_held_blocks: int  # blocks a prefill engine holds for decode engines
    kv_transfer: KVTransferStats | None  # None without --kv-transfer-config
    kv_offload: KVOffloadStats | None = None  # None without --kv-offloading-size
    spec_decode: SpecDecodeStats | None = None  # None without --speculative-config
    lora: LoRAStats | None = None  # None without --enable-lora
    expert_load: ExpertLoadStats | None = None  # None for a dense model


@dataclass(frozen=True)
class StepStats:
    """What one step did, for throughput metrics."""

    num_prompt_tokens: int  # prompt tokens computed (cache hits excluded)
    num_generation_tokens: int  # tokens sampled
    num_preempted: int


class EngineObserver:
    """Events the engine reports as they happen (metrics, event flushing); subclasses
    override the ones they want."""

    def on_step(self, stats: StepStats) -> None:
        """After every step that ran, on the engine's thread."""

    def on_kv_transfer(self, seconds: float, path: str | None) -> None:
        """After each finished KV pull, on the engine's thread; `path` is the data path that
        moved the blocks ("nixl" or "tcp"), None if the pull failed."""

    def on_stall_abort(self) -> None:
        """When a client left output unread too long and its request was aborted (loop)."""


class EngineClient(Protocol):
    @property
    def limits(self) -> EngineLimits: ...

    @property
    def tokenizer(self): ...

    @property
    def is_running(self) -> bool: ...

    @property
    def num_waiting_sequences(self) -> int:
        """Sequences (n of each request) submitted and not running yet: what admission
        control counts."""

    def stats(self) -> EngineStats: ...

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise validation.InvalidRequest unless the request can be queued (synchronously:
        nothing is submitted)."""

    async def check_structured_outputs(self, constraint, tenant: str = "") -> None:
        """Compile a request's output constraint (StructuredOutputsParams) ahead of submitting
        it, in `tenant`'s turn; raise ValueError if it cannot compile."""

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]: ...

    def encode(
        self, prompt: str | list[int], params: PoolingParams, request_id: str
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling engine's request: one output, once its vector is pooled."""

    def abort(self, request_id: str) -> None: ...

    def subscribe(self, observer: EngineObserver) -> None: ...
