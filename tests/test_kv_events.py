"""KV events on the wire: vLLM's encoding, a real engine publishing over ZMQ, a router-side
subscriber building the precise prefix index, replay for late joiners, purge on restart."""

from __future__ import annotations

import time

import msgpack
import pytest

from pagefleet.common.block_hash import hash_blocks
from pagefleet.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.kv_event_publisher import KVEventsConfig, ZmqEventPublisher
from pagefleet.router.kv_subscriber import KVEventSubscriber
from pagefleet.router.prefix_index import PrefixIndex
from server_utils import wait_until


def test_batches_round_trip_and_vllm_payloads_decode():
    events = [
        BlockStored([b"h1", b"h2"], None, [1, 2, 3, 4], 2),
        BlockRemoved([b"h0"]),
        AllBlocksCleared(),
    ]
    assert decode_batch(encode_batch(12.5, events)) == (12.5, events)
    # As a stock vLLM pod sends it: int hashes, the adapter's name (vLLM's lora_name), a
    # trailing field newer than this reader, an unknown event kind.
    vllm = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [7, 8], 6, [1, 2], 1, None, "GPU", "sql", "extra"],
                ["SomethingNew", 1],
                ["BlockRemoved", [7], "GPU"],
            ],
        ]
    )
    ts, decoded = decode_batch(vllm)
    assert ts == 1.0
    stored = BlockStored([7, 8], 6, [1, 2], 1, "GPU", lora_name="sql")
    assert decoded == [stored, BlockRemoved([7], "GPU")]
    # The offload tier's events carry their medium both ways.
    tier = [BlockStored([b"h"], None, [], 16, "CPU"), BlockRemoved([b"h"], "CPU")]
    assert decode_batch(encode_batch(2.0, tier)) == (2.0, tier)


def test_an_odd_medium_neither_crashes_nor_poisons_the_index():
    """Catches events whose medium is unknown (DISK), of the wrong type (5, a map) or a
    megabyte long being indexed as device blocks (full-weight hits the pod does not have on
    its GPU; a BlockRemoved of them evicting the real device entry), and a host tier growing
    the router's memory without bound."""
    index = PrefixIndex(default_capacity=64, host_capacity=8)
    real = [b"a", b"b"]
    index.apply("pod", [BlockStored(real, None, [], 16)])
    odd_mediums = ("DISK", 5, {"x": 1}, "X" * 1_000_000, ["CPU"])
    # Hashes that are maps or lists, before a good event in the same batch.
    batch = [1.0, [["BlockStored", [{"h": 1}, [2]], None, [], 16, None, "CPU"]]]
    for medium in odd_mediums:
        batch[1] += [
            ["BlockStored", [b"ghost"], None, [], 16, None, medium],
            ["BlockRemoved", real, medium],
        ]
    batch[1].append(["BlockStored", [b"after"], None, [], 16, None, "GPU"])
    _, events = decode_batch(msgpack.packb(batch))
    index.apply("pod", events)
    assert index.match([*real], now=0.0) == {"pod": 2}
    assert index.match([b"after"], now=0.0) == {"pod": 1}
    assert index.match([b"ghost"], now=0.0) == {}
    # A lower-case medium from another sender is still the host tier, not the device.
    _, events = decode_batch(
        msgpack.packb([1.0, [["BlockStored", [b"c"], None, [], 16, None, "cpu"]]])
    )
    index.apply("pod", events)
    assert index.match([*real, b"c"], now=0.0) == {"pod": 2.5}
    # A pod's host tier is bounded: the oldest blocks go first.
    hashes = [bytes([i]) * 4 for i in range(40)]
    index.apply("pod", [BlockStored([h], None, [], 16, "CPU") for h in hashes])
    assert index.match(hashes, now=0.0) == {}
    assert index.match(hashes[-8:], now=0.0) == {"pod": 4.0}


def test_kv_events_config_is_validated():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:1"}')
    assert cfg.enable_kv_cache_events and cfg.publisher == "zmq"
    for bad, message in (
        ("{", "not JSON"),
        ('{"nope": 1}', "unknown keys"),
        ('{"publisher": "kafka"}', "zmq or null"),
    ):
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.from_json(bad)


