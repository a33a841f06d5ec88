"""Publishes the engine's KV-cache events over ZMQ in vLLM's shape (see pagefleet.common.kv_events).

Events are collected on the engine thread during a step and handed, one batch per step, to a
publisher thread that owns the sockets, so a slow network never slows a step. The first batch
after start is `AllBlocksCleared`: a router that knew this pod before a restart purges it.

Events say which prompts a pod caches, so they are for the fleet only: with a fleet secret both
sockets speak CurveZMQ with keys derived from it (encrypted; only subscribers holding the
fleet's client key are let in), and `BlockStored` carries no token ids unless
`include_token_ids` asks for them (vLLM consumers that rebuild hashes need them).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from pagefleet.common.fleet_auth import CurveKeys, FleetSecret, curve_keys
from pagefleet.common.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    KVEvent,
    encode_batch,
    seq_bytes,
    seq_from_bytes,
)
from pagefleet.engine.client import EngineObserver, StepStats
from pagefleet.engine.json_flag import parse_json_object


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` JSON."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    topic: str = "kv-events"
    include_token_ids: bool = False  # pagefleet: the prompt's tokens on the wire (vLLM: yes)
    curve: bool = True  # pagefleet: CurveZMQ when the engine has a fleet secret

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        raw = parse_json_object("--kv-events-config", text, (f.name for f in fields(cls)))
        config = cls(**raw)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r}: zmq or null")
        if config.buffer_steps < 1:
            raise ValueError("--kv-events-config: buffer_steps must be >= 1")
        return config


class _FleetSubscribers:
    """ZAP credentials: only the fleet's subscriber key may connect."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def _curve_server(socket, keys: CurveKeys) -> None:
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    socket.curve_server = True


class ZmqEventPublisher(EngineObserver):
    """Publishes the KV events of each engine step as one batch: `add` is the KV cache's
    listener, and as an engine observer it flushes at the end of every step."""

    def __init__(self, config: KVEventsConfig, secret: FleetSecret | None = None) -> None:
        import zmq

        self.config = config
        self._context = zmq.Context()
        self._authenticator = None
        keys = curve_keys(secret) if secret is not None and config.curve else None
        if keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(self._context)
            self._authenticator.start()
            self._authenticator.configure_curve_callback("*", _FleetSubscribers(keys.client_public))
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            _curve_server(self._pub, keys)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                _curve_server(self._replay, keys)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._pending: list[KVEvent] = [AllBlocksCleared()]
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self.flush()

    @property
    def endpoint(self) -> str:
        """The bound address (with the real port when the config said `*`)."""
        import zmq

        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        import zmq

        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None

    @property
    def last_seq(self) -> int:
        return self._seq

    def add(self, event: KVEvent) -> None:
        """The KV-cache listener: called on the engine thread."""
        self._pending.append(event)

    def on_step(self, stats: StepStats) -> None:
        self.flush()

    def flush(self) -> None:
        """End of a step: publish what it emitted as one batch (engine thread)."""
        if self._pending:
            events, self._pending = self._pending, []
            self._batches.put((time.time(), events))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.destroy(linger=0)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ts, events = self._batches.get(timeout=0.01)
            except queue.Empty:
                pass
            else:
                self._seq += 1
                payload = encode_batch(ts, events, self.config.include_token_ids)
                self._pub.send_multipart([self._topic, seq_bytes(self._seq), payload])
                self._buffer.append((self._seq, payload))
            if self._replay is not None and poller.poll(0):
                self._answer_replay()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, start = frames[0], seq_from_bytes(frames[-1])
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([identity, b"", seq_bytes(seq), payload])
        self._replay.send_multipart([identity, b"", seq_bytes(END_OF_REPLAY), b""])
