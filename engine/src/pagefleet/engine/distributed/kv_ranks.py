"""Disaggregated P/D under tensor parallelism: the worker ranks' NIXL agents, driven by rank 0.

Every rank registers its own shard of the KV pool with its own NIXL agent; decode rank r READs
from prefill rank r (the same block ids on every rank, equal TP sizes on both sides). Rank 0's
connector asks from its pull threads (`RankKVChannel`, the connector's `RankReads`); the engine
thread sends the commands through the step channel (an OP_KV head, then a msgpack body) between
steps, so the scheduler and the step broadcasts stay single and in order. A READ in flight
costs one broadcast and one MIN all-reduce per step until every rank's READ is done, or one
failed; nothing at all otherwise. `WorkerKV` carries the commands out in ranks 1..N-1.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence

import msgpack
import torch

from pagefleet.common.kv_errors import TransferError
from pagefleet.engine.distributed.group import RankGroup
from pagefleet.engine.distributed.step_codec import kv_head
from pagefleet.engine.kv_transfer.connector import RankRead
from pagefleet.engine.kv_transfer.layout import CompatRecord, PoolInfo, RankAgent
from pagefleet.engine.model.parallel import TPLayout

logger = logging.getLogger("pagefleet.engine")

KV_OPEN, KV_ADD_PEER, KV_FORGET_PEER, KV_READ, KV_POLL, KV_CANCEL = range(6)
# A READ's state on one rank, ordered so that the MIN over ranks is the pull's state.
FAILED, PENDING, DONE = 0, 1, 2
_STATE_NAMES = {FAILED: "failed", PENDING: "pending", DONE: "done"}


def encode_command(kind: int, fields: dict) -> bytes:
    return msgpack.packb([kind, fields], use_bin_type=True)


def decode_command(data: bytes) -> tuple[int, dict]:
    kind, fields = msgpack.unpackb(data, raw=False)
    return kind, fields


def encode_agent(agent: RankAgent) -> bytes:
    fields = dataclasses.asdict(agent)
    fields["pool"] = dataclasses.astuple(agent.pool)
    return msgpack.packb(fields, use_bin_type=True)


def decode_agent(data: bytes) -> RankAgent:
    fields = msgpack.unpackb(data, raw=False)
    return RankAgent(**{**fields, "pool": PoolInfo(*fields["pool"])})


def flat_pairs(pairs: Sequence[tuple[int, int]]) -> list[int]:
    return [i for pair in pairs for i in pair]


def unflat_pairs(flat: Sequence[int]) -> list[tuple[int, int]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def worker_agent_name(agent_name: str, rank: int) -> str:
    return f"{agent_name}-rank{rank}"


class RankKVChannel:
    """Rank 0's side: the connector's `RankReads` over the rank group."""

    def __init__(self, group: RankGroup, layout: TPLayout) -> None:
        self.group, self.layout = group, layout
        self.wake: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._commands: list[tuple[int, dict, RankRead | None]] = []  # for the engine thread
        self._cancels: list[RankRead] = []
        self._read_ids = itertools.count(1)
        # The engine thread's own: READs in flight on the ranks, and READs to cancel.
        self._reading: dict[int, RankRead] = {}
        self._cancelling: dict[int, RankRead] = {}
        self._closed = False

    # ------------------------------------------------------------------ engine thread

    def open(self, agent_name: str, metadata: bytes, pool: PoolInfo) -> tuple[RankAgent, ...]:
        self._send(KV_OPEN, {"name": agent_name})
        mine = RankAgent(
            0, agent_name, metadata, pool, self.layout.first_kv_head, self.layout.num_kv_heads
        )
        parts = self.group.gather_bytes(encode_agent(mine))
        failed = [rank for rank, part in enumerate(parts) if not part]
        if failed:
            raise TransferError(f"tensor-parallel ranks {failed} could not open a NIXL agent")
        return tuple(decode_agent(part) for part in parts)

    def drive(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
            cancels, self._cancels = self._cancels, []
        for kind, fields, read in commands:
            self._send(kind, fields)
            if read is not None:
                self._reading[read.read_id] = read
        if self._reading:
            self._poll()
        for read in cancels:
            if read.released:  # done since it was asked
                read.freed.set()
                continue
            self._reading.pop(read.read_id, None)
            self._cancelling[read.read_id] = read
        if self._cancelling:
            self._cancel()

    def _send(self, kind: int, fields: dict) -> None:
        body = encode_command(kind, fields)
        self.group.broadcast(kv_head(len(body), self.group.device))
        data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        self.group.broadcast(data.to(self.group.device))

    def _poll(self) -> None:
        ids = list(self._reading)
        self._send(KV_POLL, {"ids": ids})
        for read_id, state in zip(ids, self.group.min_each([DONE] * len(ids)), strict=True):
            if state == PENDING:
                continue
            read = self._reading.pop(read_id)
            read.state = _STATE_NAMES[state]
            read.settled.set()
            if state == DONE:  # every rank freed its READ when it said so
                read.released = True
                read.freed.set()
            # failed: its puller's finish() has the ranks cancel what still runs

    def _cancel(self) -> None:
        ids = list(self._cancelling)
        self._send(KV_CANCEL, {"ids": ids})
        for read_id, freed in zip(ids, self.group.min_each([1] * len(ids)), strict=True):
            read = self._cancelling[read_id]
            if freed:
                read.released = True
                read.freed.set()
            if freed or read.freed.is_set():  # freed, or its puller gave up (finish)
                del self._cancelling[read_id]

    # ------------------------------------------------------------------ pull threads

    def add_peer(self, peer_id: int, agents: Sequence[RankAgent], compat: CompatRecord) -> None:
        self._ask(
            KV_ADD_PEER,
            {
                "peer": peer_id,
                "agents": [encode_agent(agent) for agent in agents],
                "compat": dataclasses.asdict(compat),
            },
        )

    def forget_peer(self, peer_id: int) -> None:
        self._ask(KV_FORGET_PEER, {"peer": peer_id})

    def start_read(self, peer_id: int, pairs: Sequence[tuple[int, int]]) -> RankRead:
        read = RankRead(next(self._read_ids))
        fields = {"id": read.read_id, "peer": peer_id, "pairs": flat_pairs(pairs)}
        if not self._ask(KV_READ, fields, read):
            read.state, read.released = "failed", True
            read.settled.set()
        return read

    def finish(self, read: RankRead, timeout: float) -> bool:
        if read.released:
            return True
        with self._lock:
            if self._closed:  # the engine is going: no step will ever use these blocks
                return True
            self._cancels.append(read)
        self.wake()
        freed = read.freed.wait(timeout)
        read.freed.set()  # given up (or done): the engine thread stops asking
        return freed and read.released

    def _ask(self, kind: int, fields: dict, read: RankRead | None = None) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._commands.append((kind, fields, read))
        self.wake()
        return True

    def close(self) -> None:
        """Pulls still waiting fail now (the engine thread drives the ranks no more)."""
        with self._lock:
            self._closed = True
            waiting = [r for _, _, r in self._commands if r is not None]
        for read in [*waiting, *self._reading.values()]:
            read.state = "failed"
            read.settled.set()


class WorkerKV:
    """A worker rank's side: its NIXL agent, its peers and its READs in flight."""

    def __init__(self, pool: torch.Tensor, rank: int, layout: TPLayout) -> None:
        self.pool, self.rank, self.layout = pool, rank, layout
        self.nixl = None
        self.peers: dict[int, object] = {}  # peer id -> NixlPeer (None: could not load it)
        self.reads: dict[int, object] = {}  # read id -> ReadHandle still to release

    def handle(self, group: RankGroup, data: bytes) -> None:
        """Carry out one command (and its collective, for those that answer rank 0)."""
        kind, fields = decode_command(data)
        if kind == KV_OPEN:
            group.gather_bytes(self._open(fields["name"]))
        elif kind == KV_ADD_PEER:
            self._add_peer(fields)
        elif kind == KV_FORGET_PEER:
            peer = self.peers.pop(fields["peer"], None)
            if peer is not None:
                self.nixl.remove_peer(peer)
        elif kind == KV_READ:
            self._start_read(fields)
        elif kind == KV_POLL:
            group.min_each([self._poll(read_id) for read_id in fields["ids"]])
        elif kind == KV_CANCEL:
            group.min_each([int(self._release(read_id)) for read_id in fields["ids"]])
        else:
            raise ValueError(f"unknown KV command {kind}")

    def _open(self, agent_name: str) -> bytes:
        from pagefleet.engine.kv_transfer.nixl_transport import NixlTransport

        name = worker_agent_name(agent_name, self.rank)
        try:
            self.nixl = NixlTransport(self.pool, name)
        except Exception:  # rank 0 refuses to start: an empty answer says this rank failed
            logger.exception("rank %d: cannot open NIXL agent %s", self.rank, name)
            return b""
        agent = RankAgent(
            self.rank,
            name,
            self.nixl.metadata(),
            self.nixl.pool_info,
            self.layout.first_kv_head,
            self.layout.num_kv_heads,
        )
        return encode_agent(agent)

    def _add_peer(self, fields: dict) -> None:
        agent = decode_agent(fields["agents"][self.rank])
        compat = CompatRecord(**{**fields["compat"], "num_kv_heads": agent.num_kv_heads})
        try:
            self.peers[fields["peer"]] = self.nixl.add_peer(
                agent.metadata, agent.pool, compat, agent_name=agent.agent_name
            )
        except TransferError as e:  # its READs fail: the decode engine computes the prompt
            logger.warning("rank %d: %s", self.rank, e)
            self.peers[fields["peer"]] = None

    def _start_read(self, fields: dict) -> None:
        peer = self.peers.get(fields["peer"])
        handle = None
        if peer is not None:
            try:
                handle = self.nixl.start_read(peer, unflat_pairs(fields["pairs"]))
            except TransferError as e:
                logger.warning("rank %d: %s", self.rank, e)
        self.reads[fields["id"]] = handle

    def _poll(self, read_id: int) -> int:
        handle = self.reads.get(read_id)
        if handle is None:
            return FAILED
        state = self.nixl.poll(handle)
        if state == "done" and self.nixl.release(handle):
            del self.reads[read_id]
            return DONE
        return PENDING if state in ("pending", "done") else FAILED

    def _release(self, read_id: int) -> bool:
        """Free (cancelling) a READ; False while NIXL cannot cancel it."""
        handle = self.reads.get(read_id)
        if handle is not None and not self.nixl.release(handle):
            return False
        self.reads.pop(read_id, None)
        return True

    def close(self) -> None:
        if self.nixl is not None:
            for read_id in list(self.reads):
                self._release(read_id)
            self.nixl.close()
