"""The router in-process (the app over mock engines): what a request sent to a pod books is
settled once its outcome is known, and the key check refuses before reading a body."""

from __future__ import annotations

import asyncio
import json

import httpx

from pagefleet.router.app import build_router_app
from pagefleet.router.core import Router, RouterConfig
from pagefleet.router.pods import PodRegistry
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.routed import Outcome
from pagefleet.router.scoring import Pipeline, Pod

PROMPT = "a prompt long enough for a few blocks of routing hashes " * 8


def _router(index: PrefixIndex) -> Router:
    """Two pods, "down" preferred on load: the choice depends on no tie-break."""
    registry = PodRegistry()
    registry.set_pods([Pod("down", "http://down"), Pod("up", "http://up")])
    for status in registry.status.values():
        status.scraped_at = 0.0  # fresh at the router's clock
        status.ready = True  # as after a good scrape
    registry.status["up"].pod.waiting = 5.0
    pipeline = Pipeline.from_config({"scorers": {"queue": 1.0}})
    return Router(registry, index, pipeline, RouterConfig(), clock=lambda: 0.0)


def _engines(request: httpx.Request) -> httpx.Response:
    if request.url.host == "down":
        return httpx.Response(503, json={"error": {"message": "overloaded"}})
    # A stream, as a real engine's answer is (the router relays it raw).
    body = json.dumps({"choices": [{"text": "ok"}]}).encode()
    return httpx.Response(
        200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(body)
    )


async def _complete(router: Router) -> httpx.Response:
    engines = httpx.AsyncClient(transport=httpx.MockTransport(_engines))
    app = build_router_app(router, client=engines)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
    await engines.aclose()
    return response


def _metric(router: Router, name: str, labels: dict | None = None) -> float:
    value = router.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_a_refused_request_gives_its_blocks_back_and_every_pod_its_load():
    """Catches bookkeeping skipped on an outcome: an in-flight count that never falls back
    skews every later decision, and blocks predicted on a pod that never took the request
    pull that prompt's later requests towards it."""
    index = PrefixIndex("approximate")
    router = _router(index)
    response = asyncio.run(_complete(router))
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ok"
    hashes = router.prompt_hashes("/v1/completions", {"prompt": PROMPT}, 16)
    assert len(hashes) > 2
    assert index.match(hashes, now=0.0) == {"up": len(hashes)}  # "down" gave its blocks back
    for status in router.registry.status.values():
        assert (status.pod.inflight, status.pod.active_blocks) == (0, 0)
    assert _metric(router, "pagefleet_router:retries_total") == 1
    for pod in ("down", "up"):
        assert _metric(router, "pagefleet_router:requests_total", {"pod": pod}) == 1


def test_an_attempt_is_settled_once_whatever_reports_its_outcome():
    """Catches a double settle (a relay's end after a failure path already settled): the
    pod's in-flight count would go negative and it would attract more than its share."""
    router = _router(PrefixIndex("approximate"))
    routed = router.decide("/v1/completions", {"model": "m", "prompt": PROMPT})
    assert [c.pod.name for c in routed.candidates] == ["down", "up"]
    attempt = router.hooks.dispatch(routed, routed.candidates[0])
    pod = routed.candidates[0].pod
    assert (pod.inflight, pod.active_blocks) == (1, routed.blocks)
    router.hooks.finish(routed, attempt, Outcome.CLIENT_LEFT)
    router.hooks.finish(routed, attempt, Outcome.RELAYED)
    assert (pod.inflight, pod.active_blocks) == (0, 0)
    assert routed.outcome is Outcome.CLIENT_LEFT and routed.chosen is routed.candidates[0]


def test_without_the_key_no_body_is_read_and_no_engine_is_reached():
    """The router's key check (plain ASGI since issue 23) answers 401 before it reads a byte of
    the body, whatever the path; probes and /metrics stay open; with the key, requests pass."""
    seen: list[str] = []

    def engines(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return _engines(request)

    router = _router(PrefixIndex("approximate"))
    router.config = RouterConfig(api_key="k")
    app = build_router_app(router, client=httpx.AsyncClient(transport=httpx.MockTransport(engines)))

    async def status_of(path: str, headers: list[tuple[bytes, bytes]]) -> int:
        sent: list[dict] = []

        async def receive() -> dict:
            raise AssertionError("the body of a client without the key was read")

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "headers": [(b"content-length", b"100000000"), *headers], "app": app,
            "server": ("router", 80), "client": ("client", 1),
        }  # fmt: skip
        await app(scope, receive, send)
        return sent[0]["status"]

    async def run() -> None:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/anything"):
            assert await status_of(path, []) == 401
            assert await status_of(path, [(b"authorization", b"Bearer wrong")]) == 401
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            for path in ("/livez", "/metrics"):
                assert (await client.get(path)).status_code == 200
            ok = await client.post(
                "/v1/completions",
                json={"model": "m", "prompt": PROMPT},
                headers={"authorization": "Bearer k"},
            )
            assert ok.status_code == 200

    asyncio.run(run())
    assert seen == ["/v1/completions", "/v1/completions"]  # "down" (503), then "up"


def test_embeddings_follow_their_first_inputs_blocks_onto_pods_that_cache_them():
    """An embeddings request is hashed by its first input, as a completion of that text would
    be; the pod it went to then attracts the next request opening alike over a little load
    (a last-token pooling engine caches prefixes), unless the pod's /metrics say it caches
    nothing (mean or CLS pooling): then load alone decides (issue 36)."""
    body = {"model": "m", "input": [PROMPT, "a second input"], "dimensions": 8}
    for caching in (True, False):
        router = _router(PrefixIndex("approximate"))
        router.pipeline = Pipeline.from_config({"scorers": {"prefix": 2.0, "queue": 1.0}})
        hashes = router.prompt_hashes("/v1/embeddings", body, 16)
        assert hashes == router.prompt_hashes("/v1/completions", {"prompt": PROMPT}, 16)
        assert hashes and router.prompt_hashes("/pooling", {"input": [[7] * 40]}, 16) == (
            router.prompt_hashes("/v1/completions", {"prompt": [7] * 40}, 16)
        )
        pods = {s.pod.name: s.pod for s in router.registry.status.values()}
        pods["down"].caches_prefixes = caching
        first = router.decide("/v1/embeddings", body)
        assert first.candidates[0].pod.name == "down"  # "up" has 5 waiting
        attempt = router.hooks.dispatch(first, first.candidates[0])
        router.hooks.finish(first, attempt, Outcome.RELAYED)
        pods["down"].waiting, pods["up"].waiting = 2.0, 1.0
        again = router.decide("/v1/embeddings", body)
        assert again.candidates[0].pod.name == ("down" if caching else "up")


def test_a_scrape_reads_whether_the_pod_caches_prefixes():
    def engine(request: httpx.Request) -> httpx.Response:
        caching = "True" if request.url.host == "last" else "False"
        return httpx.Response(
            200,
            text="vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="64",'
            f'enable_prefix_caching="{caching}",cache_dtype="float32"}} 1\n',
        )

    registry = PodRegistry()
    registry.set_pods([Pod("last", "http://last"), Pod("mean", "http://mean")])

    async def scrape() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
            for status in registry.status.values():
                await registry._scrape(client, status)

    asyncio.run(scrape())
    assert {s.pod.name: s.pod.caches_prefixes for s in registry.status.values()} == {
        "last": True,
        "mean": False,
    }
