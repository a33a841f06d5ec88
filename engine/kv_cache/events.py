"""KV-cache events in vLLM's shape, emitted to a listener as blocks enter and leave the cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagefleet.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became reusable; `token_ids` is their tokens, block after block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted: their hashes no longer hit."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block was dropped (prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventListener = Callable[[KVEvent], None]
