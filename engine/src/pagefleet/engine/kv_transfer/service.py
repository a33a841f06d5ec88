"""gRPC KV transfer service (proto/kv_transfer.proto): the server an engine runs over the blocks
it holds for remote decode, and the client a peer uses to handshake, pull blocks over TCP (the
fallback data path) and release them.

Only fleet members talk to it: a peer proves it holds the fleet secret (peer_auth) before it
learns anything about the pool, and every later call carries the session that opens. The
server never decides what is held: the engine implements `HeldBlocks` (a transfer grant maps to
its held block ids until released or expired, bound to the first peer that reads it) and the
server only reads those blocks. Message limits follow the real messages, not gRPC's defaults.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from pagefleet.common.fleet_auth import FleetAuthError, FleetSecret, HandshakeContext
from pagefleet.common.kv_errors import (
    IncompatiblePeer,
    TransferError,
)
from pagefleet.common.kv_peer import PeerSession, peer_target, translate_rpc_error
from pagefleet.common.peer_auth import PeerAuthenticator
from pagefleet.engine.kv_transfer.layout import (
    CompatRecord,
    PoolGeometry,
    PoolInfo,
    RankAgent,
    WireChunk,
    block_runs,
    check_pairs,
    describe_pool,
    geometry_of,
    wire_chunks,
)
from pagefleet.proto import kv_transfer_pb2 as pb
from pagefleet.proto import kv_transfer_pb2_grpc as pb_grpc

# gRPC's default receive limit is 4 MiB per message; chunks stay below it with room for the
# envelope (a single plane of one block may be larger: then the limit grows to fit it).
ENVELOPE_BYTES = 64 * 1024
DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024 - ENVELOPE_BYTES
# What the server receives: a handshake (<1 KB) or a ReadBlocks of at most every block id
# (a varint of <= 5 bytes each).
REQUEST_BASE_BYTES = 16 * 1024
BYTES_PER_BLOCK_ID = 5
PRODUCER_ROLES = ("prefill", "decode")  # the server's role, then its reader's


def chunk_message_limit(geometry: PoolGeometry, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES):
    """The largest BlockChunk (or handshake reply) a transfer of this geometry sends."""
    return max(max_chunk_bytes, geometry.chunk_bytes) + ENVELOPE_BYTES


def request_message_limit(num_blocks: int) -> int:
    """The largest request a server over `num_blocks` blocks needs to receive."""
    return REQUEST_BASE_BYTES + BYTES_PER_BLOCK_ID * num_blocks


class HeldBlocks(Protocol):
    """What the engine holds for remote readers; both methods are called from gRPC threads.
    `reader` names the authenticated caller (`engine/<id>` or `router/<id>`)."""

    def blocks_of(self, transfer_id: str, reader: str) -> list[int] | None:
        """Block ids held under this grant, or None if unknown, released, expired or bound to
        another reader (the first engine that reads a grant binds it)."""
        ...

    def release(self, transfer_id: str, reader: str) -> bool:
        """Stop holding the grant's blocks; False if it held none (or not for this reader)."""
        ...


@dataclass(frozen=True)
class PeerInfo:
    """What a handshake learns about an accepted peer."""

    engine_id: str
    compat: CompatRecord
    nixl_agent_name: str  # empty: the peer serves the TCP path only
    nixl_metadata: bytes
    pool: PoolInfo
    ranks: tuple[RankAgent, ...] = ()  # every rank's agent, rank 0 first, under TP > 1


def compat_to_proto(record: CompatRecord) -> pb.CompatRecord:
    return pb.CompatRecord(**vars(record))


def compat_from_proto(message: pb.CompatRecord) -> CompatRecord:
    return CompatRecord(
        model=message.model,
        dtype=message.dtype,
        kv_dtype=message.kv_dtype,
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        block_size=message.block_size,
        cache_layout=message.cache_layout,
        version=message.version,
        tensor_parallel_size=message.tensor_parallel_size or 1,
    )


def pool_info_from_proto(message: pb.PoolInfo) -> PoolInfo:
    return PoolInfo(
        base_address=message.base_address,
        size_bytes=message.size_bytes,
        num_blocks=message.num_blocks,
        element_size=message.element_size,
        mem_type=message.mem_type,
        device_id=message.device_id,
    )


