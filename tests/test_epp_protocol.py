"""`pagefleet epp`'s ext_proc handling in-process (router/epp.py, router/ext_proc.py): the
Endpoint Picker Protocol's answers, and what a hostile or broken peer can send (no body,
non-JSON, huge headers, an oversized body, an unknown model, fleet fields, a client's own
routing headers), each refused with the status the router gives, before any engine is chosen.
The Envoy process around it is in test_epp_envoy.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from google.protobuf import struct_pb2

from pagefleet.common.fleet_auth import SIGNATURE_HEADER, FieldSigner
from pagefleet.proto import envoy_ext_proc_pb2 as pb
from pagefleet.proto import envoy_processing_mode_pb2 as mode
from pagefleet.proto import grpc_health_pb2 as health_pb
from pagefleet.router.core import Router, RouterConfig, release_loop
from pagefleet.router.epp import EndpointPicker, Exchange, Health
from pagefleet.router.ext_proc import (
    DESTINATION_HEADER,
    EXT_PROC_FILTER,
    MAX_HEADERS,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    header_map,
)
from pagefleet.router.flow_control import FlowConfig
from pagefleet.router.pods import PodRegistry
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scoring import Pipeline, Pod
from server_utils import fleet_secret

A, B = "10.0.0.1:8000", "10.0.0.2:8000"  # "a" is preferred on load: no tie-break involved
BODY = json.dumps({"model": "tiny", "prompt": "a prompt of a few routing blocks " * 8}).encode()
MODES = {
    "full_duplex": mode.ProcessingMode.FULL_DUPLEX_STREAMED,
    "buffered": mode.ProcessingMode.BUFFERED,
}


def picker(pods=(A, B), client=None, **config) -> EndpointPicker:
    registry = PodRegistry()
    registry.set_pods([Pod(e, f"http://{e}", role=r) for e, r in _roles(pods)])
    for status in registry.status.values():
        status.scraped_at = 0.0  # fresh at the router's clock
        status.ready = True  # as after a good scrape
    if B in registry.status:
        registry.status[B].pod.waiting = 5.0
    config.setdefault("flow", FlowConfig(queue_size=0))
    router = Router(
        registry,
        PrefixIndex("approximate"),
        Pipeline.from_config({"scorers": {"queue": 1.0}}),
        RouterConfig(**config),
        clock=lambda: 0.0,
    )
    return EndpointPicker(router, client or httpx.AsyncClient(), fallbacks=1)


def _roles(pods):
    for p in pods:
        endpoint, _, role = p.partition("@")
        yield endpoint, role or "both"


def headers_message(
    *extra: tuple[str, str], body_mode=mode.ProcessingMode.FULL_DUPLEX_STREAMED, eos=False
) -> pb.ProcessingRequest:
    headers = [(":method", "POST"), (":path", "/v1/completions"), *extra]
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=eos)
    )
    message.protocol_config.request_body_mode = body_mode
    message.protocol_config.response_body_mode = body_mode
    return message


def body_message(body: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=eos))


def run(picker: EndpointPicker, *messages) -> tuple[Exchange, list[pb.ProcessingResponse]]:
    async def go():
        exchange = Exchange(picker)
        out = []
        for message in messages:
            out += await exchange.receive(message)
            if exchange.closed:  # as EndpointPicker.Process ends the stream
                break
        return exchange, out

    return asyncio.run(go())


def mutation(response: pb.ProcessingResponse) -> dict[str, str]:
    kind = response.WhichOneof("response")
    common = getattr(response, kind).response
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


def immediate_of(out: list[pb.ProcessingResponse]) -> tuple[int, dict, dict]:
    (response,) = out
    reply = response.immediate_response
    headers = {o.header.key: o.header.raw_value.decode() for o in reply.headers.set_headers}
    return reply.status.code, headers, json.loads(reply.body)


@pytest.mark.parametrize("body_mode", MODES)
def test_the_pick_goes_out_in_the_header_and_the_metadata_and_the_body_unchanged(body_mode):
    """Full duplex: nothing until the whole body is in, then the headers answer routes and the
    body comes back byte for byte (last chunk ends the stream). Buffered: the headers pass, the
    body's answer routes. Header and metadata carry the same ordered list, overwriting what a
    client sent, and the route cache is cleared so routes see the header."""
    epp = picker()
    half = len(BODY) // 2
    forged = (DESTINATION_HEADER, "10.9.9.9:1")
    exchange, out = run(
        epp,
        headers_message(forged, body_mode=MODES[body_mode]),
        # Buffered: the whole body in one message; full duplex: chunks as they come.
        *(
            [body_message(BODY[:half], eos=False), body_message(BODY[half:])]
            if body_mode == "full_duplex"
            else [body_message(BODY)]
        ),
    )
    if body_mode == "full_duplex":
        routed, *chunks = out
        streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
        assert b"".join(s.body for s in streamed) == BODY
        assert [s.end_of_stream for s in streamed][-1] is True
    else:
        passed, routed = out
        assert passed.WhichOneof("response") == "request_headers"
        assert not passed.request_headers.response.HasField("header_mutation")
        assert not routed.request_body.response.HasField("body_mutation")
    assert mutation(routed)[DESTINATION_HEADER] == f"{A},{B}"
    overwrite = routed.WhichOneof("response")
    options = getattr(routed, overwrite).response.header_mutation.set_headers
    assert all(o.append_action == o.OVERWRITE_IF_EXISTS_OR_ADD for o in options)
    assert getattr(routed, overwrite).response.clear_route_cache
    assert routed.dynamic_metadata["envoy.lb"][DESTINATION_HEADER] == f"{A},{B}"
    assert SIGNATURE_HEADER in getattr(routed, overwrite).response.header_mutation.remove_headers
    assert exchange.attempt.pod_name == A and exchange.attempt.candidate.pod.inflight == 1


HOSTILE = {
    "no body": (headers_message(), body_message(b""), 400, "malformed JSON"),
    "not JSON": (headers_message(), body_message(b"{nope"), 400, "malformed JSON"),
    "not an object": (headers_message(), body_message(b"[1, 2]"), 400, "JSON object"),
    "a lone surrogate": (
        headers_message(),
        body_message(json.dumps({"prompt": "\ud800 x"}).encode()),
        400,
        "invalid request body",
    ),
    "too many headers": (
        headers_message(*[(f"x-h{i}", "v") for i in range(MAX_HEADERS)]),
        body_message(BODY),
        431,
        "headers",
    ),
    "huge headers": (
        headers_message(("x-big", "v" * 200_000)),
        body_message(BODY),
        431,
        "headers",
    ),
    "declared oversize": (
        headers_message(("content-length", str(10**9))),
        body_message(BODY),
        413,
        "larger than",
    ),
    "streamed oversize": (
        headers_message(),
        body_message(b"x" * 3000, eos=False),
        413,
        "larger than",
    ),
    "unknown model": (
        headers_message(),
        body_message(json.dumps({"model": "other", "prompt": "hi"}).encode()),
        404,
        "does not exist",
    ),
    "fleet fields": (
        headers_message(),
        body_message(json.dumps({"prompt": "hi", "kv_transfer_params": {"x": 1}}).encode()),
        403,
        "router only",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_requests_are_refused_before_any_pod_is_chosen(case):
    """Each refusal is the OpenAI-shaped JSON error the router gives, as an ImmediateResponse
    (the proxy answers the client; no engine sees the request), and the stream ends. Fails
    if a bound is missing (an exception, a pick) or a peer's bytes reach the decision."""
    first, second, status, words = HOSTILE[case]
    epp = picker(model="tiny", max_body_bytes=2048)
    exchange, out = run(epp, first, second)
    code, headers, body = immediate_of(out[-1:])
    assert code == status and words in body["error"]["message"]
    assert body["error"]["code"] == status and headers["content-type"] == "application/json"
    assert exchange.closed and exchange.attempt is None
    assert all(s.pod.inflight == 0 for s in epp.router.registry.status.values())


