"""A session with one engine's KV-transfer service (pagefleet.proto): proving both sides hold
the fleet secret, and releasing a grant. The router uses it to free a prefill pod's held blocks;
the engine's own client (pagefleet.engine.kv_transfer.service) extends it to pull blocks."""

from __future__ import annotations

from typing import Self

import grpc

from pagefleet.common.fleet_auth import FleetAuthError, FleetSecret
from pagefleet.common.kv_errors import (
    AuthenticationFailed,
    PeerUnavailable,
    TransferError,
    TransferTimeout,
    UnknownRequest,
)
from pagefleet.common.peer_auth import ClientHandshake
from pagefleet.proto import kv_transfer_pb2 as pb
from pagefleet.proto import kv_transfer_pb2_grpc as pb_grpc

# gRPC's default receive limit (4 MiB), which chunks of the default size fit with their envelope.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def peer_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def translate_rpc_error(error: grpc.RpcError, what: str) -> TransferError:
    code, details = error.code(), error.details()
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownRequest(f"{what}: {details}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return AuthenticationFailed(f"{what}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeout(f"{what}: timed out")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return PeerUnavailable(f"{what}: {details}")
    return TransferError(f"{what}: {code.name}: {details}")


class PeerSession:
    """An authenticated channel to one peer's KV transfer service: a release-only session for a
    router (`authenticate_to_release`), or the base of an engine's pulling client."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float = 10.0,
        *,
        secret: FleetSecret,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.target = peer_target(host, port)
        self.timeout = timeout
        self._secret = secret
        self._session = b""
        self._channel = grpc.insecure_channel(
            self.target,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self._stub = pb_grpc.KVTransferStub(self._channel)

    def _prove(
        self, peer_id: str, role: str, expected_server_id: str | None
    ) -> tuple[ClientHandshake, pb.ChallengeReply, bytes]:
        """Step 1: challenge the server and check its proof; returns ours."""
        mine = ClientHandshake(self._secret, peer_id, role, self.target)
        request = pb.ChallengeRequest(
            client_nonce=mine.client_nonce, peer_id=peer_id, role=role, address=self.target
        )
        try:
            reply = self._stub.Challenge(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise translate_rpc_error(e, f"handshake with {self.target}") from e
        if expected_server_id is not None and reply.server_id != expected_server_id:
            raise AuthenticationFailed(
                f"{self.target} is engine {reply.server_id[:64]!r}, not {expected_server_id!r}"
            )
        try:
            proof = mine.check_server(reply.server_nonce, reply.server_id, reply.server_proof)
        except FleetAuthError as e:
            raise AuthenticationFailed(f"handshake with {self.target}: {e}") from None
        return mine, reply, proof

    def _handshake(self, mine, challenge, proof, compat: pb.CompatRecord) -> pb.HandshakeReply:
        request = pb.HandshakeRequest(
            compat=compat,
            engine_id=mine.peer_id,
            client_nonce=mine.client_nonce,
            server_nonce=challenge.server_nonce,
            client_proof=proof,
            role=mine.role,
            address=self.target,
        )
        try:
            reply = self._stub.Handshake(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise translate_rpc_error(e, f"handshake with {self.target}") from e
        self._session = reply.session if reply.accepted else b""
        return reply

    def authenticate_to_release(self, peer_id: str, expected_engine_id: str | None = None):
        """A session that may release grants and nothing else (it learns nothing of the pool):
        for a router, or an engine whose own handshake failed."""
        mine, challenge, proof = self._prove(peer_id, "releaser", expected_engine_id)
        if not self._handshake(mine, challenge, proof, pb.CompatRecord()).accepted:
            raise AuthenticationFailed(f"{self.target} refused a release session")

    def release(self, transfer_id: str) -> bool:
        """Tell the peer to stop holding the grant's blocks; False if it held none."""
        request = pb.ReleaseRequest(request_id=transfer_id, session=self._session)
        try:
            reply = self._stub.Release(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise translate_rpc_error(e, f"releasing a grant on {self.target}") from e
        return reply.released

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
