"""The KV connector end to end in one process: a producer holding blocks and a consumer pulling
them over NIXL (UCX on loopback) or TCP, with the data path each pull took, the TCP path never
touched by a NIXL pull, and a hold that ended before the pull finished caught. Connectors
share the test fleet secret; a hold's `remote_request_id` is its grant, not the request id."""

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
    TransferStats,
)
from pagefleet.engine.kv_transfer.service import KVTransferClient
from server_utils import fleet_secret

REMOTE_BLOCKS = [3, 7, 8, 9, 15]
LOCAL_BLOCKS = [0, 1, 2, 10, 11]  # local block 0 receives the first remote block


def connectors(stack: ExitStack, kind: str) -> tuple[KVConnector, KVConnector]:
    producer_pool, consumer_pool = make_pool(1), make_pool(2)
    config = KVTransferConfig(kv_connector=kind, kv_role="kv_producer", kv_port=0)
    producer = connector(config, producer_pool, "prefill-a")
    stack.callback(producer.close)
    config = KVTransferConfig(kv_connector=kind, kv_role="kv_consumer", transfer_timeout=20)
    consumer = connector(config, consumer_pool, "decode-b")
    stack.callback(consumer.close)
    return producer, consumer


def connector(config: KVTransferConfig, pool: torch.Tensor, engine_id: str) -> KVConnector:
    return KVConnector(config, pool, compat_of(pool), engine_id, fleet_secret())


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
            assert result.request_id == request_id and 0 <= result.seconds < 60
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


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("nixl", "prefill-a no longer held the grant after the NIXL READ"),
        ("tcp", "no blocks held under this grant for you"),
    ],
    ids=["nixl", "tcp"],
)
def test_a_hold_that_ended_before_the_pull_fails_it(kind, error):
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
        assert result.request_id == "req-2" and error in result.error
        assert params["remote_request_id"] not in result.error  # errors are logged


def test_the_config_parses_vllms_json_and_says_what_is_wrong():
    """Fails for: defaults changed, the extra-config key refused, overrides ignored, a bad
    connector, role or key accepted, or the messages not naming the problem."""
    from pagefleet.engine.kv_transfer.connector import DEFAULT_KV_PORT

    default = KVTransferConfig.parse("{}")
    assert default == KVTransferConfig("nixl", "kv_both", "127.0.0.1", DEFAULT_KV_PORT)
    assert (default.kv_bind_host, default.hold_timeout, default.transfer_timeout) == (
        None,
        120.0,
        30.0,
    )
    text = '{"kv_connector": "tcp", "kv_role": "kv_consumer", "kv_connector_extra_config": {}}'
    parsed = KVTransferConfig.parse(text, hold_timeout=5.0)
    assert (parsed.kv_connector, parsed.kv_role, parsed.hold_timeout) == ("tcp", "kv_consumer", 5)
    for bad, message in (
        ("{", "--kv-transfer-config is not JSON"),
        ("[1]", "--kv-transfer-config must be a JSON object"),
        ('"x"', "--kv-transfer-config must be a JSON object"),
        ('{"kv_rank": 0}', "--kv-transfer-config: unknown keys ['kv_rank']; known: ['hold_"),
        ('{"kv_connector": "lmcache"}', "kv_connector 'lmcache': one of ['nixl', 'tcp']"),
        ('{"kv_role": "both"}', "kv_role 'both': one of ['kv_producer', 'kv_consumer', 'kv_both']"),
    ):
        with pytest.raises(ValueError) as caught:
            KVTransferConfig.parse(bad)
        assert str(caught.value).startswith(message), (bad, str(caught.value))
    roles = {}
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        config = KVTransferConfig(kv_role=role)
        roles[role] = (config.produces, config.consumes)
    assert roles == {
        "kv_producer": (True, False),
        "kv_consumer": (False, True),
        "kv_both": (True, True),
    }


def test_remote_source_reads_the_prefill_answer_and_refuses_a_partial_one():
    params = {
        "remote_engine_id": 7,
        "remote_host": "10.0.0.2",
        "remote_port": "9000",
        "remote_block_ids": ["4", 5],
        "remote_request_id": 11,
    }
    assert RemoteSource.from_params(params) == RemoteSource("7", "10.0.0.2", 9000, (4, 5), "11")
    for broken in (
        {k: v for k, v in params.items() if k != "remote_port"},
        {**params, "remote_block_ids": None},
        {**params, "remote_port": "http"},
    ):
        with pytest.raises(ValueError, match="needs remote_engine_id, remote_host, remote_port"):
            RemoteSource.from_params(broken)