def test_the_api_key_is_checked_and_the_engines_get_the_routers_key_not_the_clients():
    epp = picker(api_key="client-key", upstream_api_key="engine-key")
    _, out = run(epp, headers_message(), body_message(BODY))
    assert immediate_of(out)[0] == 401
    _, out = run(
        picker(api_key="client-key", upstream_api_key="engine-key"),
        headers_message(("authorization", "Bearer client-key")),
        body_message(BODY),
    )
    assert mutation(out[0])["authorization"] == "Bearer engine-key"


def subset(message: pb.ProcessingRequest, value) -> pb.ProcessingRequest:
    hint = struct_pb2.Struct()
    hint.update({SUBSET_KEY: value})
    message.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return message


@pytest.mark.parametrize("hint", [[B], B, f"{B}, 10.7.7.7:80"])
def test_the_subset_hint_restricts_the_pick(hint):
    """The protocol's subset (a list, or a comma-separated string as a gateway's
    header-to-metadata filter writes it): only its endpoints, though "a" scores better."""
    _, out = run(picker(), subset(headers_message(), hint), body_message(BODY))
    assert mutation(out[0])[DESTINATION_HEADER] == B


def test_a_subset_naming_no_ready_endpoint_is_a_503_with_retry_after():
    _, out = run(picker(), subset(headers_message(), ["10.7.7.7:80"]), body_message(BODY))
    status, headers, _ = immediate_of(out)
    assert status == 503 and headers["retry-after"] == "1"


