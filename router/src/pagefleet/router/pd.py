"""Disaggregated prefill/decode from the router's side: decide, run the prefill, hand off.

The decode pod is picked first (prefix affinity + load among decode pods). Only if the part of
the prompt that pod does not cache is long enough is the request worth a prefill pod; then the
prefill pod computes the prompt (`do_remote_decode`, one token), holds its blocks and answers
with `kv_transfer_params`, which the decode pod uses to pull them. Every failure on the way
leaves the decode pod to prefill by itself; a prefill whose answer is never used is released.

`kv_transfer_params` is fleet-internal: the router refuses it from clients, and signs its own
(fleet secret, request id, expiry) for the engines, which refuse it unsigned. Releases go over
the KV-transfer service, authenticated with the same secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

import httpx

from pagefleet.common.fleet_auth import SIGNATURE_HEADER, FieldSigner, FleetSecret
from pagefleet.common.http_errors import APIError
from pagefleet.common.kv_errors import TransferError
from pagefleet.common.kv_peer import PeerSession
from pagefleet.router.upstream import engine_gone

logger = logging.getLogger("pagefleet.router")
FLEET_FIELDS = ("kv_transfer_params",)


def refuse_fleet_fields(body: dict) -> None:
    """403 for a client that sets what only the router may set."""
    for name in FLEET_FIELDS:
        if body.get(name) is not None:
            raise APIError(
                403,
                f"{name} is set by the router only (disaggregated prefill/decode)",
                "permission_error",
                name,
            )


def signed_headers(headers: dict, body: dict, signer: FieldSigner) -> dict:
    """The headers of an engine request carrying fleet fields: an X-Request-Id (the client's,
    or a fresh one) and the router's signature over it, the fields and an expiry."""
    out = dict(headers)
    request_id = out.setdefault("x-request-id", uuid.uuid4().hex)
    out[SIGNATURE_HEADER] = signer.sign(request_id, body["kv_transfer_params"], time.time())
    return out


def should_disaggregate(
    prompt_blocks: int, cached_blocks: int, block_size: int, threshold_tokens: int
) -> bool:
    """Worth a prefill pod: the prompt's part not cached on the decode pod is long enough."""
    return (prompt_blocks - cached_blocks) * block_size >= threshold_tokens


def prefill_body(body: dict) -> dict:
    """The request as the prefill pod sees it: one token, no stream, blocks held for decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    return {**body, "kv_transfer_params": kv_transfer_params}


@dataclass
class PrefillResult:
    kv_transfer_params: dict | None
    error: str | None = None
    gone: bool = False  # the prefill pod's connection failed (see upstream.engine_gone)


async def run_prefill(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: dict,
    headers: dict,
    timeout: float,
    signer: FieldSigner,
) -> PrefillResult:
    """POST the prefill request; any failure is a result (the decode pod then prefills)."""
    prefill = prefill_body(body)
    try:
        r = await client.post(
            f"{url}{path}",
            content=json.dumps(prefill),
            headers=signed_headers(headers, prefill, signer),
            timeout=timeout,
        )
    except httpx.HTTPError as e:
        return PrefillResult(None, f"prefill at {url} failed: {e!r}", engine_gone(e))
    if r.status_code != 200:
        return PrefillResult(None, f"prefill at {url}: HTTP {r.status_code}: {r.text[:200]}")
    try:
        params = r.json().get("kv_transfer_params")
    except ValueError:
        params = None
    if not isinstance(params, dict) or "remote_block_ids" not in params:
        return PrefillResult(None, f"prefill at {url} returned no kv_transfer_params")
    return PrefillResult(params)


def release_prefill(params: dict, secret: FleetSecret) -> None:
    """Free a prefill pod's held blocks whose decode never came (client left, decode failed
    before reading). Blocking gRPC: call it in a thread."""
    try:
        host, port = params["remote_host"], int(params["remote_port"])
        with PeerSession(host, port, 2.0, secret=secret) as client:
            client.authenticate_to_release("router", str(params["remote_engine_id"]))
            client.release(str(params["remote_request_id"]))
    except (TransferError, KeyError, ValueError) as e:
        logger.info("could not release prefill blocks on %s: %s", params.get("remote_host"), e)


async def release_prefill_soon(params: dict, secret: FleetSecret) -> None:
    with contextlib.suppress(Exception):
        await asyncio.to_thread(release_prefill, params, secret)