def test_holds_answer_as_vllm_and_end_by_release_or_deadline():
    """Fails for: the params' shape changed, a release of an unknown request acknowledged, a
    hold expiring before (or not at) its deadline, a released hold returned twice, the engine
    loop not woken for a release."""
    reader = "reader/decode-b"
    with ExitStack() as stack:
        producer, _ = connectors(stack, "tcp")
        rings = []
        producer.wake = lambda: rings.append(1)
        now = time.monotonic()  # blocks_of checks deadlines against the clock
        params = producer.hold("req.1", [4, 5], now=now)
        g1 = params["remote_request_id"]
        assert params == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "prefill-a",
            "remote_host": "127.0.0.1",
            "remote_port": producer.port,
            "remote_block_ids": [4, 5],
            "remote_request_id": g1,
        }
        # a grant is random, not the request id: "." is outside its base64 alphabet, so the
        # check cannot fail by chance
        assert "req.1" not in g1
        g2 = producer.hold("req.2", [6], now=now)["remote_request_id"]
        assert producer.blocks_of(g1, reader) == [4, 5]
        assert producer.blocks_of("req.1", reader) is None  # the request id is no grant
        assert producer.blocks_of("nope", reader) is None
        assert producer.release("nope", reader) is False and rings == []
        assert producer.release(g1, reader) is True and rings == [1]
        assert producer.due_releases(now=now) == ["req.1"]
        assert producer.due_releases(now=now) == []
        timeout = producer.config.hold_timeout
        assert producer.due_releases(now=now + timeout - 0.001) == []
        assert producer.due_releases(now=now + timeout) == ["req.2"]
        assert producer.blocks_of(g2, reader) is None


def test_a_prefill_answer_with_too_few_blocks_fails_at_once_and_is_released():
    """Fails for: pulling from a short block list (an index error on a worker), or the prefill
    pod's hold left to time out."""
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "tcp")
        params = producer.hold("short", REMOTE_BLOCKS[:2], now=time.monotonic())
        consumer.start_load("short", RemoteSource.from_params(params), LOCAL_BLOCKS, first=0)
        (result,) = consumer.finished_loads()
        assert (result.request_id, result.ok) == ("short", False)
        assert result.error == "prefill pod sent 2 block ids, the prompt needs 5"
        assert wait_released(producer) == ["short"]


def wait_released(producer: KVConnector) -> list[str]:
    """The requests a producer frees at its next step, once there are some."""
    deadline = time.monotonic() + 10
    while not (released := producer.due_releases(time.monotonic())):
        assert time.monotonic() < deadline, "nothing was released"
        time.sleep(0.02)
    return released


def test_a_pull_skips_the_blocks_the_decode_pod_already_has():
    """Fails for: `first` ignored (cached local blocks overwritten), or an empty pull treated
    as a transfer (a data path reported, bytes counted)."""
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "tcp")
        before = consumer.pool.clone()
        params = producer.hold("part", REMOTE_BLOCKS, now=time.monotonic())
        consumer.start_load("part", RemoteSource.from_params(params), LOCAL_BLOCKS, first=3)
        consumer.wait_for_results(20)
        (result,) = consumer.finished_loads()
        assert result.ok and result.num_bytes == 2 * producer.pool[:, :, :, 0].nbytes
        for local in LOCAL_BLOCKS[:3]:
            assert torch.equal(consumer.pool[:, :, :, local], before[:, :, :, local])
        for remote, local in zip(REMOTE_BLOCKS[3:], LOCAL_BLOCKS[3:], strict=True):
            assert torch.equal(consumer.pool[:, :, :, local], producer.pool[:, :, :, remote])
        params = producer.hold("none", REMOTE_BLOCKS, now=time.monotonic())
        consumer.start_load("none", RemoteSource.from_params(params), LOCAL_BLOCKS, first=5)
        consumer.wait_for_results(20)
        (result,) = consumer.finished_loads()
        assert (result.ok, result.num_bytes, result.path) == (True, 0, None)
        assert producer.due_releases(time.monotonic()) == ["part", "none"]


def test_an_unexpected_error_in_a_pull_still_ends_it():
    """Every pull ends in a result, or its request waits forever. Fails for: a non-transfer
    exception escaping the worker."""
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "tcp")

        def broken(*args):
            raise RuntimeError("boom")

        consumer._pull = broken
        rings = []
        consumer.wake = lambda: rings.append(1)
        result = pull(producer, consumer, "err")
        assert result.ok is False and result.error == "unexpected: RuntimeError('boom')"
        assert rings and result.seconds >= 0


