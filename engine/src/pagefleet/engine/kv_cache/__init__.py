"""Paged KV-cache management: a fixed pool of blocks, per-request block tables, prefix caching."""

from pagefleet.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagefleet.engine.kv_cache.block_pool import Block, BlockPool, FreeBlockQueue
from pagefleet.engine.kv_cache.manager import KVCacheManager

__all__ = [
    "AllBlocksCleared",
    "Block",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "KVCacheManager",
    "KVEvent",
]
