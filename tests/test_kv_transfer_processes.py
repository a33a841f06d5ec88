"""KV transfer between two processes: a prefill-side peer (a subprocess running this file)
serves its pool over gRPC with a NIXL agent; this process pulls blocks over NIXL and over TCP.
Faults: a refused handshake, an unknown request, the peer killed mid-transfer."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from test_kv_transfer_service import DictHeld, compat_of, make_pool

from pagefleet.common.kv_errors import (
    IncompatiblePeer,
    PeerUnavailable,
    TransferError,
    UnknownRequest,
)
from pagefleet.engine.kv_transfer.nixl_transport import NixlPeer, NixlTransport
from pagefleet.engine.kv_transfer.service import KVTransferClient, KVTransferServer, PeerInfo
from server_utils import fleet_secret

PEER_SEED = 11
PEER_BLOCKS = 32


def serve_peer(argv: list[str]) -> None:
    """The peer process: hold every block for "req-1", serve until stdin closes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-blocks", type=int, default=PEER_BLOCKS)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--max-chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--die-after-lookups", type=int, default=0)
    parser.add_argument("--seed", type=int, default=PEER_SEED)
    args = parser.parse_args(argv)

    def die(held: DictHeld) -> None:
        if held.lookups == args.die_after_lookups:
            os.kill(os.getpid(), signal.SIGKILL)

    pool = make_pool(args.seed, args.num_blocks)
    compat = dataclasses.replace(compat_of(pool), block_size=args.block_size)
    held = DictHeld(
        {"req-1": list(range(args.num_blocks))}, die if args.die_after_lookups else None
    )
    nixl = NixlTransport(pool, "prefill-peer-agent")
    server = KVTransferServer(
        held,
        pool,
        compat,
        "prefill-peer",
        secret=fleet_secret(),
        nixl_agent_name=nixl.agent_name,
        nixl_metadata=nixl.metadata(),
        max_chunk_bytes=args.max_chunk_bytes,
    )
    # NIXL logs to stdout too: the port line is marked.
    print("KV-TRANSFER-PORT", server.start(), flush=True)
    sys.stdin.read()  # the test closes our stdin (or dies) when done
    server.stop(grace=0)
    nixl.close()