@pytest.mark.parametrize(("state", "error"), [("pending", "timed out"), ("failed", "failed")])
def test_a_nixl_read_that_hangs_or_fails_ends_the_pull(monkeypatch, state, error):
    """Fails for: a READ polled past transfer_timeout, or a failed READ taken as done."""
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "nixl")
        object.__setattr__(consumer.config, "transfer_timeout", 0.5)
        monkeypatch.setattr(consumer.nixl, "poll", lambda handle: state)
        result = pull(producer, consumer, "stuck")
        assert not result.ok and f"NIXL READ from prefill-a {error}" in result.error


def test_a_peer_restarted_at_the_same_address_is_handshaken_again():
    """Fails for: the old peer's channel (and NIXL metadata) reused for a new engine."""
    from pagefleet.fleet.up import free_port

    port = free_port()
    with ExitStack() as stack:
        _, consumer = connectors(stack, "nixl")
        for engine_id in ("first", "second"):
            pool = make_pool(3)
            config = KVTransferConfig(kv_connector="nixl", kv_role="kv_producer", kv_port=port)
            producer = connector(config, pool, engine_id)
            try:
                result = pull(producer, consumer, f"req-{engine_id}")
                assert result.ok and result.path == "nixl", result.error
                assert_blocks_equal(producer, consumer)
                # The old engine's channel and NIXL peer were dropped, not kept beside.
                assert len(consumer._peers) == 1 and len(consumer.nixl._peers) == 1
            finally:
                producer.close()


def test_a_fresh_connector_has_no_transfers_and_only_a_producer_listens():
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "tcp")
        assert consumer.stats == TransferStats() and producer.stats == TransferStats()
        assert consumer.port == 0 and consumer.server is None and producer.port > 0
        consumer.wait_for_results(0.01)  # nothing pending: returns
        assert consumer.finished_loads() == []


def test_the_service_binds_the_configured_address_and_port():
    """Fails for: kv_bind_host/kv_ip or kv_port not passed to the service (it would listen on
    127.0.0.1 and a random port, not where peers are told to come)."""
    from pagefleet.fleet.up import free_port

    port = free_port("127.0.0.2")
    pool = make_pool(1)
    config = KVTransferConfig(
        kv_connector="tcp", kv_role="kv_producer", kv_ip="127.0.0.2", kv_port=port
    )
    with ExitStack() as stack:
        producer = connector(config, pool, "prefill-a")
        stack.callback(producer.close)
        _, consumer = connectors(stack, "tcp")
        assert producer.port == port
        assert producer.hold("x", [1], now=0.0)["remote_host"] == "127.0.0.2"
        assert pull(producer, consumer, "bound").ok


@pytest.mark.parametrize(("producer_kind", "consumer_kind"), [("tcp", "nixl"), ("nixl", "tcp")])
def test_a_nixl_engine_and_a_tcp_engine_meet_over_tcp(producer_kind, consumer_kind):
    """A peer without a NIXL agent (or a consumer without one) is read over TCP. Fails for: a
    NIXL read attempted without both agents."""
    with ExitStack() as stack:
        producer, _ = connectors(stack, producer_kind)
        _, consumer = connectors(stack, consumer_kind)
        result = pull(producer, consumer, "mixed")
        assert (result.ok, result.path, result.error) == (True, "tcp", None)
        assert_blocks_equal(producer, consumer)


def test_a_peer_is_handshaken_once_and_each_peer_keeps_its_own_channel(monkeypatch):
    """Fails for: a handshake per pull, or peers confused with each other (one cache key)."""
    calls = []
    handshake = KVTransferClient.handshake

    def counted(self, *args):
        calls.append(self.target)
        return handshake(self, *args)

    monkeypatch.setattr(KVTransferClient, "handshake", counted)
    with ExitStack() as stack:
        a, consumer = connectors(stack, "nixl")
        pool = make_pool(7)
        config = KVTransferConfig(kv_connector="nixl", kv_role="kv_producer", kv_port=0)
        b = connector(config, pool, "prefill-b")
        stack.callback(b.close)
        for producer, rid in ((a, "1"), (a, "2"), (b, "3"), (a, "4"), (b, "5")):
            assert pull(producer, consumer, rid).ok
        assert sorted(calls) == sorted([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])