def _wait_joined(publisher, index: PrefixIndex, pod: str = "pod-a") -> None:
    """Until the subscriber receives what the publisher sends (a PUB socket drops messages sent
    before a SUB joins): publish a probe block until it is indexed, then remove it again."""
    probe = b"probe-block"
    deadline = time.monotonic() + 10
    while not index.match([probe], now=0):
        assert time.monotonic() < deadline, "the subscriber never joined"
        publisher.add(BlockStored([probe], None, [0], 1))
        publisher.flush()
        time.sleep(0.02)
    publisher.add(BlockRemoved([probe]))
    publisher.flush()
    wait_until(lambda: not index.match([probe], now=0))


def _subscribe(
    publisher, index: PrefixIndex, pod: str = "pod-a", catch_up_ms: int = 0
) -> KVEventSubscriber:
    return KVEventSubscriber(
        pod,
        publisher.endpoint,
        index.apply,
        index.remove_pod,
        replay_endpoint=publisher.replay_endpoint,
    ).start(catch_up_ms)


@pytest.fixture
def publisher():
    pub = ZmqEventPublisher(
        KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
        )
    )
    yield pub
    pub.shutdown()


def test_router_index_mirrors_a_real_engine_cache(tiny_checkpoints, publisher):
    index = PrefixIndex("precise")
    live = _subscribe(publisher, index)
    _wait_joined(publisher, index)
    llm = LLM(
        tiny_checkpoints["llama"],
        num_gpu_blocks_override=12,
        max_model_len=128,
        kv_event_listener=publisher.add,
    )
    llm.engine.subscribe(publisher)  # flushes each step's events
    prompts = [[i + 1] * 40 + list(range(10)) for i in range(5)]  # evictions in a small pool
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    publisher.flush()
    cached = set(llm.engine.scheduler.kv_cache.pool.cached)
    assert cached
    wait_until(lambda: live.last_seq >= publisher.last_seq > 0)
    assert {h for h in cached if index.match([h], now=0)} == cached
    assert index.num_blocks("pod-a") == len(cached)
    # A router that joins late catches up from the replay buffer.
    late_index = PrefixIndex("precise")
    late = _subscribe(publisher, late_index, "pod-a", catch_up_ms=1000)
    assert late_index.num_blocks("pod-a") == len(cached)
    # Longest-prefix lookups with the shared hash function agree with the engine's cache.
    for prompt in prompts:
        hashes = hash_blocks(prompt, 16)
        leading = next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
        assert index.match(hashes, now=0).get("pod-a", 0) == leading
    live.stop()
    late.stop()


def test_a_restarted_publisher_purges_the_pod(publisher):
    index = PrefixIndex("precise")
    sub = _subscribe(publisher, index)
    _wait_joined(publisher, index)
    for i in range(3):
        publisher.add(BlockStored([bytes([i])], None, [i], 1))
        publisher.flush()
    wait_until(lambda: index.num_blocks("pod-a") == 3)
    port = publisher.endpoint.rsplit(":", 1)[1]
    publisher.shutdown()
    again = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
    )
    try:
        # The new process starts its sequence at 0 with AllBlocksCleared: the pod is purged.
        deadline = time.monotonic() + 10
        while index.num_blocks("pod-a") and time.monotonic() < deadline:
            again.add(BlockRemoved([b"never-stored"]))
            again.flush()
            time.sleep(0.1)
        assert index.num_blocks("pod-a") == 0
    finally:
        sub.stop()
        again.shutdown()


def test_discovered_pods_get_a_subscriber_each_and_lose_it_when_they_go():
    from pagefleet.router.kv_subscriber import SubscriberSet
    from pagefleet.router.scoring import Pod
    from server_utils import free_port_pair

    port = free_port_pair()
    pub = ZmqEventPublisher(
        KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
        )
    )
    index = PrefixIndex("precise")
    subs = SubscriberSet(port, index.apply, index.remove_pod)
    try:
        subs.sync([Pod("engine-0", "http://127.0.0.1:8000")])
        wait_until(lambda: subs.pods == {"engine-0"})
        _wait_joined(pub, index, "engine-0")
        pub.add(BlockStored([b"h1", b"h2"], None, [1, 2], 1))
        pub.flush()
        wait_until(lambda: index.num_blocks("engine-0") == 2)
        subs.sync([])
        wait_until(lambda: not subs.pods)
    finally:
        subs.stop()
        pub.shutdown()
