"""KV transfer between tensor-parallel engines, piece by piece: the handshake (a TP mismatch
refused with both sizes, every rank's agent given to an accepted peer only, a TP peer without
its ranks refused, the TCP path closed under TP); the worker ranks' READs driven by rank 0
through the step channel, over a real two-rank gloo group and real NIXL agents; and a pull
that ends only when every rank's READ has (a failed or uncancellable worker READ)."""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import torch
from test_kv_transfer_service import DictHeld, compat_of, make_pool, serving
from test_security_kv_transfer import _StuckNixl

from pagefleet.common.kv_errors import IncompatiblePeer, TransferError
from pagefleet.engine.distributed.group import RankGroup
from pagefleet.engine.distributed.kv_ranks import RankKVChannel, WorkerKV
from pagefleet.engine.distributed.step_codec import stop_head
from pagefleet.engine.distributed.tp_runner import check_tensor_parallel, serve_steps
from pagefleet.engine.kv_transfer.connector import (
    KVConnector,
    KVTransferConfig,
    RankRead,
    RemoteSource,
)
from pagefleet.engine.kv_transfer.layout import RankAgent, describe_pool
from pagefleet.engine.kv_transfer.nixl_transport import NixlTransport
from pagefleet.engine.kv_transfer.service import compat_to_proto
from server_utils import fleet_secret

TP2 = {"tensor_parallel_size": 2}


def agents_of(pool: torch.Tensor) -> tuple[RankAgent, ...]:
    return tuple(
        RankAgent(rank, f"agent-{rank}", b"md%d" % rank, describe_pool(pool), rank, 1)
        for rank in range(2)
    )


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 4)])
def test_a_tp_mismatch_is_refused_naming_both_sizes(prefill_tp, decode_tp):
    pool = make_pool(0)
    ours = dataclasses.replace(compat_of(pool), tensor_parallel_size=decode_tp)
    theirs = {"compat": dataclasses.replace(compat_of(pool), tensor_parallel_size=prefill_tp)}
    with (
        serving(DictHeld({}), pool, **theirs) as (_, client),
        pytest.raises(IncompatiblePeer) as err,
    ):
        client.handshake(ours, "decode-0")
    assert (
        "heterogeneous TP is not supported: the prefill engine has tensor-parallel size "
        f"{prefill_tp}, the decode engine {decode_tp}"
    ) in str(err.value)


def test_only_an_accepted_peer_learns_every_rank_agent():
    """The worker ranks' agents (their pools' addresses) go to a peer the fleet secret and the
    compatibility record admitted, never to a refused one. Fails for: ranks sent with a
    refusal (a peer could then READ any rank's blocks once it found a way to its agents)."""
    pool = make_pool(0)
    compat = dataclasses.replace(compat_of(pool), **TP2)
    agents = agents_of(pool)
    with serving(DictHeld({}), pool, compat=compat, rank_agents=agents) as (_, client):
        assert client.handshake(compat, "decode-0").ranks == agents
    with serving(DictHeld({}), pool, compat=compat, rank_agents=agents) as (_, client):
        mine, challenge, proof = client._prove("decode-1", "reader", None)
        reply = client._handshake(mine, challenge, proof, compat_to_proto(compat_of(pool)))
        assert not reply.accepted and "heterogeneous TP" in reply.reason
        assert len(reply.ranks) == 0 and not reply.nixl_agent_metadata


def test_a_tp_peer_without_an_agent_per_rank_is_refused():
    pool = make_pool(0)
    compat = dataclasses.replace(compat_of(pool), **TP2)
    with (
        serving(DictHeld({}), pool, compat=compat, rank_agents=agents_of(pool)[:1]) as (_, c),
        pytest.raises(IncompatiblePeer, match="tensor-parallel size of 2 needs one NIXL agent"),
    ):
        c.handshake(compat, "decode-0")


def test_a_tp_engine_serves_no_tcp_reads():
    """The TCP path would stream rank 0's shard of each block: half a block, read as whole."""
    pool = make_pool(1)
    compat = dataclasses.replace(compat_of(pool), **TP2)
    held = DictHeld({"g": [1, 2]})
    with serving(held, pool, compat=compat, rank_agents=agents_of(pool)) as (_, client):
        client.handshake(compat, "decode-0")
        with pytest.raises(TransferError, match="over NIXL only"):
            client.read_blocks_tcp("g", [(1, 1)], make_pool(3))


def test_tp_engines_refuse_the_tcp_connector():
    args = SimpleNamespace(
        kv_transfer_config='{"kv_connector": "tcp"}', tensor_parallel_size=2, model="m"
    )
    with pytest.raises(ValueError, match="moves KV over NIXL only"):
        check_tensor_parallel(args, {})


# ---------------------------------------------------------------- rank 0 drives a worker rank


def join_pair() -> tuple[RankGroup, RankGroup]:
    """Two ranks of one gloo group, in this process (rank 1 joins from a thread)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    joined: list[RankGroup] = []
    thread = threading.Thread(
        target=lambda: joined.append(
            RankGroup.join("127.0.0.1", store.port, 1, 2, "gloo", torch.device("cpu"))
        )
    )
    thread.start()
    zero = RankGroup(store, 0, 2, "gloo", torch.device("cpu"))
    thread.join(60)
    return zero, joined[0]


def settle(channel: RankKVChannel, read: RankRead, within: float = 30.0) -> None:
    """Drive the ranks as the engine thread does each step, until the READ settles."""
    deadline = time.monotonic() + within
    while read.state == "pending":
        assert time.monotonic() < deadline, "the worker rank's READ never settled"
        channel.drive()


def finish(channel: RankKVChannel, read: RankRead) -> bool:
    """A puller's finish() while the engine thread keeps driving."""
    result: list[bool] = []
    puller = threading.Thread(target=lambda: result.append(channel.finish(read, 20)))
    puller.start()
    deadline = time.monotonic() + 30
    while puller.is_alive():
        assert time.monotonic() < deadline, "finish never returned"
        channel.drive()
        time.sleep(0.001)
    return result[0]