def test_no_engine_without_a_queue_is_a_503_and_with_one_the_request_is_held_until_one_comes():
    _, out = run(picker(pods=()), headers_message(), body_message(BODY))
    assert immediate_of(out)[0] == 503

    async def held():
        epp = picker(pods=(), flow=FlowConfig(queue_size=4, queue_timeout=30))
        epp.router.registry.interval = 0.01
        releaser = asyncio.ensure_future(release_loop(epp.router))
        exchange = Exchange(epp)
        await exchange.receive(headers_message())
        answer = asyncio.ensure_future(exchange.receive(body_message(BODY)))
        await asyncio.sleep(0.05)
        assert not answer.done() and epp.router.flow.held == 1
        epp.router.registry.set_pods([Pod(A, f"http://{A}")])  # an engine comes up...
        epp.router.registry.status[A].ready = True  # ...and answers its first scrape
        out = await asyncio.wait_for(answer, 10)
        releaser.cancel()
        return out

    out = asyncio.run(held())
    assert mutation(out[0])[DESTINATION_HEADER] == A


def test_a_held_request_past_its_deadline_gets_503_with_retry_after():
    async def held():
        epp = picker(pods=(), flow=FlowConfig(queue_size=4, queue_timeout=0.05))
        epp.router.clock = asyncio.get_running_loop().time
        epp.router.registry.interval = 0.01
        releaser = asyncio.ensure_future(release_loop(epp.router))
        exchange = Exchange(epp)
        await exchange.receive(headers_message())
        out = await asyncio.wait_for(exchange.receive(body_message(BODY)), 10)
        releaser.cancel()
        return out

    status, headers, body = immediate_of(asyncio.run(held()))
    assert status == 503 and headers["retry-after"] == "1" and "in time" in body["error"]["message"]