def rank_agent_to_proto(agent: RankAgent) -> pb.RankAgent:
    return pb.RankAgent(
        rank=agent.rank,
        nixl_agent_name=agent.agent_name,
        nixl_agent_metadata=agent.metadata,
        pool=pb.PoolInfo(**vars(agent.pool)),
        first_kv_head=agent.first_kv_head,
        num_kv_heads=agent.num_kv_heads,
    )


def rank_agent_from_proto(message: pb.RankAgent) -> RankAgent:
    return RankAgent(
        rank=message.rank,
        agent_name=message.nixl_agent_name,
        metadata=message.nixl_agent_metadata,
        pool=pool_info_from_proto(message.pool),
        first_kv_head=message.first_kv_head,
        num_kv_heads=message.num_kv_heads,
    )


def _bytes_view(pool: torch.Tensor, geometry: PoolGeometry) -> torch.Tensor:
    """The pool as [planes, num_blocks, chunk_bytes] uint8, sharing its memory."""
    return pool.view(torch.uint8).view(geometry.num_planes, geometry.num_blocks, -1)


def _chunk_runs(block_ids: Sequence[int], chunk: WireChunk) -> list[tuple[int, int, int]]:
    """(position in the chunk, first block id, count) for each run of consecutive ids: runs
    are sliced, since indexing a pool by a list of ids is ~30x slower than slice copies."""
    ids = block_ids[chunk.first_block : chunk.first_block + chunk.num_blocks]
    return block_runs(list(enumerate(ids)))


def gather_chunk(
    pool: torch.Tensor, geometry: PoolGeometry, block_ids: Sequence[int], chunk: WireChunk
) -> bytes:
    """The bytes of one wire chunk of `block_ids`, read from the pool."""
    planes = slice(chunk.first_plane, chunk.first_plane + chunk.num_planes)
    source = _bytes_view(pool, geometry)[planes]
    out = torch.empty((chunk.num_planes, chunk.num_blocks, geometry.chunk_bytes), dtype=torch.uint8)
    for pos, first, count in _chunk_runs(block_ids, chunk):
        out[:, pos : pos + count].copy_(source[:, first : first + count])
    return out.numpy().tobytes()


