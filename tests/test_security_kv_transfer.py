"""A rogue KV-transfer peer (issue 14, findings 2 and 3) against a prefill-side peer process
that serves its pool over gRPC with a NIXL agent: without the fleet secret, with a captured
handshake, with a guessed transfer id, with an oversized message. Each gets nothing (no
record, no NIXL metadata, no block), and an authenticated peer keeps pulling as before."""

from __future__ import annotations

import base64
import dataclasses
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from test_kv_transfer_processes import PAIRS, add_peer, assert_pulled, client_of, peer_process
from test_kv_transfer_service import compat_of, make_pool

from pagefleet.common.fleet_auth import FleetSecret
from pagefleet.common.kv_errors import AuthenticationFailed, UnknownRequest
from pagefleet.engine.kv_transfer.connector import KVConnector, KVTransferConfig, RemoteSource
from pagefleet.engine.kv_transfer.nixl_transport import NixlTransport
from pagefleet.engine.kv_transfer.service import (
    KVTransferClient,
    compat_from_proto,
    compat_to_proto,
    pool_info_from_proto,
)
from pagefleet.proto import kv_transfer_pb2 as pb
from pagefleet.proto import kv_transfer_pb2_grpc as pb_grpc
from server_utils import fleet_secret

MiB = 1 << 20


@pytest.fixture(scope="module")
def peer():
    with peer_process() as (_, port):
        yield port


@pytest.fixture(scope="module")
def rogue_nixl():
    """The attacker's own NIXL agent over a pool shaped like the victim's."""
    with NixlTransport(make_pool(3, num_blocks=40), "rogue-agent") as transport:
        yield transport


def stub_of(port: int, max_message: int = 64 * MiB) -> pb_grpc.KVTransferStub:
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            ("grpc.max_send_message_length", max_message),
            ("grpc.max_receive_message_length", max_message),
        ],
    )
    return pb_grpc.KVTransferStub(channel)


def victim_compat() -> pb.CompatRecord:
    """What an attacker who knows the model can build (or copy from a refused handshake)."""
    record = compat_of(make_pool(0))
    return compat_to_proto(dataclasses.replace(record, block_size=4))


def status_of(call) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return None


def test_a_peer_without_the_secret_gets_no_record_and_no_nixl_metadata(peer, rogue_nixl):
    """Before: any peer whose record matched got the NIXL metadata and base address of the
    whole pool, and a refused one got the server's record to copy. It then READ every block
    (another client's prompt's KV included) over NIXL."""
    stub = stub_of(peer)
    matching = pb.HandshakeRequest(compat=victim_compat(), engine_id="rogue")
    with pytest.raises(grpc.RpcError) as refused:
        reply = stub.Handshake(matching)
        # What the attacker did with an accepted reply: READ blocks held for nobody.
        rogue_peer = rogue_nixl.add_peer(
            reply.nixl_agent_metadata,
            pool_info_from_proto(reply.pool),
            compat_from_proto(reply.compat),
            agent_name=reply.nixl_agent_name,
        )
        handle = rogue_nixl.start_read(rogue_peer, PAIRS)
        rogue_nixl.wait(handle, timeout=20)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "prefill-peer" in refused.value.details()  # who refused, and nothing else
    wrong = pb.HandshakeRequest(compat=pb.CompatRecord(model="guess"), engine_id="rogue")
    with pytest.raises(grpc.RpcError) as refused:
        stub.Handshake(wrong)  # before: refused, with the server's record to copy
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Our own client, with another fleet's secret: the server's proof fails, it stops there.
    other = FleetSecret(b"another-fleet-secret-0123456789")
    with (
        KVTransferClient("127.0.0.1", peer, 20, secret=other) as rogue,
        pytest.raises(AuthenticationFailed, match="fleet secret"),
    ):
        rogue.handshake(compat_of_peer(), "rogue")


def test_a_captured_handshake_cannot_be_replayed(peer):
    """Replay: an eavesdropper resends a legitimate peer's handshake request verbatim."""
    captured = []
    with client_of(peer) as client:
        real = client._stub.Handshake

        def record(request, **kwargs):
            captured.append(request)
            return real(request, **kwargs)

        client._stub.Handshake = record
        client.handshake(compat_of_peer(), "decode-legit")
    assert captured
    replayed = status_of(lambda: stub_of(peer).Handshake(captured[-1]))
    assert replayed == grpc.StatusCode.UNAUTHENTICATED


def compat_of_peer():
    return dataclasses.replace(compat_of(make_pool(0)), block_size=4)


def test_blocks_cannot_be_read_or_released_without_a_session(peer):
    """Before: ReadBlocks and Release needed only the transfer id (TCP path)."""
    stub = stub_of(peer)
    read = pb.ReadBlocksRequest(request_id="req-1", block_ids=[0, 1])
    assert status_of(lambda: list(stub.ReadBlocks(read))) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(lambda: stub.Release(pb.ReleaseRequest(request_id="req-1"))) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # The legitimate peer still pulls, over NIXL and TCP.
    pool = make_pool(5, num_blocks=40)
    before = pool.clone()
    with client_of(peer) as client, NixlTransport(pool, "legit-agent") as nixl:
        info = client.handshake(compat_of_peer(), "decode-legit")
        handle = nixl.start_read(add_peer(nixl, info), PAIRS[:3])
        nixl.wait(handle, timeout=20)
        client.read_blocks_tcp("req-1", PAIRS[3:], pool)
    assert_pulled(pool, before, PAIRS)


