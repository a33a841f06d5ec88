"""The KV connector end to end in one process: a producer holding blocks and a consumer pulling
them over NIXL (UCX on loopback) or TCP, with the data path each pull took, the TCP path never
touched by a NIXL pull, and a hold that ended before the pull finished caught."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
import torch
from test_kv_transfer_service import compat_of, make_pool

from pagefleet.engine.kv_transfer.connector import (
    KVConnector,
    KVTransferConfig,
    LoadResult,
    RemoteSource,
)
from pagefleet.engine.kv_transfer.service import KVTransferClient

REMOTE_BLOCKS = [3, 7, 8, 9, 15]
LOCAL_BLOCKS = [0, 1, 2, 10, 11]  # local block 0 receives the first remote block


def connectors(stack: ExitStack, kind: str) -> tuple[KVConnector, KVConnector]:
    producer_pool, consumer_pool = make_pool(1), make_pool(2)
    config = KVTransferConfig(kv_connector=kind, kv_role="kv_producer", kv_port=0)
    producer = KVConnector(config, producer_pool, compat_of(producer_pool), "prefill-a")
    stack.callback(producer.close)
    config = KVTransferConfig(kv_connector=kind, kv_role="kv_consumer", transfer_timeout=20)
    consumer = KVConnector(config, consumer_pool, compat_of(consumer_pool), "decode-b")
    stack.callback(consumer.close)
    return producer, consumer


def pull(producer: KVConnector, consumer: KVConnector, request_id: str) -> LoadResult:
    params = producer.hold(request_id, REMOTE_BLOCKS, now=time.monotonic())
    source = RemoteSource.from_params(params)
    consumer.start_load(request_id, source, LOCAL_BLOCKS, first=0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        consumer.wait_for_results(1.0)
        done = consumer.finished_loads()
        if done:
            (result,) = done
            return result
    raise AssertionError("the pull never ended")


def assert_blocks_equal(producer: KVConnector, consumer: KVConnector) -> None:
    for remote, local in zip(REMOTE_BLOCKS, LOCAL_BLOCKS, strict=True):
        assert torch.equal(consumer.pool[:, :, :, local], producer.pool[:, :, :, remote]), local


def test_a_nixl_pull_moves_every_block_over_nixl_and_none_over_tcp(monkeypatch):
    """Fails for: the TCP re-read of block 0 after each NIXL READ (it overwrote that block with
    the TCP copy, so a NIXL error on it went unseen, and it made every NIXL pull a TCP pull
    too); a NIXL connector that falls back to TCP; the path not reported."""

    def no_tcp(*args, **kwargs):
        raise AssertionError("a NIXL pull used the TCP data path")

    monkeypatch.setattr(KVTransferClient, "read_blocks_tcp", no_tcp)
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "nixl")
        result = pull(producer, consumer, "req-1")
        assert (result.ok, result.path, result.error) == (True, "nixl", None)
        assert result.num_bytes == len(REMOTE_BLOCKS) * producer.pool[:, :, :, 0].nbytes
        assert_blocks_equal(producer, consumer)
        # The pull released the hold: the producer frees the blocks at its next step.
        assert producer.due_releases(time.monotonic()) == ["req-1"]


def test_a_tcp_pull_reports_tcp():
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "tcp")
        result = pull(producer, consumer, "req-1")
        assert (result.ok, result.path) == (True, "tcp")
        assert_blocks_equal(producer, consumer)


@pytest.mark.parametrize("kind", ["nixl", "tcp"])
def test_a_hold_that_ended_before_the_pull_fails_it(kind):
    """The producer's hold expired (its blocks may be reused) before the consumer read them:
    the pull fails and the consumer computes the prompt itself. Fails for: NIXL data accepted
    without checking the hold still stood when the READ was over."""
    with ExitStack() as stack:
        producer, consumer = connectors(stack, kind)
        params = producer.hold("req-2", REMOTE_BLOCKS, now=0.0)  # a deadline long gone
        assert producer.due_releases(time.monotonic()) == ["req-2"]
        consumer.start_load("req-2", RemoteSource.from_params(params), LOCAL_BLOCKS, first=0)
        consumer.wait_for_results(30)
        (result,) = consumer.finished_loads()
        assert not result.ok and result.path is None
        assert "req-2" in result.error
