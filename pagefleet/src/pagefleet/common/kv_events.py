"""KV-cache events: the types engines emit and the router indexes, and their wire format.

On the wire they are vLLM's: a batch is msgpack `[ts, [event, ...]]`, each event a tagged
array — `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. A
block computed for a LoRA adapter carries the adapter's name (its hash already includes it:
common/block_hash.py) and the engine's integer id for it, as vLLM's do. Over ZMQ a PUB
socket sends multipart `[topic, seq (8 bytes, big-endian), payload]`, and a ROUTER "replay"
socket answers a start sequence number with the buffered `[seq, payload]` messages followed by
`[-1, b""]`. Stock vLLM pods speak the same, so the router indexes them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from pagefleet.common.block_hash import BlockHash

# Where blocks live (vLLM's `medium`): None or GPU = the engine's device pool, CPU = its host
# offload tier (a hit there costs a copy back: less than a recompute, more than a device hit).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_INVALID = "INVALID"  # a medium field that is no short string
MAX_MEDIUM_LENGTH = 16
MAX_LORA_NAME_LENGTH = 256  # a longer name, or not a string, reads as None


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became reusable; `token_ids` is their tokens, block after block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None  # the adapter the blocks were computed for
    lora_id: int | None = None  # the engine's own id for it (vLLM's older field)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted (from `medium`): their hashes no longer hit there."""

    block_hashes: list[BlockHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block was dropped (prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventListener = Callable[[KVEvent], None]
END_OF_REPLAY = -1


def encode_batch(ts: float, events: list[KVEvent], include_token_ids: bool = True) -> bytes:
    """One batch on the wire; without token ids, BlockStored carries an empty list (block
    hashes are all a prefix index needs, and the tokens are the prompt itself)."""
    return msgpack.packb([ts, [_encode(e, include_token_ids) for e in events]], use_bin_type=True)


def _encode(event: KVEvent, include_token_ids: bool) -> list:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids) if include_token_ids else [],
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """Decode a batch from pagefleet or vLLM. Hashes may be bytes or ints (older vLLM);
    trailing fields newer vLLM versions add are ignored. Unknown event tags, and events whose
    hashes are neither, are skipped."""
    ts, raw_events = msgpack.unpackb(payload, raw=False)[:2]
    events: list[KVEvent] = []
    for raw in raw_events:
        tag = raw[0]
        hashes = _hashes(raw[1]) if tag in ("BlockStored", "BlockRemoved") else None
        if tag == "BlockStored" and hashes is not None:
            medium = _medium(raw, 6)
            lora_name, lora_id = _lora_name(raw), _lora_id(raw)
            events.append(
                BlockStored(hashes, raw[2], list(raw[3]), int(raw[4]), medium, lora_name, lora_id)
            )
        elif tag == "BlockRemoved" and hashes is not None:
            events.append(BlockRemoved(hashes, _medium(raw, 2)))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
    return float(ts), events


def _medium(raw: list, index: int) -> str | None:
    """The event's medium, upper-cased as vLLM spells it; None when absent (older senders:
    the device pool). Anything but a short string is MEDIUM_INVALID, which no index scores
    (taking it for None would index blocks the pod's GPU does not hold)."""
    value = raw[index] if len(raw) > index else None
    if value is None:
        return None
    if isinstance(value, str) and len(value) <= MAX_MEDIUM_LENGTH:
        return value.upper()
    return MEDIUM_INVALID


def _lora_name(raw: list) -> str | None:
    value = raw[7] if len(raw) > 7 else None
    if isinstance(value, str) and len(value) <= MAX_LORA_NAME_LENGTH:
        return value
    return None


def _lora_id(raw: list) -> int | None:
    value = raw[5] if len(raw) > 5 else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _hashes(value: object) -> list[BlockHash] | None:
    """An event's block hashes: bytes or ints (older vLLM); None when any is neither (a map
    or a list as a hash would fail the index's dict lookups part-way through a batch)."""
    if not isinstance(value, list | tuple):
        return None
    hashes = list(value)
    return hashes if all(isinstance(h, bytes | int) for h in hashes) else None


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(data: bytes) -> int:
    return int.from_bytes(data, "big", signed=True)