def test_rank_zero_drives_the_worker_ranks_reads_through_the_step_channel():
    """The worker rank opens its own agent on rank 0's word, loads the peer's rank-1 agent and
    READs that rank's shard into its own pool; a READ from a peer it never loaded fails and
    its cancel frees it. Fails for: a worker reading the peer's rank 0 (the wrong shard), a
    READ reported done before the bytes landed, a failed READ that is never settled."""
    layout = SimpleNamespace(first_kv_head=0, num_kv_heads=2)
    pools = [make_pool(seed, num_blocks=16) for seed in (10, 11, 20, 21)]
    decode0, decode1, prefill0, prefill1 = pools
    zero, one = join_pair()
    with ExitStack() as stack:
        prefill_agents = [
            stack.enter_context(NixlTransport(pool, f"prefill-{i}"))
            for i, pool in enumerate((prefill0, prefill1))
        ]
        rank0_nixl = stack.enter_context(NixlTransport(decode0, "decode-0"))
        worker = WorkerKV(decode1, 1, SimpleNamespace(first_kv_head=2, num_kv_heads=2))
        stack.callback(worker.close)
        loop = threading.Thread(target=serve_steps, args=(None, one, worker))
        loop.start()
        channel = RankKVChannel(zero, layout)
        try:
            agents = channel.open("decode", rank0_nixl.metadata(), rank0_nixl.pool_info)
            assert [(a.rank, a.agent_name, a.first_kv_head) for a in agents] == [
                (0, "decode", 0),
                (1, "decode-rank1", 2),
            ]
            peer_agents = [
                RankAgent(i, t.agent_name, t.metadata(), t.pool_info, 2 * i, 2)
                for i, t in enumerate(prefill_agents)
            ]
            channel.add_peer(7, peer_agents, compat_of(prefill0))
            pairs = [(3, 0), (4, 1), (9, 5)]
            read = channel.start_read(7, pairs)
            settle(channel, read)
            assert (read.state, read.released) == ("done", True)
            for remote, local in pairs:
                assert torch.equal(decode1[:, :, :, local], prefill1[:, :, :, remote])
            assert not torch.equal(decode1[:, :, :, 0], prefill0[:, :, :, 3])
            assert finish(channel, read) is True

            stray = channel.start_read(8, [(1, 2)])  # a peer the worker never loaded
            settle(channel, stray)
            assert stray.state == "failed"
            assert finish(channel, stray) is True and not worker.reads
        finally:
            channel.close()
            zero.broadcast(stop_head(zero.device))
            loop.join(30)
            zero.close()
            one.close()
    assert not loop.is_alive()


class _ReadyNixl(_StuckNixl):
    """Rank 0's NIXL transport whose READ is done at once."""

    def start_read(self, peer, pairs):
        return SimpleNamespace(peer=SimpleNamespace(agent_name="p"), num_bytes=100)

    def poll(self, handle) -> str:
        return "done"

    def release(self, handle) -> bool:
        return True


class _Ranks:
    """Worker ranks whose READ ends as `state`, and whose cancel `frees` or never does."""

    def __init__(self, state: str, frees: bool) -> None:
        self.state, self.frees = state, frees
        self.finished: list[RankRead] = []

    def start_read(self, peer_id, pairs) -> RankRead:
        return RankRead(1, state=self.state)

    def finish(self, read: RankRead, timeout: float) -> bool:
        self.finished.append(read)
        return self.frees

    def forget_peer(self, peer_id) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "state, frees, ok, quarantined",
    [("done", True, True, False), ("failed", True, False, False), ("failed", False, False, True)],
)
def test_a_pull_ends_only_with_every_rank_read(state, frees, ok, quarantined):
    """Rank 0's READ succeeds at once; the pull's result follows the worker ranks'. Fails for:
    a pull that succeeds with a worker's READ failed (its shard of the blocks is garbage), or
    a worker READ that could not be cancelled left unquarantined (NIXL may still write it)."""
    pool = make_pool(1, num_blocks=16)
    config = KVTransferConfig(kv_connector="tcp", kv_role="kv_consumer", transfer_timeout=5)
    connector = KVConnector(config, pool, compat_of(pool), "decode-x", fleet_secret())
    ranks = _Ranks(state, frees)
    connector.nixl, connector.ranks, connector.release_give_up_s = _ReadyNixl(), ranks, 0.5
    connector.rank_agents = agents_of(pool)
    client = SimpleNamespace(release=lambda grant: True)
    connector._peer = lambda source: (client, SimpleNamespace(engine_id="p"), object(), 3)
    connector._release_remote = lambda source: None
    try:
        connector.start_load("req", RemoteSource("p", "127.0.0.1", 1, (0, 1), "g"), [3, 4], 0)
        deadline = time.monotonic() + 30
        while not (results := connector.finished_loads()):
            assert time.monotonic() < deadline, "the pull never ended"
            connector.wait_for_results(0.1)
        (result,) = results
        assert (result.ok, result.quarantined) == (ok, quarantined)
        assert len(ranks.finished) == 1  # the worker ranks were always told to finish
        if ok:
            assert result.num_bytes == 2 * 100  # both ranks' shards
    finally:
        connector._workers.shutdown(wait=True)
