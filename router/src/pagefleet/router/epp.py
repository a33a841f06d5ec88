"""`pagefleet epp`: the router's picking core as a Gateway API Inference Extension Endpoint
Picker, behind a gateway's Envoy over its ext_proc gRPC stream (`ext_proc.py` holds the
protocol's messages; `core.py` every decision).

One `Exchange` per HTTP request (one gRPC stream). The request: its headers (bounded; the
client's API key checked), its body (bounded: 413 past --max-request-body-bytes), then the
core admits it (parse, hash, rank, hold while no engine can take it, the same 4xx/503 as the
router) and, for a disaggregated fleet, runs the prefill and hands the decode pod the signed
kv_transfer_params in a replaced body. The answer names the pick and its fallbacks (the
`x-gateway-destination-endpoint` header and `envoy.lb` metadata); the proxy connects. The
response: the proxy reports which endpoint served it (so a retry on a fallback moves the books
to that pod), and its body streams back through here untouched, which ends the request's
in-flight count and gives its token usage.

P/D through the gateway: llm-d's picker names a prefill pod in a request header and a sidecar
in the decode pod runs the prefill. pagefleet has no sidecar, and its engines obey only
kv_transfer_params the fleet secret signed; so the picker runs the prefill itself (the router's
code), then hands Envoy the decode body with the prefill's signed params: the secret stays in
the pickers, the engines stay as they are, and a failed prefill degrades to the decode pod
prefilling alone. The cost: the picker's answer waits for the prefill, so the proxy's message
timeout must cover --prefill-timeout (as it must cover the flow-control queue timeout).

Body modes (Envoy's protocol_config): FULL_DUPLEX_STREAMED (what GIE gateways configure: the
whole request is buffered here, then the headers answer and the body are sent back) and
BUFFERED (the headers are let through, the buffered body's answer routes). Modes that pass the
headers on before the body is seen (STREAMED, or no body) are routed on the headers alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
from prometheus_client import Counter

from pagefleet.common.fleet_auth import SIGNATURE_HEADER
from pagefleet.common.http_errors import APIError, bearer_ok
from pagefleet.proto import envoy_ext_proc_pb2 as pb
from pagefleet.proto import envoy_ext_proc_pb2_grpc as pb_grpc
from pagefleet.proto import grpc_health_pb2 as health_pb
from pagefleet.proto import grpc_health_pb2_grpc as health_grpc
from pagefleet.router.core import (
    RETRY_AFTER_S,
    Router,
    admit,
    disaggregate,
    engine_headers,
    wants_prefill,
)
from pagefleet.router.ext_proc import (
    BODY_FIRST,
    FULL_DUPLEX,
    NO_BODY,
    Destination,
    PeerError,
    immediate,
    proceed,
    read_headers,
    routed_buffered_body,
    routed_headers,
    served_endpoint,
    streamed_body,
    subset_hint,
)
from pagefleet.router.flow_control import tenant_of
from pagefleet.router.pd import release_prefill_soon
from pagefleet.router.routed import Attempt, Outcome, RoutedRequest

logger = logging.getLogger("pagefleet.router")
# The Inference Extension's flow-control fairness header: a tenant when ours is absent.
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
USAGE_TAIL_BYTES = 64 * 1024  # of a response, kept to read its token usage from


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service: one Exchange per stream, over the shared core."""

    def __init__(self, router: Router, client: httpx.AsyncClient, fallbacks: int = 0) -> None:
        self.router, self.client, self.fallbacks = router, client, fallbacks
        # Parsing and tokenizing: one thread (the tokenizer and prompt cache are its alone).
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="epp-tokenize")
        self.background: set[asyncio.Task] = set()  # prefill releases in flight
        registry = router.metrics.registry
        self.usage = Counter(
            "pagefleet_epp:usage_tokens",
            "Tokens of the responses that passed, per kind (prompt, completion).",
            ["kind"],
            registry=registry,
        )
        self.refusals = Counter(
            "pagefleet_epp:immediate_responses",
            "Requests answered by the picker instead of routed, per HTTP status.",
            ["status"],
            registry=registry,
        )

    async def Process(self, request_iterator, context):
        exchange = Exchange(self)
        try:
            async for message in request_iterator:
                for response in await exchange.receive(message):
                    yield response
                if exchange.closed:
                    return
        finally:
            exchange.close()

    async def on_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def release_soon(self, params: dict) -> None:
        task = asyncio.ensure_future(release_prefill_soon(params, self.router.config.fleet_secret))
        self.background.add(task)
        task.add_done_callback(self.background.discard)


def _never():
    """The client-left signal for the core: a gateway's client leaving cancels the stream,
    and with it whatever the exchange awaits."""
    return asyncio.get_running_loop().create_future()


