"""The router's picking core, shared by its two front doors: the HTTP proxy (`app.py`) and the
Endpoint Picker over Envoy's ext_proc (`epp.py`).

Per request: parse and bound the body, tokenize (the model's tokenizer, or fixed character
chunks without one), hash blocks with the engines' own function, look the hashes up in the
prefix index and rank pods (filters -> scorers -> picker) into a `RoutedRequest`; hold it while
no engine of its model can take it (flow control); run the prefill of a disaggregated request.
Each request sent to a pod runs the hooks (`routed.py`) before it leaves and once its outcome is
known. What a front door does with the answer (relay it, or tell a gateway where to send it)
is its own business; neither holds a second copy of these decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from pagefleet.common.block_hash import hash_blocks, lora_extra_keys
from pagefleet.common.fleet_auth import FieldSigner, FleetSecret
from pagefleet.common.http_errors import APIError
from pagefleet.common.names import TENANT_HEADER
from pagefleet.router.flow_control import FlowConfig, FlowControl, Held
from pagefleet.router.pd import (
    decode_body,
    refuse_fleet_fields,
    run_prefill,
    should_disaggregate,
    signed_headers,
)
from pagefleet.router.pods import PodRegistry
from pagefleet.router.pooling import routed_prompt
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.prompt_cache import PromptCache
from pagefleet.router.routed import (
    PREFILL,
    AdapterRecording,
    DispatchCounters,
    DispatchMetrics,
    Hooks,
    InflightLoad,
    Outcome,
    PrefixRecording,
    RoutedRequest,
)
from pagefleet.router.scoring import Candidate, Pipeline, Pod, RoutingRequest

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
            prompt = routed_prompt(path, body)
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
        self,
        path: str,
        body: dict,
        role: str | None = None,
        hashes: dict | None = None,
        within: Collection[str] | None = None,
    ) -> RoutedRequest:
        """Rank the pods for a request: its candidates in the picker's order. `hashes` (per
        block size) when already computed; `within`: only pods at these `ip:port` endpoints
        (a gateway's subset hint)."""
        started = time.perf_counter()
        now = self.clock()
        pods = self.registry.pods(now)
        if within is not None:
            pods = [p for p in pods if p.endpoint in within]
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

    def accepting(self) -> bool:
        """Whether requests can be taken now: an engine is healthy, or they can be held (at
        zero replicas they must be, or nothing would reach the router to wake the pool)."""
        return self.flow.enabled or any(p.healthy for p in self.registry.pods(self.clock()))

    def serving_role(self) -> str | None:
        """The role of the pod that answers a request: decode where the fleet is
        disaggregated, else any that serves both."""
        return "decode" if self.registry.has_role("decode") else None

    def ready_pods(self, model: str) -> list[Pod]:
        """The pods a request for `model` could go to now (the pipeline's filters)."""
        routing = RoutingRequest(model=model, block_hashes=[], role=self.serving_role())
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


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIError(400, "malformed JSON body") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def read_request(
    router: Router, path: str, raw: bytes, sizes: list[int]
) -> tuple[dict, dict | None]:
    """On the tokenizing thread: the body parsed and checked, and its block hashes per size
    (None for a model this router does not serve)."""
    body = parse_body(raw)
    refuse_fleet_fields(body)
    served = router.config.model
    # A LoRA adapter some pod of the model serves passes too.
    if served and body.get("model") not in (None, served) and router.adapter_of(body) is None:
        return body, None
    return body, router.hashes_by_size(path, body, sizes)


def engine_headers(request_headers: dict, api_key: str | None) -> dict:
    """The headers a request carries to an engine: the client's content type, request id,
    accept and tenant (an engine's grammar compiles take turns by it), and the router's own
    key (never the client's)."""
    keep = {"content-type", "x-request-id", "accept", TENANT_HEADER}
    headers = {k: v for k, v in request_headers.items() if k.lower() in keep}
    headers.setdefault("content-type", "application/json")
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def model_of(config: RouterConfig, body: dict) -> str:
    model = config.model or body.get("model")
    return model if isinstance(model, str) else ""


# What a front door gives the core: a way to run work on its tokenizing thread, and an
# awaitable that completes when its client has gone.
OnThread = Callable[..., Awaitable]
Left = Callable[[], Awaitable[object]]


async def admit(
    router: Router,
    path: str,
    raw: bytes,
    tenant: str,
    left: Left,
    on_thread: OnThread,
    within: Collection[str] | None = None,
    deadline: float | None = None,
) -> RoutedRequest:
    """Parse, decide, and hold while no engine of the model can take the request (until
    `deadline`, default the queue timeout from now): the request with its candidates. Every
    refusal is an APIError: 400/403 for a bad body, 404 for a model this router does not
    serve, 503 (with Retry-After when held) when no engine can serve it, CLIENT_LEFT when the
    client went away while held."""
    try:
        # One trip to the tokenizing thread: each trip is a wake-up of the loop.
        body, hashes = await on_thread(read_request, router, path, raw, router.block_sizes())
    except (TypeError, AttributeError, ValueError, KeyError) as e:
        # The engine would refuse it too; say so here rather than with a 500.
        raise APIError(400, f"invalid request body: {e}") from None
    if hashes is None:
        raise APIError(404, f"model {body.get('model')!r} does not exist", "not_found_error")
    return await _route(router, path, body, hashes, raw, tenant, left, within, deadline)


async def readmit(
    router: Router,
    routed: RoutedRequest,
    raw: bytes,
    tenant: str,
    left: Left,
    deadline: float,
) -> RoutedRequest:
    """A request none of whose engines could be reached (they are ejected now): decided
    again over the fleet as it is, held as for an empty pool until `deadline` (its first
    one: engines that come and go cannot keep it forever)."""
    if router.clock() >= deadline:
        raise refusal(router, router.flow.label(model_of(router.config, routed.body)), "deadline")
    return await _route(
        router, routed.path, routed.body, routed.hashes, raw, tenant, left, None, deadline
    )


async def _route(
    router: Router,
    path: str,
    body: dict,
    hashes: dict,
    raw: bytes,
    tenant: str,
    left: Left,
    within: Collection[str] | None,
    deadline: float | None,
) -> RoutedRequest:
    try:
        routed = router.decide(path, body, router.serving_role(), hashes, within)
        model = model_of(router.config, body)
        if router.flow.must_hold(model, routed.candidates):
            await hold(router, model, tenant, left, deadline)
            routed = router.decide(path, body, router.serving_role(), hashes, within)
    except (TypeError, AttributeError, ValueError, KeyError) as e:
        raise APIError(400, f"invalid request body: {e}") from None
    if not routed.candidates:
        raise APIError(503, "no engine can serve this request", "service_unavailable")
    routed.payload = raw
    return routed


CLIENT_LEFT = 499  # nginx's status for a client that closed its request: nobody reads it


async def hold(
    router: Router, model: str, tenant: str, left: Left, deadline: float | None = None
) -> None:
    """Hold a request until the release loop finds an engine for it, at most until `deadline`
    (default: the queue timeout from now). Raises APIError: 503 when the queue is full or the
    deadline passes, CLIENT_LEFT when the client went away (which takes it out of the queue
    at once)."""
    flow = router.flow
    now = router.clock()
    deadline = now + flow.config.queue_timeout if deadline is None else deadline
    if now >= deadline:
        raise refusal(router, flow.label(model), "deadline")
    waiter = asyncio.get_running_loop().create_future()
    held = flow.hold(model, tenant, waiter, now, deadline)
    if held is None:
        raise refusal(router, flow.label(model), "full")
    gone = asyncio.ensure_future(left())
    try:
        await asyncio.wait(
            {waiter, gone},
            timeout=deadline - now + HOLD_BACKSTOP_S,
            return_when=asyncio.FIRST_COMPLETED,
        )
        client_left = gone.done()
    finally:
        gone.cancel()
        if not waiter.done():  # the client left, or this coroutine was cancelled
            flow.leave(held)
            waiter.cancel()
    if waiter.cancelled():
        if client_left:
            raise APIError(CLIENT_LEFT, "the client left while held", "client_closed_request")
        raise refusal(router, held.model, "deadline")
    if waiter.result() is not None:
        raise refusal(router, held.model, waiter.result())
    router.metrics.queue_wait.labels(held.model).observe(router.clock() - held.enqueued_at)


def refusal(router: Router, label: str, reason: str) -> APIError:
    """The 503 for a held request (counted): its queue was full or its deadline passed."""
    router.metrics.queue_rejections.labels(label, reason).inc()
    message = {
        "full": "too many requests are waiting for an engine of this model",
        "deadline": "no engine of this model could take the request in time",
    }[reason]
    return APIError(
        503,
        f"{message}; retry later",
        "service_unavailable",
        None,
        {"Retry-After": str(RETRY_AFTER_S)},
    )


async def release_loop(router: Router) -> None:
    """Every scrape interval while requests are held: refuse those past their deadline, and
    release what the ready pods can take (a scrape or discovery found capacity)."""
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


async def disaggregate(
    router: Router, client: httpx.AsyncClient, routed: RoutedRequest, left: Left
) -> None:
    """Have a prefill pod compute the prompt if the request is worth it; on success the
    request to the decode pod carries the prefill pod's kv_transfer_params, signed (in
    `routed.payload` and `routed.headers`). `routed.outcome` is CLIENT_LEFT if the client went
    away meanwhile."""
    routed.pd = await _prefill(router, client, routed, left)
    if routed.pd is not None:
        router.metrics.pd.labels(routed.pd).inc()


def wants_prefill(router: Router, routed: RoutedRequest) -> bool:
    """Whether the P/D decision applies: only a decode pod pulls blocks (a colocated pod may
    have no KV connector), and only if there are prefill pods."""
    return routed.candidates[0].pod.role == "decode" and router.registry.has_role("prefill")


async def _prefill(
    router: Router, client: httpx.AsyncClient, routed: RoutedRequest, left: Left
) -> str | None:
    """The P/D decision, after running the prefill if it is worth one; None if the client
    left meanwhile."""
    config = router.config
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
            client,
            attempt.candidate.pod.url,
            routed.path,
            routed.body,
            routed.headers,
            config.prefill_timeout,
            router.signer,
        )
    )
    gone = asyncio.ensure_future(left())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        router.hooks.finish(routed, attempt, _prefill_outcome(task))
        if not task.done():  # the client left: closing the connection aborts the prefill
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    result = task.result()
    if result.kv_transfer_params is None:
        if result.gone:
            router.registry.eject(attempt.pod_name, "its connection failed")
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