def scatter_chunk(
    pool: torch.Tensor,
    geometry: PoolGeometry,
    block_ids: Sequence[int],
    chunk: WireChunk,
    data: bytes,
) -> None:
    """Write one wire chunk's bytes into the pool's blocks `block_ids` (in place)."""
    planes = slice(chunk.first_plane, chunk.first_plane + chunk.num_planes)
    target = _bytes_view(pool, geometry)[planes]
    with warnings.catch_warnings():
        # The message's bytes are immutable; torch warns, but we only read from them.
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(data, dtype=torch.uint8)
    src = src.view(chunk.num_planes, chunk.num_blocks, geometry.chunk_bytes).to(pool.device)
    for pos, first, count in _chunk_runs(block_ids, chunk):
        target[:, first : first + count].copy_(src[:, pos : pos + count])


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, server: KVTransferServer) -> None:
        self._server = server

    def Challenge(self, request: pb.ChallengeRequest, context) -> pb.ChallengeReply:
        s = self._server
        try:
            nonce, proof = s.auth.challenge(
                request.client_nonce, request.peer_id, request.role, request.address, time.time()
            )
        except FleetAuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"engine {s.engine_id}: {e}")
        return pb.ChallengeReply(server_nonce=nonce, server_id=s.engine_id, server_proof=proof)

    def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeReply:
        s = self._server
        ctx = HandshakeContext(
            request.client_nonce,
            request.server_nonce,
            s.engine_id,
            request.engine_id,
            request.role,
            request.address,
        )
        try:
            peer = s.auth.verify(ctx, request.client_proof, time.time())
        except FleetAuthError as e:
            # Nothing about this server (record, pool, metadata) goes to an unproven peer.
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"engine {s.engine_id}: {e}")
        reply = pb.HandshakeReply(engine_id=s.engine_id)
        if peer.role == "releaser":  # a router, or an engine freeing a grant: no pool info
            reply.accepted = True
            reply.session = s.auth.open_session(peer, time.time())
            return reply
        # The server holds blocks for the peer that reads them: prefill for decode.
        mismatches = s.compat.mismatches(compat_from_proto(request.compat), PRODUCER_ROLES)
        reply.compat.CopyFrom(compat_to_proto(s.compat))
        if mismatches:
            reply.mismatches.extend(mismatches)
            reply.reason = f"engine {s.engine_id} refuses {peer.peer_id}: " + "; ".join(mismatches)
            return reply
        reply.accepted = True
        reply.session = s.auth.open_session(peer, time.time())
        reply.nixl_agent_name = s.nixl_agent_name
        reply.nixl_agent_metadata = s.nixl_metadata
        reply.pool.CopyFrom(pb.PoolInfo(**vars(s.pool_info)))
        reply.ranks.extend(rank_agent_to_proto(agent) for agent in s.rank_agents)
        return reply

    def _peer(self, session: bytes, context):
        try:
            return self._server.auth.peer_of(session, time.time())
        except FleetAuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))

    def ReadBlocks(self, request: pb.ReadBlocksRequest, context) -> Iterator[pb.BlockChunk]:
        s = self._server
        peer = self._peer(request.session, context)
        if peer.role != "reader":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "this session may only release")
        if s.compat.tensor_parallel_size > 1:
            # This pool is rank 0's shard only: a TCP reader would get a part of each block.
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a tensor-parallel engine serves its blocks over NIXL only",
            )
        grant = request.request_id
        held = s.held.blocks_of(grant, peer.reader)
        if held is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no blocks held under this grant for you")
        ids = list(request.block_ids)
        stray = sorted(set(ids) - set(held))
        if stray:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"blocks {stray[:8]} are not held under this grant",
            )
        for chunk in wire_chunks(len(ids), s.geometry, s.max_chunk_bytes):
            # A hold that expires mid-stream frees blocks that may be overwritten any moment.
            if s.held.blocks_of(grant, peer.reader) is None:
                context.abort(grpc.StatusCode.NOT_FOUND, "the grant was released mid-transfer")
            yield pb.BlockChunk(
                first_block=chunk.first_block,
                num_blocks=chunk.num_blocks,
                first_plane=chunk.first_plane,
                num_planes=chunk.num_planes,
                data=gather_chunk(s.pool, s.geometry, ids, chunk),
            )

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        peer = self._peer(request.session, context)
        return pb.ReleaseReply(released=self._server.held.release(request.request_id, peer.reader))


