"""Disaggregated prefill/decode from the router's side: decide, run the prefill, hand off.

The decode pod is picked first (prefix affinity + load among decode pods). Only if the part of
the prompt that pod does not cache is long enough is the request worth a prefill pod; then the
prefill pod computes the prompt (`do_remote_decode`, one token), holds its blocks and answers
with `kv_transfer_params`, which the decode pod uses to pull them. Every failure on the way
leaves the decode pod to prefill by itself; a prefill whose answer is never used is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

import httpx

logger = logging.getLogger("pagefleet.router")


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


async def run_prefill(
    client: httpx.AsyncClient, url: str, path: str, body: dict, headers: dict, timeout: float
) -> PrefillResult:
    """POST the prefill request; any failure is a result (the decode pod then prefills)."""
    try:
        r = await client.post(
            f"{url}{path}",
            content=json.dumps(prefill_body(body)),
            headers=headers,
            timeout=timeout,
        )
    except httpx.HTTPError as e:
        return PrefillResult(None, f"prefill at {url} failed: {e!r}")
    if r.status_code != 200:
        return PrefillResult(None, f"prefill at {url}: HTTP {r.status_code}: {r.text[:200]}")
    try:
        params = r.json().get("kv_transfer_params")
    except ValueError:
        params = None
    if not isinstance(params, dict) or "remote_block_ids" not in params:
        return PrefillResult(None, f"prefill at {url} returned no kv_transfer_params")
    return PrefillResult(params)


def release_prefill(params: dict) -> None:
    """Free a prefill pod's held blocks whose decode never came (client left, decode failed
    before reading). Blocking gRPC: call it in a thread."""
    from pagefleet.engine.kv_transfer.errors import TransferError
    from pagefleet.engine.kv_transfer.service import KVTransferClient

    try:
        with KVTransferClient(params["remote_host"], int(params["remote_port"]), 2.0) as c:
            c.release(str(params["remote_request_id"]))
    except (TransferError, KeyError, ValueError) as e:
        logger.info("could not release prefill blocks %s: %s", params.get("remote_request_id"), e)


async def release_prefill_soon(params: dict) -> None:
    with contextlib.suppress(Exception):
        await asyncio.to_thread(release_prefill, params)
