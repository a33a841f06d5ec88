"""`pagefleet router`: an OpenAI-compatible proxy that picks an engine pod per request.

Per request: the picking core (`core.py`: parse, hash, rank pods into a `RoutedRequest`, hold
while no engine can take it, P/D), then forward, and stream the answer back untouched. Each
request sent to a pod runs the router's hooks (`routed.py`) before it leaves and once its
outcome is known: they keep the in-flight counts, the speculative prefix entries and the
metrics. A connect error or a 5xx before the first byte is retried on the next
candidate; after the first byte the client gets an SSE error event. A pod whose connection is
refused or reset before the first byte is ejected at once; when every pod tried was gone, the
request goes back to the core, held as for an empty pool until its deadline.

The handlers are module-level functions over one `AppState` (on `app.state.router`).

Engines are reached through httpx over aiohttp's keep-alive pool (`upstream.py`); the relay
forwards the engine's bytes as they come, parsing none of them.

Every request's work is bounded: the body is limited before it is read (413), parsing and
tokenizing run on a thread of their own (never on the event loop that answers /health and
relays streams), and only a prompt's first ROUTING_PREFIX_CHARS (core.py) are tokenized (a prefix is
all routing needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagefleet.common.http_errors import (
    APIError,
    BodyLimit,
    ClosingStreamingResponse,
    check_api_key,
    error_response,
    wait_disconnect,
)
from pagefleet.router.core import (
    RETRY_AFTER_S,
    Router,
    RouterConfig,
    admit,
    disaggregate,
    engine_headers,
    readmit,
    release_loop,
    wants_prefill,
)
from pagefleet.router.flow_control import tenant_of
from pagefleet.router.openapi import declare_bodies
from pagefleet.router.pd import release_prefill_soon
from pagefleet.router.routed import Attempt, Hooks, Outcome, RoutedRequest
from pagefleet.router.upstream import AiohttpTransport, engine_gone

logger = logging.getLogger("pagefleet.router")


@dataclass
class AppState:
    """What the handlers share, one per app (on `app.state.router`)."""

    router: Router
    client: httpx.AsyncClient
    # Parsing and tokenizing: one thread (the tokenizer and prompt cache are its alone).
    tokenizing: ThreadPoolExecutor
    models_seen: dict | None = None  # the last /v1/models an engine answered

    @property
    def config(self) -> RouterConfig:
        return self.router.config


def build_router_app(router: Router, client: httpx.AsyncClient | None = None) -> FastAPI:
    """The router's HTTP app; `client` (the one the app closes) reaches the engines."""
    config = router.config
    if client is None:
        client = httpx.AsyncClient(
            transport=AiohttpTransport(),
            timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
        )
    app = FastAPI(title="pagefleet router", lifespan=_lifespan)
    app.state.router = AppState(
        router, client, ThreadPoolExecutor(1, thread_name_prefix="router-tokenize")
    )
    # Inside the key check (middleware added later wraps it): bodies of clients without the
    # key are never read.
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(_KeyCheck)
    app.add_exception_handler(APIError, _api_error)
    app.add_api_route("/livez", livez, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_api_route("/pooling", pooling, methods=["POST"])
    declare_bodies(app)
    return app


def _state(request: Request) -> AppState:
    return request.app.state.router


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state: AppState = app.state.router
    router = state.router
    loop = asyncio.get_running_loop()
    discovery = None
    if router.discovery is not None:
        # Discovery runs on its own thread; pod sets are applied on this loop.
        discovery = router.discovery(
            functools.partial(loop.call_soon_threadsafe, router.registry.set_pods)
        ).start()
    scraper = asyncio.ensure_future(router.registry.run(state.client))
    releaser = asyncio.ensure_future(release_loop(router))
    yield
    releaser.cancel()
    scraper.cancel()
    if discovery is not None:
        discovery.stop()
    state.tokenizing.shutdown(wait=False, cancel_futures=True)
    await state.client.aclose()


async def _api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)


class _KeyCheck:
    """ASGI middleware: 401 unless the client presents the router's API key (probes and
    /metrics are open). Plain ASGI, not `app.middleware("http")`: Starlette's
    BaseHTTPMiddleware pipes every response chunk through a memory stream and a task of its
    own, which cost the streams it relays (issue 23)."""

    OPEN_PATHS = ("/health", "/livez", "/metrics")

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            state: AppState = scope["app"].state.router
            authorization = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), ""
            )
            denied = check_api_key(
                authorization, state.config.api_key, scope["path"], self.OPEN_PATHS
            )
            if denied is not None:
                return await denied(scope, receive, send)
        await self.app(scope, receive, send)


async def livez() -> Response:
    # Liveness: this process serves. Never tied to the engines, or the kubelet would
    # restart a working router while engines load, in an outage and at zero replicas.
    return Response(status_code=200)


async def health(request: Request) -> Response:
    if not _state(request).router.accepting():
        return error_response(503, "no healthy engine", "service_unavailable")
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    registry = _state(request).router.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> Response:
    """An engine's own answer (a ready one first, else one not scraped yet); else the last
    one seen, else --model's card: the router knows its models at zero engines too (clients
    list them first)."""
    state = _state(request)
    for pod in state.router.registry.reachable():
        try:
            r = await state.client.get(
                f"{pod.url}/v1/models", headers=engine_headers({}, state.config.upstream_api_key)
            )
            answer = r.json()
        except (httpx.HTTPError, ValueError):
            continue
        if r.status_code == 200:
            state.models_seen = answer
        return JSONResponse(answer, r.status_code)
    if state.models_seen is not None:
        return JSONResponse(state.models_seen)
    model = state.config.model
    cards = [{"id": model, "object": "model", "owned_by": "pagefleet"}] if model else []
    return JSONResponse({"object": "list", "data": cards})