class KVTransferServer:
    """Serves Challenge, Handshake, ReadBlocks and Release for one engine on its own threads.

    `advertised_host` is the address peers dial (default: `host`); handshakes dialled to any
    other address are refused, so one cannot be relayed through another listener.
    `rank_agents`: under tensor parallelism, every rank's NIXL agent (rank 0 first), sent only
    to an accepted peer."""

    def __init__(
        self,
        held: HeldBlocks,
        pool: torch.Tensor,
        compat: CompatRecord,
        engine_id: str,
        *,
        secret: FleetSecret,
        host: str = "127.0.0.1",
        port: int = 0,
        advertised_host: str | None = None,
        nixl_agent_name: str = "",
        nixl_metadata: bytes = b"",
        rank_agents: Sequence[RankAgent] = (),
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_workers: int = 4,
    ) -> None:
        self.held = held
        self.pool = pool
        self.compat = compat
        self.engine_id = engine_id
        self.nixl_agent_name = nixl_agent_name
        self.nixl_metadata = nixl_metadata
        self.rank_agents = tuple(rank_agents)
        self.max_chunk_bytes = max_chunk_bytes
        self.geometry = geometry_of(pool)
        self.pool_info = describe_pool(pool)
        self.host = host
        handshake_bytes = len(nixl_metadata) + sum(len(a.metadata) for a in self.rank_agents)
        send_limit = max(
            chunk_message_limit(self.geometry, max_chunk_bytes), handshake_bytes + ENVELOPE_BYTES
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-transfer"),
            options=[
                ("grpc.max_send_message_length", send_limit),
                (
                    "grpc.max_receive_message_length",
                    request_message_limit(self.geometry.num_blocks),
                ),
            ],
        )
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port(peer_target(host, port))
        if self.port == 0:
            raise OSError(f"cannot bind the KV transfer service to {peer_target(host, port)}")
        self.address = peer_target(advertised_host or host, self.port)
        self.auth = PeerAuthenticator(secret, engine_id, self.address)

    def start(self) -> int:
        """Start serving; returns the bound port (useful with port=0)."""
        self._server.start()
        return self.port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; in-flight calls get `grace` seconds, then are cancelled."""
        self._server.stop(grace).wait()


class KVTransferClient(PeerSession):
    """One peer's KV transfer service, seen from an engine that pulls blocks (`handshake`,
    `read_blocks_tcp`); releasing is the session's."""

    def handshake(
        self,
        local_compat: CompatRecord,
        local_engine_id: str,
        expected_engine_id: str | None = None,
    ) -> PeerInfo:
        """Prove both sides hold the fleet secret, then exchange compatibility records; raises
        AuthenticationFailed, or IncompatiblePeer (with every reason) if the peer refuses us or
        we cannot read its cache."""
        mine, challenge, proof = self._prove(local_engine_id, "reader", expected_engine_id)
        reply = self._handshake(mine, challenge, proof, compat_to_proto(local_compat))
        peer = f"{reply.engine_id or '?'} at {self.target}"
        if not reply.accepted:
            raise IncompatiblePeer(peer, list(reply.mismatches) or [reply.reason])
        compat = compat_from_proto(reply.compat)
        # The server checked too; checking here guards against a peer that accepts anything.
        mismatches = local_compat.mismatches(compat, PRODUCER_ROLES[::-1])
        if mismatches:
            raise IncompatiblePeer(peer, mismatches)
        ranks = tuple(rank_agent_from_proto(r) for r in reply.ranks)
        tp = compat.tensor_parallel_size
        if tp > 1 and [r.rank for r in ranks] != list(range(tp)):
            raise IncompatiblePeer(
                peer, [f"a tensor-parallel size of {tp} needs one NIXL agent per rank"]
            )
        return PeerInfo(
            engine_id=reply.engine_id,
            compat=compat,
            nixl_agent_name=reply.nixl_agent_name,
            nixl_metadata=reply.nixl_agent_metadata,
            pool=pool_info_from_proto(reply.pool),
            ranks=ranks,
        )

    def read_blocks_tcp(
        self,
        transfer_id: str,
        pairs: Sequence[tuple[int, int]],
        local_pool: torch.Tensor,
        timeout: float | None = None,
    ) -> int:
        """Pull the peer's blocks (remote id, local id) held under `transfer_id` straight into
        `local_pool`'s blocks; returns the bytes received. Raises a TransferError on any
        failure, after which the local blocks hold partial data and must be recomputed."""
        geometry = geometry_of(local_pool)
        # Remote ids are checked by the server against what it holds.
        check_pairs(geometry, geometry, [(0, local) for _, local in pairs])
        remote_ids = [remote for remote, _ in pairs]
        local_ids = [local for _, local in pairs]
        request = pb.ReadBlocksRequest(
            request_id=transfer_id, block_ids=remote_ids, session=self._session
        )
        what = f"reading {len(pairs)} blocks from {self.target}"
        received = 0
        try:
            stream = self._stub.ReadBlocks(request, timeout=timeout or self.timeout)
            for message in stream:
                chunk = _checked_chunk(message, len(pairs), geometry, what)
                scatter_chunk(local_pool, geometry, local_ids, chunk, message.data)
                received += len(message.data)
        except grpc.RpcError as e:
            raise translate_rpc_error(e, what) from e
        if received != len(pairs) * geometry.block_bytes:
            raise TransferError(f"{what}: stream ended after {received} bytes")
        return received


def _checked_chunk(
    message: pb.BlockChunk, num_blocks: int, geometry: PoolGeometry, what: str
) -> WireChunk:
    """The message's chunk, if its ranges and size are consistent with the request."""
    chunk = WireChunk(
        message.first_block, message.num_blocks, message.first_plane, message.num_planes
    )
    size = chunk.num_planes * chunk.num_blocks * geometry.chunk_bytes
    if (
        chunk.first_block + chunk.num_blocks > num_blocks
        or chunk.first_plane + chunk.num_planes > geometry.num_planes
        or len(message.data) != size
    ):
        raise TransferError(f"{what}: malformed chunk {chunk} of {len(message.data)} bytes")
    return chunk
