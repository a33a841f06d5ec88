"""The gRPC KV transfer service in one process: handshake refusal, the TCP data path, release,
unknown requests and holds that end mid-transfer (peers share the test fleet secret)."""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from pagefleet.common.kv_errors import (
    IncompatiblePeer,
    PeerUnavailable,
    TransferError,
    UnknownRequest,
)
from pagefleet.engine.kv_transfer.layout import CompatRecord, describe_pool
from pagefleet.engine.kv_transfer.service import KVTransferClient, KVTransferServer
from server_utils import fleet_secret, free_port

SHAPE = (2, 2, 2, 16, 4, 8)  # layers, k|v, kv heads, blocks, block size, head dim


def make_pool(seed: int, num_blocks: int = 16, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (*SHAPE[:3], num_blocks, *SHAPE[4:])
    return torch.randn(shape, generator=gen).to(dtype)


def compat_of(pool: torch.Tensor) -> CompatRecord:
    return CompatRecord.from_pool_shape("tiny", "bfloat16", "bfloat16", pool.shape)


class DictHeld:
    """HeldBlocks over a dict, for any reader; `on_lookup` runs on each blocks_of call (fault
    injection)."""

    def __init__(self, held: dict[str, list[int]], on_lookup=None) -> None:
        self._held = dict(held)
        self._lock = threading.Lock()
        self._on_lookup = on_lookup
        self.lookups = 0

    def blocks_of(self, transfer_id: str, reader: str) -> list[int] | None:
        with self._lock:
            self.lookups += 1
            if self._on_lookup:
                self._on_lookup(self)
            return self._held.get(transfer_id)

    def release(self, transfer_id: str, reader: str) -> bool:
        with self._lock:
            return self._held.pop(transfer_id, None) is not None


@contextmanager
def serving(held, pool, **kwargs):
    kwargs.setdefault("secret", fleet_secret())
    compat = kwargs.pop("compat", None) or compat_of(pool)
    server = KVTransferServer(held, pool, compat, "prefill-0", **kwargs)
    port = server.start()
    client = KVTransferClient("127.0.0.1", port, timeout=10, secret=fleet_secret())
    try:
        yield server, client
    finally:
        client.close()
        server.stop(grace=0)


def test_handshake_returns_the_peer_record_and_pool():
    pool = make_pool(0)
    with serving(DictHeld({}), pool, nixl_agent_name="agent-p", nixl_metadata=b"md") as (_, c):
        peer = c.handshake(compat_of(pool), "decode-0")
    assert peer.engine_id == "prefill-0"
    assert peer.compat == compat_of(pool)
    assert (peer.nixl_agent_name, peer.nixl_metadata) == ("agent-p", b"md")
    assert peer.pool == describe_pool(pool)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"block_size": 16}, "block_size"),
        ({"kv_dtype": "float32"}, "kv_dtype"),
        ({"model": "other"}, "model"),
        ({"cache_layout": "layer,block,kv,head,slot,dim"}, "cache_layout"),
    ],
)
def test_server_refuses_any_mismatch_with_the_reason(change, field):
    pool = make_pool(0)
    mine = dataclasses.replace(compat_of(pool), **change)
    with serving(DictHeld({}), pool) as (_, client), pytest.raises(IncompatiblePeer) as err:
        client.handshake(mine, "decode-0")
    assert err.value.mismatches and field in err.value.mismatches[0]
    assert field in str(err.value) and "prefill-0" in str(err.value)


@pytest.mark.parametrize("max_chunk_bytes", [64, 1000, 1 << 20])
def test_tcp_read_copies_the_blocks_and_leaves_others_untouched(max_chunk_bytes):
    src = make_pool(1)
    dst = make_pool(2, num_blocks=24)  # pools of different sizes, as on real peers
    before = dst.clone()
    pairs = [(3, 20), (4, 21), (9, 0), (15, 7), (0, 8)]
    held = DictHeld({"req-1": [3, 4, 9, 15, 0, 11]})
    with serving(held, src, max_chunk_bytes=max_chunk_bytes) as (_, client):
        client.handshake(compat_of(src), "decode-0")
        nbytes = client.read_blocks_tcp("req-1", pairs, dst)
    block = src[:, :, :, 0].numel() * src.element_size()
    assert nbytes == len(pairs) * block
    for remote, local in pairs:
        assert torch.equal(dst[:, :, :, local], src[:, :, :, remote])
    untouched = sorted(set(range(24)) - {local for _, local in pairs})
    assert torch.equal(dst[:, :, :, untouched], before[:, :, :, untouched])


def test_release_frees_the_hold_once_and_later_reads_are_refused():
    pool = make_pool(1)
    held = DictHeld({"req-1": [1, 2]})
    with serving(held, pool) as (_, client):
        client.handshake(compat_of(pool), "decode-0")
        assert client.release("req-1") is True
        assert client.release("req-1") is False
        with pytest.raises(UnknownRequest, match="no blocks held under this grant"):
            client.read_blocks_tcp("req-1", [(1, 1)], make_pool(3))


def test_unknown_request_and_blocks_not_held_are_clear_errors():
    pool = make_pool(1)
    with serving(DictHeld({"req-1": [1, 2]}), pool) as (_, client):
        client.handshake(compat_of(pool), "decode-0")
        with pytest.raises(UnknownRequest, match="no blocks held under this grant"):
            client.read_blocks_tcp("nope", [(1, 1)], make_pool(3))
        with pytest.raises(TransferError, match=r"blocks \[5\] are not held"):
            client.read_blocks_tcp("req-1", [(1, 1), (5, 2)], make_pool(3))


def test_a_hold_released_mid_transfer_aborts_the_stream():
    pool = make_pool(1)

    def expire_after_two_chunks(held: DictHeld) -> None:
        if held.lookups == 3:
            held._held.clear()

    held = DictHeld({"req-1": list(range(16))}, on_lookup=expire_after_two_chunks)
    with (
        serving(held, pool, max_chunk_bytes=256) as (_, client),
        pytest.raises(UnknownRequest, match="released mid-transfer"),
    ):
        client.handshake(compat_of(pool), "decode-0")
        client.read_blocks_tcp("req-1", [(i, i) for i in range(16)], make_pool(3))


def test_unreachable_peer_fails_fast():
    pool = make_pool(1)
    started = time.monotonic()
    with (
        KVTransferClient("127.0.0.1", free_port(), timeout=20, secret=fleet_secret()) as client,
        pytest.raises(PeerUnavailable, match="Connection refused"),
    ):
        client.handshake(compat_of(pool), "d")
    assert time.monotonic() - started < 5  # refused at once, not at the deadline