class Exchange:
    """One HTTP request as the proxy shows it: the messages it sends, the answers it gets."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker, self.router = picker, picker.router
        self.request_mode = FULL_DUPLEX  # as GIE gateways configure it, until Envoy says
        self.response_mode = FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.subset: set[str] | None = None
        self.body = bytearray()
        self.routed: RoutedRequest | None = None
        self.routed_on_headers = False  # no body to route on (GET, or a headers-first mode)
        self.attempt: Attempt | None = None
        self.status: int | None = None
        self.event_stream = False
        self.tail = bytearray()
        self.response_bytes = 0
        self.closed = False

    async def receive(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(message)
            if kind == "request_body":
                return await self._request_body(message.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
            if kind == "response_headers":
                return self._response_headers(message)
            if kind == "response_body":
                return self._response_body(message.response_body)
            if kind == "response_trailers":
                self._finish(Outcome.RELAYED)
                return [proceed("response_trailers")]
            return []
        except PeerError as e:
            return self._refuse(APIError(e.status, str(e)))
        except APIError as e:
            return self._refuse(e)

    def _refuse(self, error: APIError) -> list[pb.ProcessingResponse]:
        self.closed = True
        self.picker.refusals.labels(str(error.status)).inc()
        return [immediate(error.status, error.message, error.type, error.headers, error.param)]

    # The request.

    async def _request_headers(self, message: pb.ProcessingRequest) -> list:
        if message.HasField("protocol_config"):
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        self.headers = read_headers(message.request_headers.headers)
        config = self.router.config
        if config.api_key and not bearer_ok(self.headers.get("authorization", ""), config.api_key):
            raise APIError(401, "invalid or missing API key", "authentication_error")
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > config.max_body_bytes:
            raise APIError(413, f"request body larger than {config.max_body_bytes} bytes")
        self.subset = subset_hint(message)
        if message.request_headers.end_of_stream or self.request_mode not in BODY_FIRST:
            # Nothing to read before the proxy picks its upstream: route on the headers.
            self.routed_on_headers = True
            return [routed_headers(self._any_pod())]
        if self.request_mode == FULL_DUPLEX:
            return []  # the answer waits for the whole body
        return [proceed("request_headers")]  # the buffered body comes next

    async def _request_body(self, part: pb.HttpBody) -> list:
        if self.routed is not None or self.routed_on_headers:
            return [proceed("request_body")]  # routed already
        limit = self.router.config.max_body_bytes
        if len(self.body) + len(part.body) > limit:
            raise APIError(413, f"request body larger than {limit} bytes")
        self.body += part.body
        if self.request_mode == FULL_DUPLEX and not part.end_of_stream:
            return []
        # BUFFERED: the whole body comes in this one message (trailers or not).
        return await self._route(trailers_follow=not part.end_of_stream)

    async def _request_trailers(self) -> list:
        if self.request_mode == FULL_DUPLEX and self.routed is None:
            return [*await self._route(trailers_follow=True), proceed("request_trailers")]
        return [proceed("request_trailers")]

    def _any_pod(self) -> Destination:
        """A request routed without a body (GET /v1/models, or a mode that shows no body): any
        ready pod, as the router answers /v1/models."""
        router = self.router
        pods = [
            p
            for p in router.ready_pods(router.config.model or "")
            if self.subset is None or p.endpoint in self.subset
        ]
        if not pods:
            raise _no_engine()
        return self._destination([router.rng.choice(pods).endpoint], changed=False)

    async def _route(self, trailers_follow: bool) -> list:
        router, config = self.router, self.router.config
        if self.subset is not None and not any(
            p.healthy and p.endpoint in self.subset for p in router.registry.pods(router.clock())
        ):
            raise _no_engine()  # the protocol: no eligible endpoint in the hint is a 503
        tenant = tenant_of(
            self.headers.get(router.flow.config.tenant_header) or self.headers.get(FAIRNESS_HEADER),
            self.headers.get("authorization"),
        )
        routed = await admit(
            router,
            self.headers.get(":path", "").partition("?")[0],
            bytes(self.body),
            tenant,
            _never,
            self.picker.on_thread,
            self.subset,
        )
        routed.headers = engine_headers(self.headers, config.upstream_api_key)
        if wants_prefill(router, routed):
            await disaggregate(router, self.picker.client, routed, _never)
        self.routed = routed
        self.attempt = router.hooks.dispatch(routed, routed.candidates[0])
        changed = routed.kv_transfer_params is not None
        endpoints = [c.pod.endpoint for c in routed.candidates[: 1 + self.picker.fallbacks]]
        destination = self._destination(endpoints, changed)
        if self.request_mode == FULL_DUPLEX:
            body = routed.payload if changed else bytes(self.body)
            return [routed_headers(destination), *streamed_body(body, not trailers_follow)]
        return [routed_buffered_body(destination, routed.payload if changed else None)]

    def _destination(self, endpoints: list[str], changed: bool) -> Destination:
        """The pick, and the headers the engine must (and must not) see: the router's key
        instead of the client's, and the fleet's signature only where the picker signed."""
        config = self.router.config
        set_headers: dict[str, str] = {}
        remove = [SIGNATURE_HEADER]
        if config.upstream_api_key:
            set_headers["authorization"] = f"Bearer {config.upstream_api_key}"
        elif config.api_key:
            remove.append("authorization")  # the client's key is the gateway's, not the engines'
        if changed and self.routed is not None:
            remove.remove(SIGNATURE_HEADER)
            set_headers[SIGNATURE_HEADER] = self.routed.headers[SIGNATURE_HEADER]
            set_headers["x-request-id"] = self.routed.headers["x-request-id"]
            set_headers["content-length"] = str(len(self.routed.payload))
        return Destination(endpoints, set_headers, remove)

    # The response.

    def _response_headers(self, message: pb.ProcessingRequest) -> list:
        headers = read_headers(message.response_headers.headers)
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        self.event_stream = "text/event-stream" in headers.get("content-type", "")
        self._settle_served(served_endpoint(message))
        if self.status >= 500:
            self._finish(Outcome.REFUSED)  # the engine did not take the request
        elif message.response_headers.end_of_stream or self.response_mode == NO_BODY:
            self._finish(Outcome.RELAYED)
        return [proceed("response_headers")]

    def _settle_served(self, served: str | None) -> None:
        """The proxy retried on a fallback: the first pick never took the request, the pod that
        served it did (its books, not the first's). The proxy retries only on a connection that
        failed before the request went out (the Envoy a Gateway makes: connect-failure,
        refused-stream, reset-before-request), so the first pick is ejected at once, as the
        router ejects a pod that refused it."""
        routed, attempt = self.routed, self.attempt
        if served is None or routed is None or attempt is None:
            return
        if served == attempt.candidate.pod.endpoint:
            return
        candidate = next((c for c in routed.candidates if c.pod.endpoint == served), None)
        if candidate is None:
            return  # not one of ours: the proxy's own fallback
        self.router.registry.eject(attempt.pod_name, "the proxy could not reach it")
        self.router.hooks.finish(routed, attempt, Outcome.REFUSED)
        self.attempt = self.router.hooks.dispatch(routed, candidate)

    def _response_body(self, part: pb.HttpBody) -> list:
        self.response_bytes += len(part.body)
        self.tail += part.body
        del self.tail[:-USAGE_TAIL_BYTES]
        if part.end_of_stream:
            self._count_usage()
            self._finish(Outcome.RELAYED)
        if self.response_mode == FULL_DUPLEX:
            return streamed_body(part.body, part.end_of_stream, request=False)
        return [proceed("response_body")]

    def _count_usage(self) -> None:
        usage = usage_of(bytes(self.tail), self.response_bytes <= len(self.tail), self.event_stream)
        for kind in ("prompt", "completion"):
            value = usage.get(f"{kind}_tokens") if usage else None
            if isinstance(value, int) and value >= 0:
                self.picker.usage.labels(kind).inc(value)

    def _finish(self, outcome: Outcome) -> None:
        if self.routed is None or self.attempt is None or self.attempt.outcome is not None:
            return
        self.router.hooks.finish(self.routed, self.attempt, outcome)
        params = self.routed.kv_transfer_params
        if params is not None and (outcome is not Outcome.RELAYED or self.status != 200):
            # No decode pod took the blocks (a 200 means one did, and it releases them).
            self.picker.release_soon(params)

    def close(self) -> None:
        """The stream ended (the response is done, or the client or the proxy went away)."""
        self._finish(Outcome.RELAYED if self.status is not None else Outcome.CLIENT_LEFT)


def _no_engine() -> APIError:
    return APIError(
        503,
        "no engine can serve this request",
        "service_unavailable",
        None,
        {"retry-after": str(RETRY_AFTER_S)},
    )


def usage_of(tail: bytes, complete: bool, event_stream: bool) -> dict | None:
    """The OpenAI `usage` of a response from its last bytes: the last SSE event that has one,
    or the whole JSON body (only when `complete`)."""
    try:
        if event_stream:
            for line in reversed(tail.split(b"\n")):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if isinstance(usage, dict):
                        return usage
            return None
        if complete:
            usage = json.loads(tail).get("usage")
            return usage if isinstance(usage, dict) else None
    except (ValueError, AttributeError):
        return None
    return None


class Health(health_grpc.HealthServicer):
    """gRPC health as the Endpoint Picker Protocol names it: `liveness` (the process serves),
    `readiness` and the ext_proc service (requests can be taken: an engine is healthy, or
    they can be held)."""

    SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")

    def __init__(self, router: Router) -> None:
        self.router = router

    async def Check(self, request, context):
        if request.service not in self.SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        serving = request.service == "liveness" or self.router.accepting()
        status = health_pb.HealthCheckResponse
        return status(status=status.SERVING if serving else status.NOT_SERVING)
