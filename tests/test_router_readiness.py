"""An engine that is not there costs the client nothing: the router routes only to engines it has
scraped, ejects one at once when its connection is refused before the first byte (retrying the
request elsewhere, or holding it as for an empty pool), and answers /v1/models at zero engines.

Before (issue 37): a request sent while the only engine was still starting got 502 at once, and
so did one sent after an engine died and before three failed scrapes ejected it. The scrape
interval here is long (1-2 s, ejection after 3 failures), so a test that sends its request at
once meets that window on the old code every time."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx

from fake_engine import FakeEngine, wait_scraped
from pagefleet.router.app import Router, RouterConfig, build_router_app
from pagefleet.router.flow_control import FlowConfig
from pagefleet.router.pods import PodRegistry
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scoring import Pipeline, Pod
from server_utils import metric_value, running_router, wait_until

SLOW_SCRAPES = ("--model", "tiny", "--scrape-interval", "1")


def queued(router: str) -> float:
    return metric_value(router, "pagefleet_router:queued_requests", {"model": "tiny"})


def ejections(router: str) -> float:
    return metric_value(router, "pagefleet_router:ejections_total")


def complete(router: str, prompt: str = "hello") -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    return httpx.post(f"{router}/v1/completions", json=body, timeout=60)


def in_background(router: str) -> tuple[threading.Thread, list[httpx.Response]]:
    results: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: results.append(complete(router)), daemon=True)
    thread.start()
    return thread, results


def test_a_pod_is_routed_to_only_after_a_good_scrape_and_ejected_at_once_on_request():
    """The registry's rules without a process: not ready until a scrape answers; `eject` takes
    a pod out at once (counted, its prefix entries dropped) until /health passes again."""
    answers = {"/metrics": 200, "/health": 200}

    def engine(request: httpx.Request) -> httpx.Response:
        status = answers.get(request.url.path, 404)  # /v1/models: no adapters to list
        return httpx.Response(status, text="vllm:num_requests_waiting 0\n")

    registry = PodRegistry()
    lost: list[str] = []
    registry.on_lost = lost.append
    registry.set_pods([Pod("a", "http://a")])
    assert [p.healthy for p in registry.pods(0.0)] == [False]

    async def scrape() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
            await registry._scrape(client, registry.status["a"])

    answers["/metrics"] = 503  # loading: still not ready, and not ejected by one failure
    asyncio.run(scrape())
    assert [p.healthy for p in registry.pods(0.0)] == [False] and registry.ejections == 0
    answers["/metrics"] = 200
    asyncio.run(scrape())
    assert [p.healthy for p in registry.pods(0.0)] == [True]
    registry.eject("a", "connection refused")
    registry.eject("a", "connection refused")  # one ejection, however many requests saw it
    assert [p.healthy for p in registry.pods(0.0)] == [False]
    assert (registry.ejections, lost) == (1, ["a"])
    answers["/health"] = 503
    asyncio.run(scrape())
    assert [p.healthy for p in registry.pods(0.0)] == [False]
    answers["/health"] = 200
    asyncio.run(scrape())
    assert [p.healthy for p in registry.pods(0.0)] == [True]


# --- in process: the proxy's attempts against scripted engines ------------------------------


def ready_router(flow: FlowConfig | None = None) -> Router:
    """Two scraped pods, "dead" preferred on load (no tie-break decides)."""
    registry = PodRegistry()
    registry.set_pods([Pod("dead", "http://dead"), Pod("live", "http://live")])
    for status in registry.status.values():
        status.ready = True
    registry.status["live"].pod.waiting = 5.0
    pipeline = Pipeline.from_config({"scorers": {"queue": 1.0}})
    config = RouterConfig(flow=flow or FlowConfig())
    return Router(registry, PrefixIndex("approximate"), pipeline, config, clock=lambda: 0.0)


def engines(tried: list[str], tenants: list[str | None] | None = None):
    def answer(request: httpx.Request) -> httpx.Response:
        tried.append(request.url.host)
        if tenants is not None:
            tenants.append(request.headers.get("x-tenant-id"))
        if request.url.host == "dead":
            raise httpx.ConnectError("connection refused", request=request)
        body = json.dumps({"id": request.url.host}).encode()
        headers = {"content-type": "application/json"}
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(body))

    return httpx.MockTransport(answer)


async def send(
    router: Router, transport: httpx.MockTransport, count: int, headers: dict | None = None
) -> list[httpx.Response]:
    app = build_router_app(router, client=httpx.AsyncClient(transport=transport))
    asgi = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=asgi, base_url="http://router") as client:
        body = {"model": "m", "prompt": "hello"}
        return [
            await client.post("/v1/completions", json=body, headers=headers) for _ in range(count)
        ]


def metric(router: Router, name: str) -> float:
    return router.metrics.registry.get_sample_value(name) or 0.0


def test_a_refused_connection_ejects_the_engine_at_once_and_retries_elsewhere():
    """The preferred engine refuses: the request is retried on the other, and the refusing
    one is ejected at once, so the next request goes straight to the live one. Fails on the
    old code: the dead engine kept its turn (a retry per request) until three scrapes failed."""
    router, tried = ready_router(), []
    answers = asyncio.run(send(router, engines(tried), 2))
    assert [r.json()["id"] for r in answers] == ["live", "live"]
    assert tried == ["dead", "live", "live"]
    assert metric(router, "pagefleet_router:ejections_total") == 1
    assert metric(router, "pagefleet_router:retries_total") == 1


def test_without_holding_a_refused_request_gets_503_with_retry_after_not_502():
    """--queue-size 0 holds nothing: when every engine tried refused, no engine saw the
    request, so the client gets a retryable 503 with Retry-After, never a 502."""
    router, tried = ready_router(FlowConfig(queue_size=0)), []
    router.registry.status["live"].ready = False  # only the dead one is left to try
    (answer,) = asyncio.run(send(router, engines(tried), 1))
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"].isdigit()
    assert answer.json()["error"]["type"] == "service_unavailable"
    assert tried == ["dead"]


def test_the_tenant_header_reaches_the_engine():
    """An engine's grammar compiles take turns by tenant: the router forwards the tenant
    header (its own flow control's key) with every attempt."""
    router, tried, tenants = ready_router(), [], []
    headers = {"x-tenant-id": "team-a"}
    asyncio.run(send(router, engines(tried, tenants), 1, headers))
    assert tried == ["dead", "live"] and tenants == ["team-a", "team-a"]


# --- a real router: the windows the old code left open -------------------------------------


def test_before_the_first_scrape_a_request_is_held_and_models_are_listed():
    """The engine is still starting when the router starts: /v1/models lists --model's card,
    and a request is held (the gauge shows it), then served once the engine is up; /v1/models
    then gives the engine's own card, and still does once the engine is gone. Fails on the old
    code: 503 for /v1/models, and 502 at once for the request (the unscraped engine counted
    as ready, and its closed port refused the request)."""
    engine = FakeEngine("late")
    with running_router("--endpoints", engine.url, *SLOW_SCRAPES) as (router, _):
        before = httpx.get(f"{router}/v1/models", timeout=10)
        assert before.status_code == 200, before.text
        assert [m["id"] for m in before.json()["data"]] == ["tiny"]
        thread, results = in_background(router)
        wait_until(lambda: queued(router) == 1 or results, what="the request held")
        assert not results, results[0].text
        with engine:
            thread.join(timeout=60)
            assert [r.status_code for r in results] == [200], results[0].text
            assert results[0].json()["id"] == "late" and len(engine.received) == 1
            seen = httpx.get(f"{router}/v1/models", timeout=10).json()
            assert seen["data"][0]["owned_by"] == "late"  # the engine's own card
        after = httpx.get(f"{router}/v1/models", timeout=10)
        assert after.status_code == 200 and after.json() == seen


def test_with_every_engine_gone_a_request_is_held_until_one_is_back():
    """The only engine dies and a request comes before any scrape noticed: the refused
    connection ejects it at once and the request is held, then served by the engine that
    comes back on its address. Fails on the old code with 502."""
    with FakeEngine("first") as first:
        flags = ("--endpoints", first.url, *SLOW_SCRAPES)
        with running_router(*flags) as (router, _):
            wait_scraped(first)
            first.__exit__()  # its port now refuses connections
            thread, results = in_background(router)
            wait_until(lambda: queued(router) == 1 or results, what="the request held")
            assert not results, results[0].text
            assert ejections(router) == 1
            with FakeEngine("back", port=first.port) as back:
                thread.join(timeout=60)
                assert [r.status_code for r in results] == [200], results[0].text
                assert results[0].json()["id"] == "back" and len(back.received) == 1