def test_oversized_messages_are_refused(peer):
    """Before: a 60 MiB handshake was accepted (64 MiB limit for <1 KB messages)."""
    stub = stub_of(peer)
    huge = pb.HandshakeRequest(compat=pb.CompatRecord(model="x" * (60 * MiB)), engine_id="r")
    assert status_of(lambda: stub.Handshake(huge)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    many = pb.ReadBlocksRequest(request_id="req-1", block_ids=list(range(4 * MiB)))
    assert status_of(lambda: list(stub.ReadBlocks(many))) == grpc.StatusCode.RESOURCE_EXHAUSTED


def producer(pool: torch.Tensor, **config) -> KVConnector:
    config = KVTransferConfig(kv_connector="tcp", kv_role="kv_producer", kv_port=0, **config)
    return KVConnector(config, pool, compat_of(pool), "prefill-x", fleet_secret())


def test_transfer_ids_are_unguessable_bound_to_their_reader_and_expire():
    """Before: the transfer id was the engine's request id, i.e. the client's X-Request-Id
    plus 32 random bits: knowing it let a stranger read and release another's blocks."""
    pool = make_pool(1, num_blocks=16)
    connector = producer(pool)
    local = make_pool(2, num_blocks=16)
    try:
        request_id = "cmpl-victims-request-id-0.1a2b3c4d"
        params = connector.hold(request_id, [2, 3], now=time.monotonic())
        grant = params["remote_request_id"]
        assert "victims-request-id" not in grant and request_id not in grant
        assert len(base64.urlsafe_b64decode(grant + "==")) >= 16  # 128 random bits
        with client_of(connector.port) as first, client_of(connector.port) as second:
            first.handshake(compat_of(local), "decode-a")
            second.handshake(compat_of(local), "decode-b")
            with pytest.raises(UnknownRequest):  # the request id is no key
                first.read_blocks_tcp(request_id, [(2, 0)], local)
            first.read_blocks_tcp(grant, [(2, 0), (3, 1)], local)  # binds it to decode-a
            assert torch.equal(local[:, :, :, :2], pool[:, :, :, 2:4])
            with pytest.raises(UnknownRequest):  # another authenticated engine: refused
                second.read_blocks_tcp(grant, [(2, 5)], local)
            assert second.release(grant) is False
            assert first.release(grant) is True
        expired = connector.hold("old", [4], now=time.monotonic() - 10_000)["remote_request_id"]
        with client_of(connector.port) as reader:
            reader.handshake(compat_of(local), "decode-a")
            with pytest.raises(UnknownRequest):
                reader.read_blocks_tcp(expired, [(4, 0)], local)
        # A router's release session frees a grant no engine read; it may read nothing.
        unread = connector.hold("unread", [5], now=time.monotonic())["remote_request_id"]
        with client_of(connector.port) as router:
            router.authenticate_to_release("router", "prefill-x")
            with pytest.raises(AuthenticationFailed):
                router.read_blocks_tcp(unread, [(5, 0)], local)
            assert router.release(unread) is True
        assert sorted(connector.due_releases(time.monotonic())) == sorted(
            [request_id, "old", "unread"]
        )
    finally:
        connector.close()


class _StuckNixl:
    """A NIXL transport whose READ never ends and cannot be cancelled."""

    def start_read(self, peer, pairs):
        return SimpleNamespace(peer=SimpleNamespace(agent_name="stuck-peer"), num_bytes=0)

    def poll(self, handle) -> str:
        return "pending"

    def release(self, handle) -> bool:
        return False

    def remove_peer(self, peer) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_read_nixl_cannot_cancel_is_given_up_and_its_blocks_quarantined():
    """Before: a worker retried NIXL's release forever, and with it the request waited."""
    pool = make_pool(1, num_blocks=16)
    config = KVTransferConfig(kv_connector="tcp", kv_role="kv_consumer", transfer_timeout=0.2)
    connector = KVConnector(config, pool, compat_of(pool), "decode-x", fleet_secret())
    connector.nixl, connector.release_give_up_s = _StuckNixl(), 0.5
    connector._peer = lambda source: (None, SimpleNamespace(engine_id="p"), object(), 0)
    connector._release_remote = lambda source: None
    try:
        connector.start_load("req", RemoteSource("p", "127.0.0.1", 1, (0, 1), "g"), [3, 4], 0)
        deadline = time.monotonic() + 60
        while not (results := connector.finished_loads()):
            assert time.monotonic() < deadline, "the pull never ended"
            connector.wait_for_results(0.1)
        assert results[0].quarantined and not results[0].ok
    finally:
        connector._workers.shutdown(wait=True)