def response_headers(status: str, served: str | None = None, via_attribute=False):
    message = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=header_map([(":status", status), ("content-type", "text/event-stream")])
        )
    )
    if served and via_attribute:
        attributes = struct_pb2.Struct()
        attributes.update({"upstream.address": served})
        message.attributes[EXT_PROC_FILTER].CopyFrom(attributes)
    elif served:
        lb = struct_pb2.Struct()
        lb.update({SERVED_KEY: served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return message


@pytest.mark.parametrize("via_attribute", [False, True])
def test_a_retry_on_the_fallback_moves_the_books_to_the_pod_that_served(via_attribute):
    """The proxy says B served (the protocol's metadata, or Envoy's upstream.address): A's
    attempt is refused (its load and predicted blocks given back), B's relayed, a retry
    counted; the response streams back untouched and its usage is counted."""
    epp = picker()
    chunks = [
        b'data: {"choices": [{"text": "x"}]}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n',
        b"data: [DONE]\n\n",
    ]
    exchange, out = run(
        epp,
        headers_message(),
        body_message(BODY),
        response_headers("200", B, via_attribute),
        *[
            pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=i == 2))
            for i, c in enumerate(chunks)
        ],
    )
    echoed = [r.response_body.response.body_mutation.streamed_response for r in out[-3:]]
    assert [e.body for e in echoed] == chunks and echoed[-1].end_of_stream
    first, served = exchange.routed.attempts
    assert (first.pod_name, first.outcome.value) == (A, "refused")
    assert (served.pod_name, served.outcome.value) == (B, "relayed")
    status = epp.router.registry.status
    assert status[A].pod.inflight == status[B].pod.inflight == 0
    sample = epp.router.metrics.registry.get_sample_value
    assert sample("pagefleet_router:retries_total") == 1
    # The proxy retries only on a failed connection: A is ejected at once (issue 37).
    assert status[A].ejected and sample("pagefleet_router:ejections_total") == 1
    assert sample("pagefleet_epp:usage_tokens_total", {"kind": "completion"}) == 3


def test_a_stream_the_proxy_drops_settles_the_books():
    """Envoy closes the stream (the client left) before any response: the attempt ends as
    client_left and the pod's in-flight count falls back."""

    async def go(epp):
        async def messages():
            yield headers_message()
            yield body_message(BODY)

        async for _ in epp.Process(messages(), None):
            pass

    epp = picker()
    asyncio.run(go(epp))
    assert epp.router.registry.status[A].pod.inflight == 0


def test_a_disaggregated_request_carries_the_signed_params_in_a_replaced_body():
    """The picker runs the prefill (one token, do_remote_decode) and the decode pod gets the
    prefill's kv_transfer_params in the body Envoy forwards, signed for the request id it
    sends (content length updated); without this no engine would accept the params."""
    params = {"remote_block_ids": [1], "remote_engine_id": "p", "remote_host": "h"}

    def prefill(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["kv_transfer_params"] == {"do_remote_decode": True}
        return httpx.Response(200, json={"kv_transfer_params": params})

    epp = picker(
        pods=(f"{A}@prefill", f"{B}@decode"),
        client=httpx.AsyncClient(transport=httpx.MockTransport(prefill)),
        fleet_secret=fleet_secret(),
        pd_threshold_tokens=0,
    )
    _, out = run(epp, headers_message(("x-request-id", "req-1")), body_message(BODY))
    headers = mutation(out[0])
    sent = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:])
    decode = json.loads(sent)
    assert headers[DESTINATION_HEADER] == B and decode["kv_transfer_params"] == params
    assert headers["content-length"] == str(len(sent)) and headers["x-request-id"] == "req-1"
    FieldSigner(fleet_secret()).verify(
        headers[SIGNATURE_HEADER], "req-1", params, __import__("time").time()
    )


def test_health_names_the_protocols_services():
    async def check(epp, service):
        request = health_pb.HealthCheckRequest(service=service)
        return (await Health(epp.router).Check(request, None)).status

    serving, not_serving = (
        health_pb.HealthCheckResponse.SERVING,
        health_pb.HealthCheckResponse.NOT_SERVING,
    )
    empty = picker(pods=())
    assert asyncio.run(check(empty, "liveness")) == serving
    assert asyncio.run(check(empty, "readiness")) == not_serving
    ext_proc = "envoy.service.ext_proc.v3.ExternalProcessor"
    assert asyncio.run(check(picker(), ext_proc)) == serving
