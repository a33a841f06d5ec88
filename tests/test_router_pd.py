"""router/pd.py in one process: the prefill request as the prefill pod sees it, what
`run_prefill` makes of every kind of answer (through httpx's mock transport), and the release
of a hold through a real KV transfer service (the router's side of the fleet secret: the
prefill request signed, the release authenticated)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from test_kv_transfer_service import DictHeld, make_pool, serving

from pagefleet.fleet_auth import SIGNATURE_HEADER, FieldSigner
from pagefleet.router.pd import (
    PrefillResult,
    decode_body,
    prefill_body,
    release_prefill,
    release_prefill_soon,
    run_prefill,
    should_disaggregate,
)
from server_utils import fleet_secret

PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "p",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "remote_block_ids": [0, 1],
    "remote_request_id": "r",
}
BODY = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {}, "n": 2}


def prefill_with(handler, body: dict = BODY, timeout: float = 7.0) -> PrefillResult:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            headers = {"content-type": "application/json"}
            signer = FieldSigner(fleet_secret())
            path = "/v1/completions"
            return await run_prefill(client, "http://p", path, body, headers, timeout, signer)

    return asyncio.run(go())


def test_the_threshold_counts_uncached_tokens_inclusively():
    """Fails for: `>=` turned into `>`, cached blocks added instead of subtracted, the block
    size left out."""
    assert should_disaggregate(4, 0, 16, 64)  # exactly the threshold
    assert not should_disaggregate(4, 1, 16, 64)
    assert should_disaggregate(5, 1, 16, 64)
    assert should_disaggregate(0, 0, 16, 0)  # threshold 0: always


def test_the_prefill_pod_gets_one_token_no_stream_and_the_hold_request():
    """Fails for: the client's stream/n/stream_options reaching the prefill pod, max_tokens or
    max_completion_tokens not forced to 1, the body mutated in place."""
    body = {**BODY, "max_completion_tokens": 9, "temperature": 0}
    out = prefill_body(body)
    assert out == {
        "prompt": "x",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert "max_completion_tokens" not in prefill_body(BODY)
    assert body["max_tokens"] == 50 and body["stream"] is True
    assert decode_body(body, PARAMS) == {**body, "kv_transfer_params": PARAMS}


def test_a_prefill_answer_with_its_params_is_handed_on():
    """Fails for: the wrong body posted, the path or timeout dropped, params not returned, the
    prefill request's kv_transfer_params not signed for its request id (the engine refuses
    unsigned ones)."""
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"] = str(request.url)
        seen["body"] = json.loads(request.content)
        seen["timeout"] = request.extensions["timeout"]
        seen["type"] = request.headers["content-type"]
        seen["signature"] = request.headers.get(SIGNATURE_HEADER)
        seen["request_id"] = request.headers.get("x-request-id")
        return httpx.Response(200, json={"kv_transfer_params": PARAMS})

    assert prefill_with(handler) == PrefillResult(PARAMS)
    assert seen["url"] == "http://p/v1/completions"
    assert seen["body"] == prefill_body(BODY)
    assert seen["timeout"]["read"] == 7.0 and seen["type"] == "application/json"
    fields = seen["body"]["kv_transfer_params"]
    FieldSigner(fleet_secret()).verify(seen["signature"], seen["request_id"], fields, time.time())


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (httpx.Response(503, text="busy"), "HTTP 503: busy"),
        (httpx.Response(200, json={"choices": []}), "returned no kv_transfer_params"),
        (httpx.Response(200, json={"kv_transfer_params": "x"}), "no kv_transfer_params"),
        (httpx.Response(200, json={"kv_transfer_params": {"a": 1}}), "no kv_transfer_params"),
        (httpx.Response(200, text="not json"), "no kv_transfer_params"),
    ],
    ids=["5xx", "no params", "params not an object", "no block ids", "not json"],
)
def test_every_unusable_prefill_answer_is_a_failed_result(answer, error):
    """Fails for: a non-200 or malformed answer taken as success (the decode pod would pull
    from nothing), or an exception escaping to the router's handler."""
    result = prefill_with(lambda _: answer)
    assert result.kv_transfer_params is None
    assert error in result.error and "http://p" in result.error


def test_an_unreachable_prefill_pod_is_a_failed_result():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    result = prefill_with(refuse)
    assert result.kv_transfer_params is None and "ConnectError" in result.error


def test_release_frees_the_hold_on_the_prefill_pod():
    """Fails for: release sent to the wrong request or port, or not sent."""
    held = DictHeld({"req-9": [1, 2]})
    with serving(held, make_pool(0)) as (server, _):
        params = {**PARAMS, "remote_engine_id": "prefill-0", "remote_port": server.port}
        params["remote_request_id"] = "req-9"
        asyncio.run(release_prefill_soon(params, fleet_secret()))
        assert held.blocks_of("req-9", "router") is None


@pytest.mark.parametrize(
    "params",
    [{**PARAMS, "remote_port": 1}, {"remote_host": "127.0.0.1"}, {**PARAMS, "remote_port": "x"}],
)
def test_a_release_that_cannot_reach_its_pod_is_logged_not_raised(params):
    """The prefill pod's hold timeout frees the blocks then. Fails for: an exception escaping
    into the request that triggered the release."""
    release_prefill(params, fleet_secret())


def test_a_long_error_answer_is_cut_to_200_characters():
    result = prefill_with(lambda _: httpx.Response(500, text="x" * 300))
    assert result.error == "prefill at http://p: HTTP 500: " + "x" * 200


def test_release_soon_never_raises_into_the_request(caplog):
    """Even for params no release can use (a port of null): the request that triggered the
    release is not the place for its error. The failure is logged with the prefill pod and the
    error, never the grant (`remote_request_id` is a capability to the held blocks).
    Fails for: exceptions escaping release_prefill_soon, a log line without the pod or the
    error, a grant in the log."""
    import logging

    caplog.set_level(logging.INFO, logger="pagefleet.router")
    asyncio.run(release_prefill_soon({**PARAMS, "remote_port": None}, fleet_secret()))
    grant = "grant-r-17-secret"
    release_prefill({**PARAMS, "remote_port": 1, "remote_request_id": grant}, fleet_secret())
    (record,) = [r for r in caplog.records if "127.0.0.1:1" in r.getMessage()]
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith("could not release prefill blocks on 127.0.0.1: ")
    assert all(grant not in r.getMessage() for r in caplog.records)
