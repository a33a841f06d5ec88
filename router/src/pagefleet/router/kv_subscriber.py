"""Follows one pod's KV-event stream (ZMQ SUB), replaying gaps, for the precise prefix index.

Works against pagefleet engines and stock vLLM pods alike (see pagefleet.common.kv_events). A
sequence number that goes backwards means the publisher restarted: the pod is purged first.
With the fleet's CurveZMQ keys (`curve`), it connects as the fleet's subscriber to engines
that encrypt their events; without, in plain text (stock vLLM).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from urllib.parse import urlparse

from pagefleet.common.fleet_auth import CurveKeys
from pagefleet.common.kv_events import (
    END_OF_REPLAY,
    KVEvent,
    decode_batch,
    seq_bytes,
    seq_from_bytes,
)

logger = logging.getLogger("pagefleet.router")


class KVEventSubscriber:
    def __init__(
        self,
        pod: str,
        endpoint: str,
        on_events: Callable[[str, list[KVEvent]], None],
        on_reset: Callable[[str], None],
        replay_endpoint: str | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        import zmq

        self.pod = pod
        self.on_events, self.on_reset = on_events, on_reset
        self.last_seq = -1
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        _curve_client(self._sub, curve)
        # Every topic: vLLM's default topic differs from ours; the frames are the same.
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay = None
        if replay_endpoint:
            # DEALER, not REQ: a replay answers with many messages.
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            _curve_client(self._replay, curve)
            self._replay.connect(replay_endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sub-{pod}", daemon=True)

    def start(self, catch_up_ms: int = 0) -> KVEventSubscriber:
        """Start following; first replay what the publisher still buffers (a router joining
        late), on this thread, before the follower thread owns the sockets."""
        if catch_up_ms and self._replay is not None:
            self._fetch_replay(0, None, catch_up_ms)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll_once()
            except Exception as e:  # keep following the pod whatever one batch did
                logger.warning("pod %s: KV event subscriber error: %r", self.pod, e)

    def _poll_once(self) -> None:
        if not self._sub.poll(50):
            return
        _, raw_seq, payload = self._sub.recv_multipart()
        seq = seq_from_bytes(raw_seq)
        if seq <= self.last_seq:
            logger.info("pod %s: KV event sequence restarted; purging it", self.pod)
            self.on_reset(self.pod)
            self.last_seq = -1
        elif self.last_seq >= 0 and seq > self.last_seq + 1 and self._replay is not None:
            self._fetch_replay(self.last_seq + 1, seq - 1, 500)
        self._deliver(seq, payload)

    def _fetch_replay(self, start: int, end: int | None, timeout_ms: int) -> None:
        self._replay.send_multipart([b"", seq_bytes(start)])
        while self._replay.poll(timeout_ms):
            frames = self._replay.recv_multipart()
            seq, payload = seq_from_bytes(frames[-2]), frames[-1]
            if seq == END_OF_REPLAY or not payload:
                return
            if seq > self.last_seq and (end is None or seq <= end):
                self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            _, events = decode_batch(payload)
        except Exception as e:  # a malformed batch must not kill the subscriber
            logger.warning("pod %s: undecodable KV event batch %d: %r", self.pod, seq, e)
            return
        self.last_seq = max(self.last_seq, seq)
        self.on_events(self.pod, events)


def _curve_client(socket, keys: CurveKeys | None) -> None:
    if keys is not None:
        socket.curve_serverkey = keys.server_public
        socket.curve_publickey = keys.client_public
        socket.curve_secretkey = keys.client_secret


class SubscriberSet:
    """One subscriber per discovered pod, at tcp://<pod host>:<port> (replay on port + 1),
    started and stopped as discovery adds and removes pods (off the caller's thread: a start
    waits for the replay catch-up, a stop for the thread)."""

    def __init__(
        self,
        port: int,
        on_events: Callable[[str, list[KVEvent]], None],
        on_reset: Callable[[str], None],
        curve: CurveKeys | None = None,
    ) -> None:
        self.port, self.on_events, self.on_reset = port, on_events, on_reset
        self.curve = curve
        self._subs: dict[str, KVEventSubscriber] = {}
        self._lock = threading.Lock()

    def sync(self, pods) -> None:
        wanted = {p.name: urlparse(p.url).hostname for p in pods}
        threading.Thread(target=self._apply, args=(wanted,), daemon=True).start()

    def _apply(self, wanted: dict[str, str]) -> None:
        with self._lock:
            for name in [n for n in self._subs if n not in wanted]:
                self._subs.pop(name).stop()
            for name, host in wanted.items():
                if name not in self._subs:
                    endpoint = f"tcp://{host}:{self.port}"
                    replay = f"tcp://{host}:{self.port + 1}"
                    sub = KVEventSubscriber(
                        name, endpoint, self.on_events, self.on_reset, replay, self.curve
                    )
                    self._subs[name] = sub.start(catch_up_ms=200)

    @property
    def pods(self) -> set[str]:
        with self._lock:
            return set(self._subs)

    def stop(self) -> None:
        with self._lock:
            for sub in self._subs.values():
                sub.stop()
            self._subs.clear()
