"""The one chained block hash shared by engines and the router.

h_i = xxh3_128(h_{i-1} || token ids of block i as little-endian uint32 || extra keys),
over full blocks only. The encoding is stable across processes and machines (never Python's
hash() or pickle), so the router can predict exactly which blocks an engine caches.

A LoRA adapter is part of a block's identity (its keys and values differ from the base model's
for the same tokens): `lora_extra_keys(name)` is the extra key of every block of a request for
that adapter, as vLLM keys blocks by `lora_name`. Engines and the router both know a request's
adapter by the name in its `model` field, so both compute the same hash.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

BlockHash = bytes
# The parent of a request's first block: a fixed value, so equal prompts hash equally everywhere.
ROOT_PARENT_HASH: BlockHash = bytes(16)
_LITTLE_ENDIAN = sys.byteorder == "little"
# Tags the adapter's name in the extra keys, so no other kind of extra key (a cache salt, a
# multimodal hash) can ever spell the same bytes.
_LORA_TAG = b"\x00lora\x00"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        words = array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if not _LITTLE_ENDIAN:
        words.byteswap()
    return words.tobytes()


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    h = xxhash.xxh3_128(parent if parent is not None else ROOT_PARENT_HASH)
    h.update(_token_bytes(token_ids))
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash | None = None,
    extra_keys: bytes = b"",
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`; a partial tail block is not hashed."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def lora_extra_keys(lora_name: str | None) -> bytes:
    """The extra keys of a request's blocks: none for the base model, the adapter's tagged
    name for a LoRA adapter."""
    if lora_name is None:
        return b""
    return _LORA_TAG + lora_name.encode()