@contextmanager
def peer_process(*flags: str):
    """Start the peer; yields (process, port); kills it afterwards."""
    proc = subprocess.Popen(
        [sys.executable, __file__, *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:  # bounded: the peer prints a few log lines, then the port
            if line.startswith("KV-TRANSFER-PORT "):
                break
        else:
            raise RuntimeError(f"peer exited {proc.wait(timeout=10)} before serving")
        yield proc, int(line.split()[1])
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


@pytest.fixture(scope="module")
def local_nixl():
    """This process's agent over a pool shaped like the peer's, with more blocks."""
    pool = make_pool(5, num_blocks=40)
    with NixlTransport(pool, "decode-test-agent") as transport:
        yield transport


def client_of(port: int, timeout: float = 20) -> KVTransferClient:
    """A client holding the test fleet's secret."""
    return KVTransferClient("127.0.0.1", port, timeout=timeout, secret=fleet_secret())


def add_peer(transport: NixlTransport, info: PeerInfo) -> NixlPeer:
    return transport.add_peer(
        info.nixl_metadata, info.pool, info.compat, agent_name=info.nixl_agent_name
    )


PAIRS = [(0, 10), (1, 11), (2, 12), (7, 3), (31, 39), (20, 0), (21, 1)]


def assert_pulled(local: torch.Tensor, before: torch.Tensor, pairs) -> None:
    source = make_pool(PEER_SEED, PEER_BLOCKS)
    for remote, loc in pairs:
        assert torch.equal(local[:, :, :, loc], source[:, :, :, remote]), (remote, loc)
    others = sorted(set(range(local.shape[3])) - {loc for _, loc in pairs})
    assert torch.equal(local[:, :, :, others], before[:, :, :, others])


def test_nixl_and_tcp_pull_exactly_the_requested_blocks(local_nixl):
    pool = local_nixl.pool
    with peer_process() as (_, port), client_of(port) as client:
        peer = client.handshake(compat_of(pool), "decode-test")
        assert peer.nixl_agent_name == "prefill-peer-agent"
        remote = add_peer(local_nixl, peer)
        # Without the agent name (it is then read from the metadata): the same peer.
        assert local_nixl.add_peer(peer.nixl_metadata, peer.pool, peer.compat) == remote

        before = pool.clone()
        handle = local_nixl.start_read(remote, PAIRS)
        assert handle.num_descriptors == 4 * 8  # 4 runs of consecutive ids, 8 planes each
        local_nixl.wait(handle, timeout=20)
        assert local_nixl.poll(handle) == "done"
        assert local_nixl.release(handle)
        assert_pulled(pool, before, PAIRS)

        pool.copy_(make_pool(5, num_blocks=40))
        before = pool.clone()
        tcp_pairs = [(remote_id, (loc + 5) % 40) for remote_id, loc in PAIRS]
        assert client.read_blocks_tcp("req-1", tcp_pairs, pool) > 0
        assert_pulled(pool, before, tcp_pairs)

        assert client.release("req-1") is True
        with pytest.raises(UnknownRequest, match="no blocks held under this grant"):
            client.read_blocks_tcp("req-1", tcp_pairs, pool)
        local_nixl.remove_peer(remote)


def test_a_restarted_peer_replaces_the_old_one(local_nixl):
    # Same agent name, new process: new metadata and pool address, the old entry is stale.
    pool = local_nixl.pool
    pairs = [(0, 0), (5, 1)]
    for seed in (21, 22):
        with (
            peer_process("--seed", str(seed)) as (_, port),
            client_of(port) as client,
        ):
            remote = add_peer(local_nixl, client.handshake(compat_of(pool), "decode-test"))
            handle = local_nixl.start_read(remote, pairs)
            local_nixl.wait(handle, timeout=20)
            local_nixl.release(handle)
            source = make_pool(seed, PEER_BLOCKS)
            assert torch.equal(pool[:, :, :, [0, 1]], source[:, :, :, [0, 5]])
    local_nixl.remove_peer(remote)


def test_an_idle_agent_does_not_spin_a_core(local_nixl):
    # NIXL's own progress thread busy-polls; ours sleeps between progress calls.
    started = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - started < 0.3


def test_peer_refuses_another_block_size_and_says_why():
    local = make_pool(5)
    with (
        peer_process("--block-size", "16") as (_, port),
        client_of(port) as client,
        pytest.raises(IncompatiblePeer, match="block_size differs: 16 here, 4 on the peer"),
    ):
        client.handshake(compat_of(local), "decode-test")


def test_peer_killed_mid_tcp_transfer_fails_fast():
    local = make_pool(5, num_blocks=40)
    pairs = [(i, i) for i in range(PEER_BLOCKS)]
    # Small chunks, and the peer SIGKILLs itself at its third hold check: mid-stream.
    flags = ("--max-chunk-bytes", "256", "--die-after-lookups", "3")
    with peer_process(*flags) as (proc, port), client_of(port, 30) as client:
        client.handshake(compat_of(local), "decode-test")
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):
            client.read_blocks_tcp("req-1", pairs, local)
        assert time.monotonic() - started < 10
        assert proc.wait(timeout=10) == -signal.SIGKILL


def test_peer_killed_during_nixl_reads_fails_fast():
    # On loopback UCX copies with CMA inside the post, so reads are repeated while a timer
    # kills the peer: the kill lands inside one of them or between two.
    num_blocks = 65536  # 32 MiB
    pairs = [(i, i) for i in range(num_blocks)]
    with (
        NixlTransport(make_pool(5, num_blocks), "decode-kill-agent") as local,
        peer_process("--num-blocks", str(num_blocks)) as (proc, port),
        client_of(port) as client,
    ):
        peer = client.handshake(compat_of(local.pool), "decode-test")
        remote = add_peer(local, peer)
        local.wait(local.start_read(remote, pairs), timeout=20)  # connected and working
        killer = threading.Timer(0.05, proc.kill)
        killer.start()
        deadline = time.monotonic() + 15
        with pytest.raises(TransferError):
            while time.monotonic() < deadline:
                handle = local.start_read(remote, pairs)
                try:
                    local.wait(handle, timeout=5)
                finally:
                    local.release(handle)
        assert time.monotonic() < deadline
        killer.join()
        assert proc.wait(timeout=10) == -signal.SIGKILL
        local.remove_peer(remote)


if __name__ == "__main__":
    serve_peer(sys.argv[1:])
