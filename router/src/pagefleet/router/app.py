"""`pagefleet router`: an OpenAI-compatible proxy that picks an engine pod per request.

Per request: tokenize (the model's tokenizer, or fixed character chunks without one), hash
blocks with the engines' own function, look the hashes up in the prefix index, rank pods
(filters -> scorers -> picker) into a `RoutedRequest`, forward, and stream the answer back
untouched. Each request sent to a pod runs the router's hooks (`routed.py`) before it leaves
and once its outcome is known: they keep the in-flight counts, the speculative prefix entries
and the metrics. A connect error or a 5xx before the first byte is retried on the next
candidate; after the first byte the client gets an SSE error event.

The handlers are module-level functions over one `AppState` (on `app.state.router`).

Engines are reached through httpx over aiohttp's keep-alive pool (`upstream.py`); the relay
forwards the engine's bytes as they come, parsing none of them.

Every request's work is bounded: the body is limited before it is read (413), parsing and
tokenizing run on a thread of their own (never on the event loop that answers /health and
relays streams), and only a prompt's first ROUTING_PREFIX_CHARS are tokenized (a prefix is
all routing needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from pagefleet.common.block_hash import hash_blocks, lora_extra_keys
from pagefleet.common.fleet_auth import FieldSigner, FleetSecret
from pagefleet.common.http_errors import (
    APIError,
    BodyLimit,
    ClosingStreamingResponse,
    check_api_key,
    error_response,
    wait_disconnect,
)
from pagefleet.router.flow_control import FlowConfig, FlowControl, Held, tenant_of
from pagefleet.router.pd import (
    decode_body,
    refuse_fleet_fields,
    release_prefill_soon,
    run_prefill,
    should_disaggregate,
    signed_headers,
)
from pagefleet.router.pods import PodRegistry
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.prompt_cache import PromptCache
from pagefleet.router.routed import (
    PREFILL,
    AdapterRecording,
    Attempt,
    DispatchCounters,
    DispatchMetrics,
    Hooks,
    InflightLoad,
    Outcome,
    PrefixRecording,
    RoutedRequest,
)
from pagefleet.router.scoring import Candidate, Pipeline, Pod, RoutingRequest
from pagefleet.router.upstream import AiohttpTransport

logger = logging.getLogger("pagefleet.router")
CHARS_PER_TOKEN = 4  # the tokenizer-less fallback hashes fixed character chunks
# How much of a prompt routing tokenizes and hashes: a prefix is all it needs.
ROUTING_PREFIX_CHARS = 256 * 1024
ROUTING_PREFIX_TOKENS = 64 * 1024
RETRY_AFTER_S = 1  # a refused held request may retry this soon: a scrape can find capacity
# Held requests wait for the release loop; this much past their deadline they stop waiting
# on their own, should the loop ever not settle them.
HOLD_BACKSTOP_S = 5.0


@dataclass
class RouterConfig:
    model: str | None = None  # served model name; None accepts any
    api_key: str | None = None  # clients must present this
    upstream_api_key: str | None = None  # the router presents this to engines
    max_attempts: int = 3
    connect_timeout: float = 2.0
    read_timeout: float = 600.0
    pd_threshold_tokens: int = 512  # disaggregate when this much of the prompt is uncached
    prefill_timeout: float = 60.0  # a prefill pod slower than this: decode prefills itself
    fleet_secret: FleetSecret | None = None  # signs kv_transfer_params; none: no P/D
    max_body_bytes: int = 4 << 20  # 413 beyond
    flow: FlowConfig = field(default_factory=FlowConfig)  # holding requests without capacity


@dataclass
class RouterMetrics:
    """The router's own Prometheus registry and series."""

    registry: CollectorRegistry
    decision: Histogram
    pd: Counter  # per P/D decision
    dispatch: DispatchCounters
    queue_rejections: Counter  # per model and reason: full, deadline
    queue_wait: Histogram  # per model: how long released requests were held

    @classmethod
    def create(
        cls, pods: PodRegistry, flow: FlowControl, clock: Callable[[], float]
    ) -> RouterMetrics:
        m = CollectorRegistry()
        m.register(_RegistryCollector(pods))
        m.register(_FlowCollector(flow, clock))
        return cls(
            m,
            Histogram(
                "pagefleet_router:decision_seconds",
                "Time to pick a pod.",
                buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2),
                registry=m,
            ),
            Counter(
                "pagefleet_router:pd_decisions",
                "Prefill/decode decisions: disaggregated, decode_only, prefill_failed, "
                "no_prefill_pod, no_fleet_secret.",
                ["outcome"],
                registry=m,
            ),
            DispatchCounters(
                requests=Counter(
                    "pagefleet_router:requests", "Requests sent, per pod.", ["pod"], registry=m
                ),
                prompt_blocks=Counter(
                    "pagefleet_router:prompt_blocks", "Prompt blocks routed.", registry=m
                ),
                predicted_hit_blocks=Counter(
                    "pagefleet_router:predicted_hit_blocks",
                    "Prompt blocks predicted cached on the chosen pod.",
                    registry=m,
                ),
                scorer_contribution=Counter(
                    "pagefleet_router:scorer_contribution",
                    "Sum of weighted scores of chosen pods, per scorer.",
                    ["scorer"],
                    registry=m,
                ),
                retries=Counter(
                    "pagefleet_router:retries", "Requests retried on another pod.", registry=m
                ),
            ),
            Counter(
                "pagefleet_router:queue_rejections",
                "Held requests refused with 503, per model: the queue was full, or the "
                "request's deadline passed.",
                ["model", "reason"],
                registry=m,
            ),
            Histogram(
                "pagefleet_router:queue_wait_seconds",
                "Seconds a request was held before an engine could take it, per model.",
                ["model"],
                buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                registry=m,
            ),
        )


