"""`pagefleet router`: an OpenAI-compatible proxy that picks an engine pod per request.

Per request: tokenize (the model's tokenizer, or fixed character chunks without one), hash
blocks with the engines' own function, look the hashes up in the prefix index, rank pods
(filters -> scorers -> picker), record the decision at once (in-flight count, speculative
prefix entries), forward, and stream the answer back untouched. A connect error or a 5xx
before the first byte is retried on the next-best pod; after the first byte the client gets
an SSE error event.

Every request's work is bounded: the body is limited before it is read (413), parsing and
tokenizing run on a thread of their own (never on the event loop that answers /health and
relays streams), and only a prompt's first ROUTING_PREFIX_CHARS are tokenized (a prefix is
all routing needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from pagefleet.common.block_hash import hash_blocks
from pagefleet.common.fleet_auth import FieldSigner, FleetSecret
from pagefleet.common.http_errors import (
    APIError,
    BodyLimit,
    check_api_key,
    error_response,
    wait_disconnect,
)
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
from pagefleet.router.scoring import Pipeline, RoutingRequest

logger = logging.getLogger("pagefleet.router")
CHARS_PER_TOKEN = 4  # the tokenizer-less fallback hashes fixed character chunks
# How much of a prompt routing tokenizes and hashes: a prefix is all it needs.
ROUTING_PREFIX_CHARS = 256 * 1024
ROUTING_PREFIX_TOKENS = 64 * 1024


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


class Router:
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
        # Parsing and tokenizing: one thread (the tokenizer and prompt cache are its alone).
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="router-tokenize")
        self.rng = random.Random(seed)
        self._expired_at = 0.0
        # Optional: a factory(callback) -> discovery with start()/stop(), for dynamic pods.
        self.discovery = None
        self.metrics = CollectorRegistry()
        m = self.metrics
        self.m_requests = Counter(
            "pagefleet_router:requests", "Requests sent, per pod.", ["pod"], registry=m
        )
        self.m_decision = Histogram(
            "pagefleet_router:decision_seconds",
            "Time to pick a pod.",
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2),
            registry=m,
        )
        self.m_contrib = Counter(
            "pagefleet_router:scorer_contribution",
            "Sum of weighted scores of chosen pods, per scorer.",
            ["scorer"],
            registry=m,
        )
        self.m_hit_blocks = Counter(
            "pagefleet_router:predicted_hit_blocks",
            "Prompt blocks predicted cached on the chosen pod.",
            registry=m,
        )
        self.m_blocks = Counter(
            "pagefleet_router:prompt_blocks", "Prompt blocks routed.", registry=m
        )
        self.m_retries = Counter(
            "pagefleet_router:retries", "Requests retried on another pod.", registry=m
        )
        self.m_pd = Counter(
            "pagefleet_router:pd_decisions",
            "Prefill/decode decisions: disaggregated, decode_only, prefill_failed, no_prefill_pod, "
            "no_fleet_secret.",
            ["outcome"],
            registry=m,
        )
        m.register(_RegistryCollector(registry))
        if tokenizer is None:
            logger.warning(
                "no tokenizer: prefix hashing falls back to %d-character chunks per "
                "token; prefix predictions are approximate",
                CHARS_PER_TOKEN,
            )

    # ------------------------------------------------------------------ routing

    def prompt_hashes(self, path: str, body: dict, block_size: int) -> list:
        """The block hashes of the prompt's first ROUTING_PREFIX_CHARS, tokenized as the engine
        will tokenize it. Raises ValueError for text no tokenizer takes (a lone surrogate)."""
        if path.endswith("/chat/completions"):
            messages = body.get("messages") or []
            if self.prompt_cache is not None:
                conv = [
                    {"role": m.get("role", "user"), "content": _text(m.get("content"))}
                    for m in messages
                ]
                text = self.tokenizer.apply_chat_template(
                    conv,
                    tokenize=False,
                    add_generation_prompt=body.get("add_generation_prompt", True),
                )
                # apply_chat_template(tokenize=True) adds no special tokens of its own.
                return self.prompt_cache.encode(_routed_part(text), False, block_size)[1]
            text = "".join(f"{m.get('role')}:{_text(m.get('content'))}\n" for m in messages)
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return hash_blocks(prompt[:ROUTING_PREFIX_TOKENS], block_size)
            text = prompt if isinstance(prompt, str) else "".join(map(str, prompt))
            if self.prompt_cache is not None:
                return self.prompt_cache.encode(_routed_part(text), True, block_size)[1]
        text = _routed_part(text)
        # Fallback: one pseudo-token per character chunk, stable across processes.
        chunks = [
            int.from_bytes(text[i : i + CHARS_PER_TOKEN].encode()[:4].ljust(4, b"\0"), "little")
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ]
        return hash_blocks(chunks, block_size)

    def block_sizes(self) -> list[int]:
        # Engines of one model normally share a block size; if not, each pod is matched on
        # hashes of its own block size.
        pods = self.registry.pods(self.clock())
        return sorted({self.registry.block_size(p.name) for p in pods} or {16})

    def hashes_by_size(self, path: str, body: dict, sizes: list[int]) -> dict[int, list]:
        return {bs: self.prompt_hashes(path, body, bs) for bs in sizes}

    def rank(self, path: str, body: dict, role: str | None = None, by_size: dict | None = None):
        """Pods best first; `by_size` (hashes per block size) when already computed."""
        started = time.perf_counter()
        now = self.clock()
        pods = self.registry.pods(now)
        sizes = sorted({self.registry.block_size(p.name) for p in pods} or {16})
        by_size = dict(by_size or {})
        for bs in sizes:  # a pod with another block size may have arrived meanwhile
            if bs not in by_size:
                by_size[bs] = self.prompt_hashes(path, body, bs)
        matches: dict[str, int] = {}
        for bs, hashes in by_size.items():
            found = self.index.match(hashes, now)
            for p in pods:
                if self.registry.block_size(p.name) == bs and p.name in found:
                    # counted in blocks of the smallest size, so fractions compare
                    matches[p.name] = found[p.name] * bs // sizes[0]
        request = RoutingRequest(
            model=body.get("model") or "",
            block_hashes=by_size[sizes[0]],
            role=role,
            prefix_matches=matches,
        )
        ranked = self.pipeline.rank(request, pods)
        if len(ranked) > 1 and ranked[0][0] - ranked[1][0] <= 1e-9:
            best = [r for r in ranked if ranked[0][0] - r[0] <= 1e-9]
            self.rng.shuffle(best)  # random tie-break
            ranked = best + ranked[len(best) :]
        self.m_decision.observe(time.perf_counter() - started)
        return ranked, by_size, request

    def commit(self, pod_name: str, by_size: dict, request: RoutingRequest, parts: dict) -> list:
        """Record the decision before the answer: later requests see it at once. Returns what
        the index newly recorded, to take back if the pod fails."""
        now = self.clock()
        if now - self._expired_at > 1.0:
            self.index.expire(now)
            self._expired_at = now
        added = self.index.record(pod_name, by_size[self.registry.block_size(pod_name)], now)
        self.m_requests.labels(pod_name).inc()
        self.m_blocks.inc(len(request.block_hashes))
        self.m_hit_blocks.inc(request.prefix_matches.get(pod_name, 0))
        for scorer, value in parts.items():
            self.m_contrib.labels(scorer).inc(value)
        return added


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


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


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


def build_router_app(router: Router) -> FastAPI:
    config = router.config
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop = asyncio.get_running_loop()
        discovery = None
        if router.discovery is not None:
            # Discovery runs on its own thread; pod sets are applied on this loop.
            discovery = router.discovery(
                lambda pods: loop.call_soon_threadsafe(router.registry.set_pods, pods)
            ).start()
        scraper = asyncio.ensure_future(router.registry.run(client))
        yield
        scraper.cancel()
        if discovery is not None:
            discovery.stop()
        router.tokenizing.shutdown(wait=False, cancel_futures=True)
        await client.aclose()

    app = FastAPI(title="pagefleet router", lifespan=lifespan)
    # Inside the key check (middleware added later wraps it): bodies of clients without the
    # key are never read.
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def _apierror_response(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)

    async def on_tokenizing_thread(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(router.tokenizing, fn, *args)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        denied = check_api_key(
            request.headers.get("authorization", ""),
            config.api_key,
            request.url.path,
            ("/health", "/livez", "/metrics"),
        )
        return denied if denied is not None else await call_next(request)

    @app.get("/livez")
    async def livez():
        # Liveness: this process serves. Never tied to the engines, or the kubelet would
        # restart a working router while engines load, in an outage and at zero replicas.
        return Response(status_code=200)

    @app.get("/health")
    async def health():
        healthy = [p for p in router.registry.pods(router.clock()) if p.healthy]
        if not healthy:
            return error_response(503, "no healthy engine", "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        for pod in router.registry.pods(router.clock()):
            if pod.healthy:
                try:
                    r = await client.get(
                        f"{pod.url}/v1/models",
                        headers=_forward_headers({}, config.upstream_api_key),
                    )
                    return JSONResponse(r.json(), r.status_code)
                except (httpx.HTTPError, ValueError):
                    continue
        return error_response(503, "no healthy engine", "service_unavailable")

    async def proxy(path: str, request: Request):
        raw = await request.body()
        body = await on_tokenizing_thread(_parse, raw)
        refuse_fleet_fields(body)
        if config.model and body.get("model") not in (None, config.model):
            return error_response(
                404, f"model {body.get('model')!r} does not exist", "not_found_error"
            )
        role = "decode" if router.registry.has_role("decode") else None
        try:
            by_size = await on_tokenizing_thread(
                router.hashes_by_size, path, body, router.block_sizes()
            )
            ranked, by_size, routing = router.rank(path, body, role, by_size)
        except (TypeError, AttributeError, ValueError, KeyError) as e:
            # The engine would refuse it too; say so here rather than with a 500.
            return error_response(400, f"invalid request body: {e}")
        if not ranked:
            return error_response(503, "no engine can serve this request", "service_unavailable")
        headers = _forward_headers(dict(request.headers), config.upstream_api_key)
        pd_params = None
        # Only a decode pod pulls blocks (a colocated pod may have no KV connector).
        if ranked[0][1].role == "decode" and router.registry.has_role("prefill"):
            outcome = await maybe_prefill(path, body, headers, request, routing, by_size, ranked)
            if outcome is _CLIENT_LEFT:
                return Response(status_code=499)
            if outcome is not None:
                pd_params = outcome
                decode = decode_body(body, pd_params)
                raw = json.dumps(decode).encode()
                headers = signed_headers(headers, decode, router.signer)
        response = await forward(path, body, raw, headers, request, routing, by_size, ranked)
        if pd_params is not None and response.status_code != 200:
            # No decode pod took the blocks (a 200 means one did, and it releases them).
            await release_prefill_soon(pd_params, config.fleet_secret)
        return response

    async def maybe_prefill(path, body, headers, request, routing, by_size, ranked):
        """Run the prefill pod's part if the request is worth it; returns its
        kv_transfer_params, None (the decode pod prefills) or _CLIENT_LEFT."""
        if router.signer is None:  # engines refuse unsigned kv_transfer_params
            router.m_pd.labels("no_fleet_secret").inc()
            return None
        decode_pod = ranked[0][1]
        cached = routing.prefix_matches.get(decode_pod.name, 0)
        size = min(by_size)
        if not should_disaggregate(
            len(routing.block_hashes), cached, size, config.pd_threshold_tokens
        ):
            router.m_pd.labels("decode_only").inc()
            return None
        prefill_pods = [p for p in router.registry.pods(router.clock()) if p.role == "prefill"]
        ranked_p = router.pipeline.rank(dataclasses.replace(routing, role="prefill"), prefill_pods)
        if not ranked_p:
            router.m_pd.labels("no_prefill_pod").inc()
            return None
        _, pod, parts = ranked_p[0]
        blocks = len(routing.block_hashes)
        router.commit(pod.name, by_size, routing, parts)
        pod.begin(blocks)
        task = asyncio.ensure_future(
            run_prefill(client, pod.url, path, body, headers, config.prefill_timeout, router.signer)
        )
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            pod.end(blocks)
        if not task.done():  # the client left: closing the connection aborts the prefill
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return _CLIENT_LEFT
        result = task.result()
        if result.kv_transfer_params is None:
            router.m_pd.labels("prefill_failed").inc()
            logger.warning("%s; the decode pod prefills locally", result.error)
            return None
        router.m_pd.labels("disaggregated").inc()
        return result.kv_transfer_params

    async def forward(path, body, raw, headers, request, routing, by_size, ranked):
        """Send to the best pod, the next on a failure before the first byte."""
        last_error = "no attempt"
        blocks = len(routing.block_hashes)
        for attempt, (_, pod, parts) in enumerate(ranked[: config.max_attempts]):
            if attempt:
                router.m_retries.inc()
            added = router.commit(pod.name, by_size, routing, parts)
            pod.begin(blocks)
            upstream = client.build_request(
                "POST", f"{pod.url}{path}", content=raw, headers=headers
            )
            try:
                response = await _send_unless_client_leaves(client, upstream, request)
            except httpx.HTTPError as e:
                response, last_error = None, f"{pod.name}: {e!r}"
            except _ClientLeft:
                pod.end(blocks)  # closing the upstream connection aborts it on the engine
                return Response(status_code=499)
            if response is not None and response.status_code < 500:
                return _relay(response, pod, blocks, body.get("stream", False))
            if response is not None:
                await response.aclose()
                last_error = f"{pod.name}: HTTP {response.status_code}"
            pod.end(blocks)
            router.index.unrecord(pod.name, added)  # it never got those blocks
        return error_response(502, f"no engine answered ({last_error})", "bad_gateway")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy("/v1/chat/completions", request)

    return app


class _ClientLeft(Exception):
    pass


_CLIENT_LEFT = object()


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


def _relay(response: httpx.Response, pod, blocks: int, streaming: bool) -> StreamingResponse:
    async def body():
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # after the first byte: a clean SSE error, then the end
            if streaming:
                error = {
                    "error": {
                        "message": f"engine {pod.name} failed mid-stream: {e!r}",
                        "type": "upstream_error",
                        "param": None,
                        "code": 502,
                    }
                }
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            pod.end(blocks)
            await response.aclose()

    headers = {
        k: v
        for k, v in response.headers.items()
        if k.lower() in ("content-type", "x-request-id", "retry-after")
    }
    return StreamingResponse(body(), status_code=response.status_code, headers=headers)
