"""A KV-event eavesdropper (issue 14, finding 4): anyone who could connect to an engine's event
port rebuilt a victim's prompt, password included, from `BlockStored` token ids. Now the
events of a fleet with a secret travel over CurveZMQ with keys derived from it (a subscriber
without them gets nothing), and carry block hashes only, which is all the router's precise
index needs."""

from __future__ import annotations

import json
import time

import httpx
import zmq

from pagefleet.common.fleet_auth import FleetSecret, curve_keys
from pagefleet.common.kv_events import BlockStored, decode_batch
from pagefleet.common.tokenizer import load_tokenizer
from server_utils import free_port_pair, running_server

SECRET = "security-test-fleet-secret-0123456789"
VICTIM = "Remember my password: hunter2-correct-horse. " * 6


def subscriber(context: zmq.Context, endpoint: str, secret: str | None) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        keys = curve_keys(FleetSecret(secret.encode()))
        sub.curve_serverkey = keys.server_public
        sub.curve_publickey = keys.client_public
        sub.curve_secretkey = keys.client_secret
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def stored_tokens(sub: zmq.Socket, timeout_ms: int) -> list[list[int]] | None:
    """Token ids of the BlockStored events in the next batch, or None if none came."""
    if not sub.poll(timeout_ms):
        return None
    _, _, payload = sub.recv_multipart()
    _, events = decode_batch(payload)
    return [e.token_ids for e in events if isinstance(e, BlockStored)]


def test_an_eavesdropper_cannot_rebuild_a_prompt_from_kv_events(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint}
    tokenizer = load_tokenizer(path)
    context = zmq.Context()
    with running_server(
        path,
        "--kv-events-config",
        json.dumps(config),
        env={"PAGEFLEET_FLEET_SECRET": SECRET},
    ) as (base, _):
        spy = subscriber(context, endpoint, None)
        router = subscriber(context, endpoint, SECRET)
        try:
            deadline = time.monotonic() + 60
            hashed, attempt = False, 0
            while not hashed:  # until the fleet's own subscriber sees the victim's blocks
                attempt += 1  # a new prompt each time: a cached one stores no new block
                r = httpx.post(
                    f"{base}/v1/completions",
                    json={"model": "tiny", "prompt": f"{attempt}. {VICTIM}", "max_tokens": 1},
                    timeout=60,
                )
                assert r.status_code == 200, r.text
                for sub in (spy, router):
                    while (tokens := stored_tokens(sub, 200)) is not None:
                        leaked = tokenizer.decode([t for block in tokens for t in block])
                        assert "hunter2" not in leaked, f"KV events leaked: {leaked!r}"
                        hashed |= sub is router and bool(tokens)
                assert time.monotonic() < deadline, "the fleet's subscriber got no events"
        finally:
            spy.close()
            router.close()
            context.term()