class Router:
    """The routing decision: prompt -> block hashes -> prefix matches -> the pipeline's
    candidates, and the hooks that keep the books on each request sent."""

    def __init__(
        self,
        registry: PodRegistry,
        index: PrefixIndex,
        pipeline: Pipeline,
        config: RouterConfig,
        tokenizer=None,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry, self.index, self.pipeline = registry, index, pipeline
        self.config, self.tokenizer, self.clock = config, tokenizer, clock
        self.prompt_cache = PromptCache(tokenizer) if tokenizer is not None else None
        self.signer = FieldSigner(config.fleet_secret) if config.fleet_secret else None
        self.rng = random.Random(seed)
        # Optional: a factory(callback) -> discovery with start()/stop(), for dynamic pods.
        self.discovery = None
        self.flow = FlowControl(config.flow, config.model)
        self.metrics = RouterMetrics.create(registry, self.flow, clock)
        if config.model is not None:  # the rejection series read 0 before the first one
            for reason in ("full", "deadline"):
                self.metrics.queue_rejections.labels(self.flow.label(config.model), reason)
        self.hooks = Hooks(
            [
                PrefixRecording(index, registry.block_size, clock),
                InflightLoad(),
                AdapterRecording(),
                DispatchMetrics(self.metrics.dispatch),
            ]
        )
        if tokenizer is None:
            logger.warning(
                "no tokenizer: prefix hashing falls back to %d-character chunks per "
                "token; prefix predictions are approximate",
                CHARS_PER_TOKEN,
            )

    def adapter_of(self, body: dict) -> str | None:
        """The LoRA adapter a request's `model` names (one some pod lists), else None."""
        model = body.get("model")
        return model if isinstance(model, str) and model in self.registry.adapters() else None

    def prompt_hashes(self, path: str, body: dict, block_size: int) -> list:
        """The block hashes of the prompt's first ROUTING_PREFIX_CHARS, tokenized as the engine
        will tokenize it, keyed by its LoRA adapter as the engine keys them. Raises ValueError
        for text no tokenizer takes (a lone surrogate)."""
        keys = lora_extra_keys(self.adapter_of(body))
        if path.endswith("/chat/completions"):
            messages = body.get("messages") or []
            if self.prompt_cache is not None:
                conv = [
                    {"role": m.get("role", "user"), "content": _text(m.get("content"))}
                    for m in messages
                ]
                text = self.tokenizer.apply_chat_template(
                    conv,
                    tools=_tools(body),
                    tokenize=False,
                    add_generation_prompt=body.get("add_generation_prompt", True),
                )
                # apply_chat_template(tokenize=True) adds no special tokens of its own.
                return self._cached_hashes(_routed_part(text), False, block_size, keys)
            text = "".join(f"{m.get('role')}:{_text(m.get('content'))}\n" for m in messages)
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return hash_blocks(prompt[:ROUTING_PREFIX_TOKENS], block_size, extra_keys=keys)
            text = prompt if isinstance(prompt, str) else "".join(map(str, prompt))
            if self.prompt_cache is not None:
                return self._cached_hashes(_routed_part(text), True, block_size, keys)
        text = _routed_part(text)
        # Fallback: one pseudo-token per character chunk, stable across processes.
        chunks = [
            int.from_bytes(text[i : i + CHARS_PER_TOKEN].encode()[:4].ljust(4, b"\0"), "little")
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ]
        return hash_blocks(chunks, block_size, extra_keys=keys)

    def _cached_hashes(self, text: str, special: bool, block_size: int, keys: bytes) -> list:
        """Through the prompt cache, whose hashes are the base model's: an adapter's blocks
        are hashed again over the same tokens."""
        tokens, hashes = self.prompt_cache.encode(text, special, block_size)
        return hash_blocks(tokens, block_size, extra_keys=keys) if keys else hashes

    def block_sizes(self) -> list[int]:
        # Engines of one model normally share a block size; if not, each pod is matched on
        # hashes of its own block size.
        pods = self.registry.pods(self.clock())
        return sorted({self.registry.block_size(p.name) for p in pods} or {16})

    def hashes_by_size(self, path: str, body: dict, sizes: list[int]) -> dict[int, list]:
        return {bs: self.prompt_hashes(path, body, bs) for bs in sizes}

    def decide(
        self, path: str, body: dict, role: str | None = None, hashes: dict | None = None
    ) -> RoutedRequest:
        """Rank the pods for a request: its candidates in the picker's order. `hashes` (per
        block size) when already computed."""
        started = time.perf_counter()
        now = self.clock()
        pods = self.registry.pods(now)
        sizes = sorted({self.registry.block_size(p.name) for p in pods} or {16})
        hashes = dict(hashes or {})
        for bs in sizes:  # a pod with another block size may have arrived meanwhile
            if bs not in hashes:
                hashes[bs] = self.prompt_hashes(path, body, bs)
        matches: dict[str, int] = {}
        for bs, of_size in hashes.items():
            found = self.index.match(of_size, now)
            for p in pods:
                if self.registry.block_size(p.name) == bs and p.name in found:
                    # counted in blocks of the smallest size, so fractions compare
                    matches[p.name] = found[p.name] * bs // sizes[0]
        routing = RoutingRequest(
            model=body.get("model") or "",
            block_hashes=hashes[sizes[0]],
            role=role,
            prefix_matches=matches,
            adapter=self.adapter_of(body),
        )
        candidates = self.pipeline.pick(routing, pods, self.rng)
        self.metrics.decision.observe(time.perf_counter() - started)
        return RoutedRequest(path, body, hashes, routing, candidates)

    def ready_pods(self, model: str) -> list[Pod]:
        """The pods a request for `model` could go to now (the pipeline's filters)."""
        role = "decode" if self.registry.has_role("decode") else None
        routing = RoutingRequest(model=model, block_hashes=[], role=role)
        return self.pipeline.candidates(routing, self.registry.pods(self.clock()))

    def prefill_candidates(self, routed: RoutedRequest) -> list[Candidate]:
        """Prefill pods for a request, in the picker's order (matched as for its decode pod)."""
        pods = [p for p in self.registry.pods(self.clock()) if p.role == "prefill"]
        return self.pipeline.pick(
            dataclasses.replace(routed.routing, role="prefill"), pods, self.rng
        )


class _RegistryCollector:
    def __init__(self, registry: PodRegistry) -> None:
        self.registry = registry

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield CounterMetricFamily(
            "pagefleet_router:ejections",
            "Pods ejected after failed scrapes.",
            value=self.registry.ejections,
        )
        inflight = GaugeMetricFamily(
            "pagefleet_router:inflight", "Requests sent and not finished, per pod.", labels=["pod"]
        )
        for name, status in self.registry.status.items():
            inflight.add_metric([name], status.pod.inflight)
        yield inflight


class _FlowCollector:
    """The queue gauges, read when scraped: right at zero engines, where autoscalers need
    them."""

    def __init__(self, flow: FlowControl, clock: Callable[[], float]) -> None:
        self.flow, self.clock = flow, clock

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        queued = GaugeMetricFamily(
            "pagefleet_router:queued_requests",
            "Requests held until an engine can take them, per model.",
            labels=["model"],
        )
        oldest = GaugeMetricFamily(
            "pagefleet_router:oldest_queued_seconds",
            "Age of the oldest held request, per model (0 when none).",
            labels=["model"],
        )
        for model, (count, age) in self.flow.stats(self.clock()).items():
            queued.add_metric([model], count)
            oldest.add_metric([model], age)
        yield queued
        yield oldest


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _tools(body: dict) -> list[dict] | None:
    """The request's tool definitions, which chat templates render into the prompt (often
    ahead of every message): without them the router's hashes would miss the engine's blocks."""
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be a list of objects")
    return tools


def _routed_part(text: str) -> str:
    """The part of a prompt routing looks at; ValueError if no tokenizer could take it."""
    part = text[:ROUTING_PREFIX_CHARS]
    part.encode("utf-8")  # UnicodeEncodeError (a ValueError) for a lone surrogate
    return part


def _parse(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIError(400, "malformed JSON body") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


@dataclass
class AppState:
    """What the handlers share, one per app (on `app.state.router`)."""

    router: Router
    client: httpx.AsyncClient
    # Parsing and tokenizing: one thread (the tokenizer and prompt cache are its alone).
    tokenizing: ThreadPoolExecutor

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
    releaser = asyncio.ensure_future(_release_loop(state))
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
    router = _state(request).router
    # Holding requests, the router can take them with no engine up (at zero replicas it must,
    # or nothing would reach it to wake the pool).
    if not router.flow.enabled and not any(p.healthy for p in router.registry.pods(router.clock())):
        return error_response(503, "no healthy engine", "service_unavailable")
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    registry = _state(request).router.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> Response:
    state = _state(request)
    for pod in state.router.registry.pods(state.router.clock()):
        if pod.healthy:
            try:
                r = await state.client.get(
                    f"{pod.url}/v1/models",
                    headers=_forward_headers({}, state.config.upstream_api_key),
                )
                return JSONResponse(r.json(), r.status_code)
            except (httpx.HTTPError, ValueError):
                continue
    return error_response(503, "no healthy engine", "service_unavailable")


async def completions(request: Request) -> Response:
    return await proxy(_state(request), "/v1/completions", request)


async def chat_completions(request: Request) -> Response:
    return await proxy(_state(request), "/v1/chat/completions", request)


async def _on_tokenizing_thread(state: AppState, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(state.tokenizing, fn, *args)


async def proxy(state: AppState, path: str, request: Request) -> Response:
    """Parse, decide, maybe disaggregate, forward."""
    router, config = state.router, state.config
    raw = await request.body()
    try:
        # One trip to the tokenizing thread: each trip is a wake-up of the loop.
        body, hashes = await _on_tokenizing_thread(
            state, _read, router, path, raw, router.block_sizes()
        )
        if hashes is None:
            return error_response(
                404, f"model {body.get('model')!r} does not exist", "not_found_error"
            )
        role = "decode" if router.registry.has_role("decode") else None
        routed = router.decide(path, body, role, hashes)
        model = _model_of(config, body)
        if router.flow.must_hold(model, routed.candidates):
            refused = await _hold(state, model, request)
            if refused is not None:
                return refused
            role = "decode" if router.registry.has_role("decode") else None
            routed = router.decide(path, body, role, hashes)  # the fleet as it is now
    except (TypeError, AttributeError, ValueError, KeyError) as e:
        # The engine would refuse it too; say so here rather than with a 500.
        return error_response(400, f"invalid request body: {e}")
    if not routed.candidates:
        return error_response(503, "no engine can serve this request", "service_unavailable")
    routed.payload = raw
    routed.headers = _forward_headers(dict(request.headers), config.upstream_api_key)
    # Only a decode pod pulls blocks (a colocated pod may have no KV connector).
    if routed.candidates[0].pod.role == "decode" and router.registry.has_role("prefill"):
        await disaggregate(state, routed, request)
        if routed.outcome is Outcome.CLIENT_LEFT:
            return Response(status_code=499)
    response = await forward(state, routed, request)
    if routed.kv_transfer_params is not None and response.status_code != 200:
        # No decode pod took the blocks (a 200 means one did, and it releases them).
        await release_prefill_soon(routed.kv_transfer_params, config.fleet_secret)
    return response


def _read(router: Router, path: str, raw: bytes, sizes: list[int]) -> tuple[dict, dict | None]:
    """On the tokenizing thread: the body parsed and checked, and its block hashes per size
    (None for a model this router does not serve)."""
    body = _parse(raw)
    refuse_fleet_fields(body)
    served = router.config.model
    # A LoRA adapter some pod of the model serves passes too.
    if served and body.get("model") not in (None, served) and router.adapter_of(body) is None:
        return body, None
    return body, router.hashes_by_size(path, body, sizes)


def _model_of(config: RouterConfig, body: dict) -> str:
    model = config.model or body.get("model")
    return model if isinstance(model, str) else ""


async def _hold(state: AppState, model: str, request: Request) -> Response | None:
    """Hold a request until the release loop finds an engine for it: None once released,
    else the answer (503 when the queue is full or the deadline passes, 499 when the client
    left, which takes it out of the queue at once)."""
    router, flow = state.router, state.router.flow
    tenant = tenant_of(
        request.headers.get(flow.config.tenant_header), request.headers.get("authorization")
    )
    waiter = asyncio.get_running_loop().create_future()
    held = flow.hold(model, tenant, waiter, router.clock())
    if held is None:
        return _refuse(router, flow.label(model), "full")
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait(
            {waiter, gone},
            timeout=flow.config.queue_timeout + HOLD_BACKSTOP_S,
            return_when=asyncio.FIRST_COMPLETED,
        )
        left = gone.done()
    finally:
        gone.cancel()
        if not waiter.done():  # the client left, or this handler was cancelled
            flow.leave(held)
            waiter.cancel()
    if waiter.cancelled():
        return Response(status_code=499) if left else _refuse(router, held.model, "deadline")
    if waiter.result() is not None:
        return _refuse(router, held.model, waiter.result())
    router.metrics.queue_wait.labels(held.model).observe(router.clock() - held.enqueued_at)
    return None


def _refuse(router: Router, label: str, reason: str) -> Response:
    router.metrics.queue_rejections.labels(label, reason).inc()
    message = {
        "full": "too many requests are waiting for an engine of this model",
        "deadline": "no engine of this model could take the request in time",
    }[reason]
    return error_response(
        503,
        f"{message}; retry later",
        "service_unavailable",
        None,
        {"Retry-After": str(RETRY_AFTER_S)},
    )


async def _release_loop(state: AppState) -> None:
    """Every scrape interval while requests are held: refuse those past their deadline, and
    release what the ready pods can take (a scrape or discovery found capacity)."""
    router = state.router
    while True:
        await asyncio.sleep(router.registry.interval)
        if not router.flow.held:
            continue
        try:
            settled = router.flow.settle(router.clock(), router.ready_pods)
        except Exception:  # one bad round must not strand every held request
            logger.exception("flow control: the release round failed")
            continue
        for item in settled.expired:
            _wake(item, "deadline")
        for item in settled.released:
            _wake(item, None)


def _wake(item: Held, refusal: str | None) -> None:
    if not item.waiter.done():
        item.waiter.set_result(refusal)


async def disaggregate(state: AppState, routed: RoutedRequest, request: Request) -> None:
    """Have a prefill pod compute the prompt if the request is worth it; on success the
    request to the decode pod carries the prefill pod's kv_transfer_params, signed."""
    routed.pd = await _prefill(state, routed, request)
    if routed.pd is not None:
        state.router.metrics.pd.labels(routed.pd).inc()


async def _prefill(state: AppState, routed: RoutedRequest, request: Request) -> str | None:
    """The P/D decision, after running the prefill if it is worth one; None if the client
    left meanwhile."""
    router, config = state.router, state.config
    if router.signer is None:  # engines refuse unsigned kv_transfer_params
        return "no_fleet_secret"
    cached = routed.routing.prefix_matches.get(routed.candidates[0].pod.name, 0)
    if not should_disaggregate(
        routed.blocks, cached, min(routed.hashes), config.pd_threshold_tokens
    ):
        return "decode_only"
    prefill = router.prefill_candidates(routed)
    if not prefill:
        return "no_prefill_pod"
    attempt = router.hooks.dispatch(routed, prefill[0], PREFILL)
    task = asyncio.ensure_future(
        run_prefill(
            state.client,
            attempt.candidate.pod.url,
            routed.path,
            routed.body,
            routed.headers,
            config.prefill_timeout,
            router.signer,
        )
    )
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        router.hooks.finish(routed, attempt, _prefill_outcome(task))
    if not task.done():  # the client left: closing the connection aborts the prefill
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    result = task.result()
    if result.kv_transfer_params is None:
        logger.warning("%s; the decode pod prefills locally", result.error)
        return "prefill_failed"
    routed.kv_transfer_params = result.kv_transfer_params
    decode = decode_body(routed.body, result.kv_transfer_params)
    routed.payload = json.dumps(decode).encode()
    routed.headers = signed_headers(routed.headers, decode, router.signer)
    return "disaggregated"


def _prefill_outcome(task: asyncio.Future) -> Outcome:
    if not task.done():
        return Outcome.CLIENT_LEFT
    if task.cancelled() or task.result().kv_transfer_params is None:
        return Outcome.PREFILL_FAILED
    return Outcome.PREFILLED


async def forward(state: AppState, routed: RoutedRequest, request: Request) -> Response:
    """Send to the first candidate, the next on a failure before the first byte."""
    router, client = state.router, state.client
    last_error = "no attempt"
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
        except _ClientLeft:  # closing the upstream connection aborts it on the engine
            router.hooks.finish(routed, attempt, Outcome.CLIENT_LEFT)
            return Response(status_code=499)
        if response is not None and response.status_code < 500:
            return _relay(response, router.hooks, routed, attempt)
        if response is not None:
            await response.aclose()
            last_error = f"{pod.name}: HTTP {response.status_code}"
        router.hooks.finish(routed, attempt, Outcome.REFUSED)
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


def _forward_headers(request_headers: dict, api_key: str | None) -> dict:
    keep = {"content-type", "x-request-id", "accept"}
    headers = {k: v for k, v in request_headers.items() if k.lower() in keep}
    headers.setdefault("content-type", "application/json")
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


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
