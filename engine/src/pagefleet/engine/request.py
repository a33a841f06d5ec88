"""A request's state as the scheduler and KV-cache manager see it: tokens, progress, blocks."""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import TYPE_CHECKING

from pagefleet.common.block_hash import BlockHash, hash_block, hash_blocks, lora_extra_keys
from pagefleet.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the connector imports torch and the transfer service; requests need neither
    from pagefleet.engine.kv_transfer.connector import RemoteSource
    from pagefleet.engine.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, pulling from prefill
    WAITING_FOR_TIER_LOAD = "waiting_for_tier_load"  # blocks allocated, copying from host tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


class Request:
    """Mutable per-request state. Tokens [0, num_computed_tokens) have keys/values in blocks."""

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "block_size",
        "extra_keys",
        "grammar",
        "hold_blocks",
        "logit_bias",
        "lora_request",
        "max_len",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "prefill_only",
        "remote_source",
        "request_id",
        "resumed_len",
        "resumed_step",
        "sampling_params",
        "spec_token_ids",
        "state_block_ids",
        "state_drafts",
        "state_saves",
        "state_slot",
        "status",
        "stop_ids",
    )
    # A request's tokens are one list, prompt then output: the hot path appends once per token.

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | Collection[int] | None = None,
        block_size: int = 16,
        extra_keys: bytes = b"",
        arrival_time: float = 0.0,
        lora_request: LoRARequest | None = None,
        prefill_only: bool = False,
    ) -> None:
        """`lora_request`: the LoRA adapter the request runs with (None: the base model); it
        keys the request's blocks (common/block_hash.lora_extra_keys)."""
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.lora_request = lora_request
        if lora_request is not None:
            extra_keys = lora_extra_keys(lora_request.lora_name) + extra_keys
        self.extra_keys = extra_keys
        self.block_size = block_size
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Length at which the request stops for max_tokens; the scheduler also caps it by
        # max_model_len at admission.
        self.max_len = self.num_prompt_tokens + sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens whose keys/values came from the prefix cache at admission: the runner
        # must not write their slots (the blocks may be shared).
        self.num_cached_tokens = 0
        # The request's KV blocks by id, in token order (the pool maps ids to its blocks).
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.block_hashes: list[BlockHash] = hash_blocks(
            self.all_token_ids, block_size, extra_keys=extra_keys
        )
        self.num_preemptions = 0
        # The step and the token count at its last resumption after a preemption (see the
        # scheduler's anti-thrash rule).
        self.resumed_step = -2
        self.resumed_len = 0
        # Disaggregation: a prefill pod keeps a finished request's blocks for a decode pod
        # (`hold_blocks`); a decode pod pulls the prompt's blocks from `remote_source` (the
        # prefill pod's address and block ids) before computing the rest.
        # Speculative decoding: draft tokens proposed to follow all_token_ids, verified in
        # the request's next step (not part of its tokens until accepted).
        self.spec_token_ids: list[int] = []
        # Structured outputs: the sequence's grammar state (structured.SequenceGrammar), set
        # by the engine once the grammar is compiled; None when unconstrained.
        self.grammar = None
        # sampling_params.logit_bias as (token ids, biases) tensors, built by its first step.
        self.logit_bias = None
        self.hold_blocks = False
        self.remote_source: RemoteSource | None = None
        # Hybrid models (kv_cache/state_cache.py): the sequence's recurrent-state slot (-1:
        # none), the KV blocks its state travels in under P/D, and the positions whose state
        # is kept (position, reserved slot or -1).
        self.state_slot = -1
        self.state_block_ids: list[int] = []
        self.state_saves: list[tuple[int, int]] = []
        # Speculative decoding: slots holding the state after each draft verified this step.
        self.state_drafts: list[int] = []
        # A pooling request (pooling/): it computes its prompt and finishes, sampling nothing.
        self.prefill_only = prefill_only
        stop = set(sampling_params.stop_token_ids)
        if eos_token_id is not None and not sampling_params.ignore_eos:
            stop.update([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.stop_ids = frozenset(stop)

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_blocks(self) -> int:
        """Blocks that hold the prompt's keys and values (the last one may be partial)."""
        return -(-self.num_prompt_tokens // self.block_size)

    @property
    def transfer_block_ids(self) -> list[int]:
        """The blocks a P/D transfer moves: the prompt's, then its state's (hybrid models)."""
        return self.block_ids[: self.num_prompt_blocks] + self.state_block_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def hash_last_block(self) -> None:
        """Hash the block the last token completed."""
        hashes = self.block_hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, self.all_token_ids[-bs:], self.extra_keys))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
