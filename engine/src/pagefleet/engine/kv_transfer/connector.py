"""The engine's side of disaggregation: hold blocks for decode pods, pull blocks from prefill pods.

The engine thread calls `hold`, `start_load`, `finished_loads` and `due_releases`; gRPC threads
call `blocks_of` and `release` (the `HeldBlocks` the transfer service serves); each pull runs on
a worker thread (handshake, NIXL READ or TCP stream, release of the prefill side), so a
transfer never stalls a step. Every pull ends in exactly one `LoadResult`, success or not: the
engine then either continues from the pulled blocks or computes the prompt itself.

Under tensor parallelism each rank has its own NIXL agent over its shard of every block (the
same block ids on every rank). The handshake gives every rank's agent; a pull READs rank 0's
shard here and asks the other ranks (`RankReads`) for theirs, and ends only when every rank's
READ has. Holds and releases are rank 0's bookkeeping: the KV manager is single.

A hold is a grant: 128 random bits (never derived from the client's request id), bound to the
first engine that reads it, void after the hold timeout. Peers authenticate with the fleet
secret both ways before any byte moves.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from pagefleet.common.fleet_auth import FleetSecret
from pagefleet.common.kv_errors import (
    IncompatiblePeer,
    TransferError,
    TransferTimeout,
    UnknownRequest,
)
from pagefleet.engine.json_flag import parse_json_object
from pagefleet.engine.kv_transfer.layout import CompatRecord, PoolInfo, RankAgent, geometry_of
from pagefleet.engine.kv_transfer.service import (
    KVTransferClient,
    KVTransferServer,
    PeerInfo,
    chunk_message_limit,
)

logger = logging.getLogger("pagefleet.engine")
CONNECTORS = ("nixl", "tcp")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_PORT = 14579
GRANT_BYTES = 16  # 128 bits
# How long a worker keeps asking NIXL to cancel a READ before it gives up on those blocks.
RELEASE_GIVE_UP_S = 10.0


class ReadNotReleased(TransferError):
    """NIXL could not cancel a READ: the local blocks may still be written and must never be
    reused (the request is aborted, the blocks are quarantined)."""


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config`, in vLLM's JSON shape (plus pagefleet's port and timeouts)."""

    kv_connector: str = "nixl"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where peers reach this engine's transfer service
    kv_port: int = DEFAULT_KV_PORT  # 0: any free port (tests)
    kv_bind_host: str | None = None  # default: kv_ip
    hold_timeout: float = 120.0  # --kv-hold-timeout: seconds a prefill pod keeps blocks
    transfer_timeout: float = 30.0  # seconds a decode pod waits for one pull

    @classmethod
    def parse(cls, text: str, **overrides) -> KVTransferConfig:
        raw = parse_json_object(
            "--kv-transfer-config", text, cls.__dataclass_fields__, {"kv_connector_extra_config"}
        )
        config = cls(**raw, **overrides)
        if config.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector {config.kv_connector!r}: one of {list(CONNECTORS)}")
        if config.kv_role not in ROLES:
            raise ValueError(f"kv_role {config.kv_role!r}: one of {list(ROLES)}")
        return config

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class RemoteSource:
    """Where a decode-side request's prompt blocks are: a prefill pod's `kv_transfer_params`.
    `lora_name`: the LoRA adapter the prefill pod computed them with (None: the base model)."""

    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    request_id: str
    lora_name: str | None = None

    @classmethod
    def from_params(cls, params: dict) -> RemoteSource:
        try:
            return cls(
                engine_id=str(params["remote_engine_id"]),
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                block_ids=tuple(int(b) for b in params["remote_block_ids"]),
                request_id=str(params["remote_request_id"]),
                lora_name=_optional_str(params.get("remote_lora_name")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                "kv_transfer_params with do_remote_prefill needs remote_engine_id, remote_host, "
                f"remote_port, remote_block_ids and remote_request_id ({e!r})"
            ) from None

    def checked_for(self, lora) -> RemoteSource:
        """This source, if its blocks were computed with the request's adapter (`lora`, a
        LoRARequest or None): KV of another adapter (or of the base model) is not this
        request's, whatever the tokens; ValueError otherwise."""
        wanted = lora.lora_name if lora is not None else None
        if self.lora_name != wanted:
            raise ValueError(
                f"kv_transfer_params hold KV computed for {_model_label(self.lora_name)}, "
                f"this request runs {_model_label(wanted)}"
            )
        return self


def _optional_str(value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("remote_lora_name must be a string")
    return value


def _model_label(lora_name: str | None) -> str:
    return "the base model" if lora_name is None else f"LoRA adapter {lora_name!r}"


@dataclass
class LoadResult:
    request_id: str
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    quarantined: bool = False  # its blocks may still be written: never reuse them
    path: str | None = None  # the data path that moved the bytes: "nixl" or "tcp"


@dataclass
class _Hold:
    """Blocks kept for a decode pod under one grant."""

    request_id: str
    block_ids: list[int]
    deadline: float  # monotonic
    reader: str | None = None  # the engine that read it first; only it may read again


@dataclass
class RankRead:
    """One pull's READs on the worker ranks, as rank 0 knows them."""

    read_id: int
    # pending until every worker rank's READ is done, or until one of them failed
    state: Literal["pending", "done", "failed"] = "pending"
    released: bool = False  # no worker rank can still write into its blocks
    settled: threading.Event = field(default_factory=threading.Event)  # state left pending
    freed: threading.Event = field(default_factory=threading.Event)  # released became True


class RankReads(Protocol):
    """The engine's worker ranks, each with a NIXL agent over its shard of the pool. Pull
    threads ask; the engine thread carries the requests out to the ranks in `drive` (their
    channel is the one the steps go through: see distributed/kv_ranks.py)."""

    wake: Callable[[], None]  # rings the engine loop: a request is waiting for `drive`

    def open(self, agent_name: str, metadata: bytes, pool: PoolInfo) -> tuple[RankAgent, ...]:
        """Engine thread, once: every rank opens its agent; returns them all, rank 0 first."""
        ...

    def add_peer(self, peer_id: int, agents: Sequence[RankAgent], compat: CompatRecord) -> None:
        """Each worker rank r loads the metadata of the peer's rank r."""
        ...

    def forget_peer(self, peer_id: int) -> None: ...

    def start_read(self, peer_id: int, pairs: Sequence[tuple[int, int]]) -> RankRead:
        """Each worker rank READs the peer rank's shard of the blocks into its own."""
        ...

    def finish(self, read: RankRead, timeout: float) -> bool:
        """Cancel the READs still running; True once none can write, False after `timeout`."""
        ...

    def drive(self) -> None:
        """Engine thread: send what was asked to the ranks; poll their READs in flight."""
        ...

    def close(self) -> None: ...


@dataclass
class TransferStats:
    """Totals for the pagefleet:kv_transfer_* metrics."""

    bytes: int = 0
    transfers: int = 0
    failures: int = 0
    fallbacks: int = 0


class KVConnector:
    def __init__(
        self,
        config: KVTransferConfig,
        pool: torch.Tensor,
        compat: CompatRecord,
        engine_id: str,
        secret: FleetSecret,
        ranks: RankReads | None = None,
    ) -> None:
        """`ranks`: the worker ranks of a tensor-parallel engine (`pool` is rank 0's shard)."""
        self.config, self.pool, self.compat, self.engine_id = config, pool, compat, engine_id
        self.secret = secret
        self.stats = TransferStats()
        self.wake: Callable[[], None] = lambda: None  # the engine loop's doorbell
        self.release_give_up_s = RELEASE_GIVE_UP_S
        self._message_limit = chunk_message_limit(geometry_of(pool))
        self._held: dict[str, _Hold] = {}  # grant -> hold
        self._held_lock = threading.Lock()
        self._releases: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._result_ready = threading.Event()
        # (host, port) -> (client, handshake, rank 0's NIXL peer, the worker ranks' peer id)
        self._peers: dict[tuple[str, int], tuple[KVTransferClient, PeerInfo, object, int]] = {}
        self._peers_lock = threading.Lock()
        self._peer_ids = itertools.count(1)
        self._workers = ThreadPoolExecutor(8, thread_name_prefix="kv-pull")
        self.nixl = None
        if config.kv_connector == "nixl":
            from pagefleet.engine.kv_transfer.nixl_transport import NixlTransport

            self.nixl = NixlTransport(pool, f"pagefleet-{engine_id}")
        self.ranks = ranks
        self.rank_agents: tuple[RankAgent, ...] = ()
        if ranks is not None:
            if self.nixl is None:
                raise ValueError("a tensor-parallel engine moves KV over NIXL only")
            ranks.wake = self._ring
            self.rank_agents = ranks.open(
                self.nixl.agent_name, self.nixl.metadata(), self.nixl.pool_info
            )
        self.server = None
        self.port = 0
        if config.produces:
            self.server = KVTransferServer(
                self,
                pool,
                compat,
                engine_id,
                secret=secret,
                host=config.kv_bind_host or config.kv_ip,
                port=config.kv_port,
                advertised_host=config.kv_ip,
                nixl_agent_name=self.nixl.agent_name if self.nixl else "",
                nixl_metadata=self.nixl.metadata() if self.nixl else b"",
                rank_agents=self.rank_agents,
            )
            self.port = self.server.start()

    # ------------------------------------------------------------------ prefill side

    def hold(
        self,
        request_id: str,
        block_ids: Sequence[int],
        now: float,
        lora_name: str | None = None,
    ) -> dict:
        """Keep a finished prefill's blocks for a decode pod under a fresh grant; returns the
        request's kv_transfer_params (`remote_request_id` is the grant; `remote_lora_name`
        the adapter the KV was computed with, which the decode pod checks)."""
        grant = secrets.token_urlsafe(GRANT_BYTES)
        with self._held_lock:
            self._held[grant] = _Hold(request_id, list(block_ids), now + self.config.hold_timeout)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.config.kv_ip,
            "remote_port": self.port,
            "remote_block_ids": list(block_ids),
            "remote_request_id": grant,
        }
        if lora_name is not None:  # vLLM's shape for the base model's requests
            params["remote_lora_name"] = lora_name
        return params

    def blocks_of(self, transfer_id: str, reader: str) -> list[int] | None:
        """From a gRPC thread: the grant's blocks for this reader (binding it on first use)."""
        with self._held_lock:
            hold = self._held.get(transfer_id)
            if hold is None or hold.deadline <= time.monotonic():
                return None
            if hold.reader is None:
                hold.reader = reader
            return hold.block_ids if hold.reader == reader else None

    def release(self, transfer_id: str, reader: str) -> bool:
        """From a gRPC thread: the engine thread frees the blocks at its next step. The reader
        that bound the grant, or a releaser (a router whose decode never came), may free it."""
        with self._held_lock:
            hold = self._held.get(transfer_id)
            allowed = hold is not None and (
                hold.reader in (None, reader) or reader.startswith("releaser/")
            )
        if allowed:
            self._releases.put(transfer_id)
            self.wake()
        return allowed

    def due_releases(self, now: float) -> list[str]:
        """Request ids whose held blocks to free now: released by their reader, or past their
        hold timeout."""
        with self._held_lock:
            due = [grant for grant, hold in self._held.items() if hold.deadline <= now]
            while True:
                try:
                    due.append(self._releases.get_nowait())
                except queue.Empty:
                    break
            done = [self._held.pop(grant, None) for grant in due]
        return [hold.request_id for hold in done if hold is not None]

    # ------------------------------------------------------------------ decode side

    def start_load(
        self, request_id: str, source: RemoteSource, local_block_ids: Sequence[int], first: int
    ) -> None:
        """Pull the source's blocks [first, len(local_block_ids)) into ours, on a worker."""
        n = len(local_block_ids)
        if len(source.block_ids) < n:
            error = f"prefill pod sent {len(source.block_ids)} block ids, the prompt needs {n}"
            self._finish(LoadResult(request_id, False, error=error))
            self._workers.submit(self._release_remote, source)
            return
        pairs = [(source.block_ids[i], local_block_ids[i]) for i in range(first, n)]
        self._workers.submit(self._load, request_id, source, pairs)

    def finished_loads(self) -> list[LoadResult]:
        self._result_ready.clear()  # before draining: a result landing now sets it again
        done = []
        while True:
            try:
                done.append(self._results.get_nowait())
            except queue.Empty:
                return done

    def wait_for_results(self, timeout: float) -> None:
        """Sleep until a pull ends or needs the ranks (or `timeout`): the engine has nothing
        else to do."""
        self._result_ready.wait(timeout)

    def drive_ranks(self) -> None:
        """Engine thread, each step: carry the pulls' requests out to the worker ranks."""
        if self.ranks is not None:
            self.ranks.drive()

    def _ring(self) -> None:
        self._result_ready.set()  # ends wait_for_results: the engine thread drives the ranks
        self.wake()

    def _load(self, request_id: str, source: RemoteSource, pairs: list[tuple[int, int]]) -> None:
        started = time.monotonic()
        result = LoadResult(request_id, False)
        try:
            if pairs:
                result.num_bytes, result.path = self._pull(source, pairs)
            result.ok = True
        except ReadNotReleased as e:
            result.error, result.quarantined = str(e), True
            self._forget_peer(source)
            logger.error("KV pull for %s: %s; its blocks are quarantined", request_id, e)
        except TransferError as e:
            result.error = str(e)
            self._forget_peer(source)
            logger.warning("KV pull for %s failed, computing locally: %s", request_id, e)
        except Exception as e:  # never leave a request waiting for a result that won't come
            result.error = f"unexpected: {e!r}"
            self._forget_peer(source)
            logger.exception("KV pull for %s failed", request_id)
        finally:
            result.seconds = time.monotonic() - started
            self._release_remote(source)
            self._finish(result)

    def _finish(self, result: LoadResult) -> None:
        self._results.put(result)
        self._result_ready.set()
        self.wake()

    def _pull(self, source: RemoteSource, pairs: list[tuple[int, int]]) -> tuple[int, str]:
        client, peer, nixl_peer, rank_peer = self._peer(source)
        timeout = self.config.transfer_timeout
        if self.nixl is None or nixl_peer is None:
            tcp = client.read_blocks_tcp(source.request_id, pairs, self.pool, timeout=timeout)
            return tcp, "tcp"
        handle = self.nixl.start_read(nixl_peer, pairs)
        ranks = None if self.ranks is None else self.ranks.start_read(rank_peer, pairs)
        deadline = time.monotonic() + timeout
        try:
            # Until every rank's READ is done, or one failed (the others are cancelled below).
            while True:
                state = self.nixl.poll(handle)
                states = {state, ranks.state if ranks is not None else "done"}
                if states == {"done"} or "failed" in states:
                    break
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"NIXL READ from {peer.engine_id} timed out")
                time.sleep(0.0002)
            if state == "failed":
                raise TransferError(f"NIXL READ from {peer.engine_id} failed")
            if ranks is not None and ranks.state == "failed":
                raise TransferError(f"NIXL READ from {peer.engine_id} failed on a worker rank")
            # Held blocks are never reused, and a hold never comes back once released: if the
            # peer still held the request when the READ was over, what we read was its KV all
            # along. Releasing it now both frees it and tells us whether it was still held.
            # (Asking by re-reading a block over TCP overwrote that block with the TCP copy,
            # which hid any NIXL error on it.)
            if not client.release(source.request_id):
                # Not naming the grant: the message goes to the log.
                raise UnknownRequest(
                    f"{peer.engine_id} no longer held the grant after the NIXL READ"
                )
            # Every rank moved its shard of the same blocks: as many bytes as rank 0.
            return handle.num_bytes * max(1, len(self.rank_agents)), "nixl"
        finally:
            try:
                self._release_read(handle)
            finally:
                if ranks is not None:
                    self._release_rank_reads(ranks)

    def _release_read(self, handle) -> None:
        """Free a READ, retrying while NIXL cannot cancel it (our blocks may still be written,
        so the request must not move on); raises ReadNotReleased after `release_give_up_s`."""
        give_up = time.monotonic() + self.release_give_up_s
        while not self.nixl.release(handle):
            if time.monotonic() > give_up:
                raise ReadNotReleased(
                    f"NIXL could not cancel a READ from {handle.peer.agent_name} "
                    f"in {self.release_give_up_s:.0f} s"
                )
            time.sleep(0.01)

    def _release_rank_reads(self, read: RankRead) -> None:
        """The worker ranks' side of `_release_read`."""
        if not self.ranks.finish(read, self.release_give_up_s):
            raise ReadNotReleased(
                f"NIXL could not cancel a worker rank's READ in {self.release_give_up_s:.0f} s"
            )

    def _peer(self, source: RemoteSource):
        key = (source.host, source.port)
        with self._peers_lock:
            known = self._peers.get(key)
        if known is not None and known[1].engine_id == source.engine_id:
            return known
        if known is not None:  # the pod restarted under the same address
            self._forget_peer(source)
        client = KVTransferClient(
            source.host,
            source.port,
            timeout=self.config.transfer_timeout,
            secret=self.secret,
            max_message_bytes=self._message_limit,
        )
        try:
            peer = client.handshake(self.compat, self.engine_id, source.engine_id)
            nixl_peer = None
            if self.nixl is not None and peer.nixl_agent_name:
                nixl_peer = self.nixl.add_peer(
                    peer.nixl_metadata, peer.pool, peer.compat, agent_name=peer.nixl_agent_name
                )
            rank_peer = 0
            if self.ranks is not None:
                rank_peer = self._add_rank_peer(peer, nixl_peer)
        except BaseException:
            client.close()
            raise
        link = (client, peer, nixl_peer, rank_peer)
        with self._peers_lock:
            self._peers[key] = link
        return link

    def _add_rank_peer(self, peer: PeerInfo, nixl_peer) -> int:
        """Tell the worker ranks about an accepted tensor-parallel peer (the compatibility
        record already matched its size); returns the id they know it by."""
        if nixl_peer is None:
            raise IncompatiblePeer(peer.engine_id, ["a tensor-parallel peer without NIXL"])
        theirs = [(a.first_kv_head, a.num_kv_heads) for a in peer.ranks]
        ours = [(a.first_kv_head, a.num_kv_heads) for a in self.rank_agents]
        if theirs != ours:
            raise IncompatiblePeer(
                peer.engine_id, [f"KV heads per rank differ: {ours} here, {theirs} on the peer"]
            )
        peer_id = next(self._peer_ids)
        self.ranks.add_peer(peer_id, peer.ranks, peer.compat)
        return peer_id

    def _forget_peer(self, source: RemoteSource) -> None:
        with self._peers_lock:
            known = self._peers.pop((source.host, source.port), None)
        if known is not None:
            client, _, nixl_peer, rank_peer = known
            client.close()
            if nixl_peer is not None and self.nixl is not None:
                self.nixl.remove_peer(nixl_peer)
            if rank_peer and self.ranks is not None:
                self.ranks.forget_peer(rank_peer)

    def _release_remote(self, source: RemoteSource) -> None:
        """Tell the prefill pod to free its blocks; if it can't hear us, its timeout will."""
        with self._peers_lock:
            known = self._peers.get((source.host, source.port))
        try:
            if known is not None:  # the channel of the handshake: no new connection
                known[0].release(source.request_id)
                return
            # Our handshake failed (an incompatible peer): release under a releaser session.
            with KVTransferClient(
                source.host, source.port, timeout=2.0, secret=self.secret
            ) as client:
                client.authenticate_to_release(self.engine_id, source.engine_id)
                client.release(source.request_id)
        except TransferError as e:
            logger.info("release of a grant on %s failed: %s", source.host, e)

    def close(self) -> None:
        if self.ranks is not None:  # first: a pull waiting for the ranks must not wait on
            self.ranks.close()  # an engine thread that no longer drives them
        self._workers.shutdown(wait=True, cancel_futures=False)
        if self.server is not None:
            self.server.stop(grace=0.5)
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for client, *_ in peers:
            client.close()
        if self.nixl is not None:
            self.nixl.close()