def test_after_a_failed_pull_the_peer_is_forgotten_and_met_again():
    """A peer that died mid-way is dropped (channel closed, NIXL peer removed); when a new
    engine answers at that address, it is handshaken afresh. Fails for: the failed peer kept
    (its stale NIXL metadata is read from again, or entries pile up)."""
    from pagefleet.fleet.up import free_port

    port = free_port()
    with ExitStack() as stack:
        _, consumer = connectors(stack, "nixl")
        object.__setattr__(consumer.config, "transfer_timeout", 2.0)
        pool = make_pool(3)
        config = KVTransferConfig(kv_connector="nixl", kv_role="kv_producer", kv_port=port)
        first = connector(config, pool, "prefill-x")
        assert pull(first, consumer, "before").ok
        params = first.hold("orphan", REMOTE_BLOCKS, now=time.monotonic())
        first.close()
        consumer.start_load("orphan", RemoteSource.from_params(params), LOCAL_BLOCKS, 0)
        consumer.wait_for_results(30)
        (failed,) = consumer.finished_loads()
        assert failed.ok is False
        assert consumer._peers == {} and consumer.nixl._peers == {}
        second = KVConnector(config, make_pool(4), compat_of(pool), "prefill-y", fleet_secret())
        stack.callback(second.close)
        assert pull(second, consumer, "after").path == "nixl"
        assert_blocks_equal(second, consumer)
        assert len(consumer._peers) == 1 and len(consumer.nixl._peers) == 1


def test_failures_are_logged_with_the_request_and_the_reason(caplog):
    """Operators find a fallback's cause in the log. Fails for: messages without the request
    id or the error, the wrong level, a traceback missing for an unexpected error, a grant
    (a capability to the peer's blocks) in a log line."""
    import logging

    caplog.set_level(logging.INFO, logger="pagefleet.engine")
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "tcp")
        params = producer.hold("gone", REMOTE_BLOCKS, now=0.0)
        producer.due_releases(time.monotonic())  # expired: the pull will be refused
        consumer.start_load("gone", RemoteSource.from_params(params), LOCAL_BLOCKS, 0)
        consumer.wait_for_results(20)
        (result,) = consumer.finished_loads()
        warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
        assert warning.getMessage() == (
            f"KV pull for gone failed, computing locally: {result.error}"
        )

        def broken(*args):
            raise RuntimeError("boom")

        consumer._pull = broken
        pull(producer, consumer, "boom")
        error = next(r for r in caplog.records if r.levelno == logging.ERROR)
        assert error.getMessage() == "KV pull for boom failed" and error.exc_info
        dead = RemoteSource("p", "127.0.0.1", 1, (1,), "grant-of-lost")
        consumer.start_load("lost", dead, LOCAL_BLOCKS, 0)  # too few ids: released at once
        released = "release of a grant on 127.0.0.1 failed: "
        deadline = time.monotonic() + 20
        while not any(r.getMessage().startswith(released) for r in caplog.records):
            assert time.monotonic() < deadline, "the failed release was not logged"
            time.sleep(0.02)
        info = next(r for r in caplog.records if r.getMessage().startswith(released))
        assert info.levelno == logging.INFO
        assert "127.0.0.1:1" in info.getMessage()  # the error itself, naming the peer
        grants = ("grant-of-lost", params["remote_request_id"])
        assert not any(g in r.getMessage() for r in caplog.records for g in grants)


def test_close_finishes_every_pull_already_started():
    """Each started pull ends in a result even when the engine shuts down: more pulls than
    workers, then close. Fails for: close not waiting, or queued pulls cancelled."""
    with ExitStack() as stack:
        producer, consumer = connectors(stack, "tcp")
        for i in range(12):
            params = producer.hold(f"q{i}", REMOTE_BLOCKS, now=time.monotonic())
            consumer.start_load(f"q{i}", RemoteSource.from_params(params), LOCAL_BLOCKS, 0)
        consumer.close()
        results = consumer.finished_loads()
        assert sorted(r.request_id for r in results) == sorted(f"q{i}" for i in range(12))
        assert all(r.ok for r in results)


def test_a_peer_that_never_answers_the_handshake_ends_the_pull():
    """The handshake is bounded by transfer_timeout like the data. Fails for: a client built
    without a timeout (the pull, and its request, would wait forever)."""
    from test_pd import black_hole

    with ExitStack() as stack:
        _, consumer = connectors(stack, "tcp")
        object.__setattr__(consumer.config, "transfer_timeout", 1.0)
        port = stack.enter_context(black_hole())
        source = RemoteSource("p", "127.0.0.1", port, tuple(REMOTE_BLOCKS), "hung")
        consumer.start_load("hung", source, LOCAL_BLOCKS, 0)
        # 15 s: well past the 1 s timeout even on a loaded machine, well short of gRPC's own
        # 20 s connection deadline (which ends an unbounded handshake eventually).
        consumer.wait_for_results(15)
        (result,) = consumer.finished_loads()
        assert result.ok is False and "timed out" in result.error