async def completions(request: Request) -> Response:
    return await proxy(_state(request), "/v1/completions", request)


async def chat_completions(request: Request) -> Response:
    return await proxy(_state(request), "/v1/chat/completions", request)


async def embeddings(request: Request) -> Response:
    return await proxy(_state(request), "/v1/embeddings", request)  # see pooling.py


async def pooling(request: Request) -> Response:
    return await proxy(_state(request), "/pooling", request)


async def _on_tokenizing_thread(state: AppState, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(state.tokenizing, fn, *args)


async def proxy(state: AppState, path: str, request: Request) -> Response:
    """Admit (parse, decide, hold), maybe disaggregate, forward; when every engine tried was
    gone (now ejected), admit again: held as for an empty pool until the request's deadline."""
    router, config = state.router, state.config
    raw = await request.body()
    tenant = tenant_of(
        request.headers.get(router.flow.config.tenant_header),
        request.headers.get("authorization"),
    )
    left = functools.partial(wait_disconnect, request)
    deadline = router.clock() + router.flow.config.queue_timeout
    on_thread = functools.partial(_on_tokenizing_thread, state)
    routed = await admit(router, path, raw, tenant, left, on_thread, None, deadline)
    while True:
        routed.headers = engine_headers(dict(request.headers), config.upstream_api_key)
        if wants_prefill(router, routed):
            await disaggregate(router, state.client, routed, left)
            if routed.outcome is Outcome.CLIENT_LEFT:
                return Response(status_code=499)
        response = await forward(state, routed, request)
        if routed.kv_transfer_params is not None and (
            response is None or response.status_code != 200
        ):
            # No decode pod took the blocks (a 200 means one did, and it releases them).
            await release_prefill_soon(routed.kv_transfer_params, config.fleet_secret)
        if response is not None:
            return response
        if not router.flow.enabled:  # no engine saw the request: safe to send again
            return error_response(
                503,
                "no engine could be reached",
                "service_unavailable",
                None,
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        routed = await readmit(router, routed, raw, tenant, left, deadline)


async def forward(state: AppState, routed: RoutedRequest, request: Request) -> Response | None:
    """Send to the first candidate, the next on a failure before the first byte. A pod whose
    connection fails (refused, reset) is ejected at once; None when every pod tried was gone
    (no engine saw the request: the caller may hold it)."""
    router, client = state.router, state.client
    last_error, reached = "no attempt", False
    for candidate in routed.candidates[: state.config.max_attempts]:
        attempt = router.hooks.dispatch(routed, candidate)
        pod = candidate.pod
        upstream = client.build_request(
            "POST", f"{pod.url}{routed.path}", content=routed.payload, headers=routed.headers
        )
        try:
            response = await _send_unless_client_leaves(client, upstream, request)
        except httpx.HTTPError as e:
            response, last_error = None, f"{pod.name}: {e!r}"
            if engine_gone(e):
                router.registry.eject(pod.name, f"{type(e).__name__} before the first byte")
            else:
                reached = True
        except _ClientLeft:  # closing the upstream connection aborts it on the engine
            router.hooks.finish(routed, attempt, Outcome.CLIENT_LEFT)
            return Response(status_code=499)
        if response is not None and response.status_code < 500:
            return _relay(response, router.hooks, routed, attempt)
        if response is not None:
            reached = True
            await response.aclose()
            last_error = f"{pod.name}: HTTP {response.status_code}"
        router.hooks.finish(routed, attempt, Outcome.REFUSED)
    if not reached:
        return None
    return error_response(502, f"no engine answered ({last_error})", "bad_gateway")


class _ClientLeft(Exception):
    pass


async def _send_unless_client_leaves(client: httpx.AsyncClient, upstream, request: Request):
    """Wait for the engine's response headers, unless the client disconnects first (then the
    upstream request is cancelled, and the engine sees its client leave)."""
    send = asyncio.ensure_future(client.send(upstream, stream=True))
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
        if send.done():
            return send.result()
        raise _ClientLeft
    finally:
        gone.cancel()
        if not send.done():
            send.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await send


def _relay(
    response: httpx.Response, hooks: Hooks, routed: RoutedRequest, attempt: Attempt
) -> ClosingStreamingResponse:
    return ClosingStreamingResponse(
        _relayed_body(response, hooks, routed, attempt),
        status_code=response.status_code,
        headers={
            k: v
            for k, v in response.headers.items()
            if k.lower() in ("content-type", "x-request-id", "retry-after")
        },
    )


async def _relayed_body(
    response: httpx.Response, hooks: Hooks, routed: RoutedRequest, attempt: Attempt
):
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:  # after the first byte: a clean SSE error, then the end
        if routed.body.get("stream", False):
            error = {
                "error": {
                    "message": f"engine {attempt.pod_name} failed mid-stream: {e!r}",
                    "type": "upstream_error",
                    "param": None,
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        hooks.finish(routed, attempt, Outcome.RELAYED)
        with anyio.CancelScope(shield=True):  # see ClosingStreamingResponse
            await response.aclose()
