"""A local fleet from `pagefleet up` (colocated + prefill + decode engines, router), used the way
clients use it: the OpenAI SDK, hundreds of streams with some clients leaving, and engines or
the router dying under it. Nothing may be lost or leaked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal

import httpx
import openai
import pytest

from fleet_utils import (
    events_endpoints,
    fleet_curve,
    fleet_up,
    idle,
    metric,
    pids_of,
    tiny_model,
    wait_until,
)

SHORT = ["What is a KV cache?", "Name a prime.", "block table", "Why page attention?"]
__all__ = ["tiny_model"]  # a fixture, imported for pytest
LONG = " ".join(f"history{i % 29} of the chat so far" for i in range(45))  # ~650 tokens
OTHER_LONG = " ".join(f"story{i % 31} about the pages of a cache" for i in range(60))  # ~580


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    with fleet_up(tmp_path_factory.mktemp("fleet"), "--model", tiny_model) as children:
        yield children


@pytest.fixture(scope="module")
def fleet_events(fleet):
    """The fleet's engines' KV events, in a prefix index of the test's own."""
    with _events_of(fleet) as index:
        yield index


@pytest.fixture(scope="module")
def offline(tiny_model):
    """Greedy outputs of one engine, offline: what every path through the fleet must give."""
    from pagefleet.engine.llm import LLM
    from pagefleet.engine.sampling_params import SamplingParams

    llm = LLM(tiny_model, max_model_len=1024, kv_cache_memory=0.25)
    tok = llm.get_tokenizer()
    cache: dict = {}

    def reference(prompt: str | list[dict], max_tokens: int) -> str:
        key = (json.dumps(prompt), max_tokens)
        if key not in cache:
            if isinstance(prompt, list):
                ids = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
                prompt = list(ids if isinstance(ids, list) else ids["input_ids"])
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            cache[key] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        return cache[key]

    return reference


def test_openai_sdk_streams_through_the_router_as_one_engine_would(fleet, offline):
    router = fleet["router"]["url"]
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["demo"]
    disaggregated = 0.0
    # Long prompts go through a prefill engine when the router picks the decode engine over
    # the colocated one for them (by load, ties at random): a few variants make that sure.
    longs = [f"v{k} {LONG}" for k in range(8)]  # distinct from the first token on
    for content in [*SHORT, *longs]:
        messages = [{"role": "user", "content": content}]
        stream = client.chat.completions.create(
            model="demo", messages=messages, stream=True, max_tokens=12, temperature=0
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == offline(messages, 12), content[:30]
        disaggregated = metric(
            router, "pagefleet_router:pd_decisions_total", outcome="disaggregated"
        )
        if content in longs and disaggregated:
            break
    # The long prompt was worth a prefill engine: its blocks crossed over to the decode engine.
    assert disaggregated >= 1
    assert metric(fleet["decode"]["url"], "pagefleet:kv_transfer_bytes_total") > 0


async def _client(router: str, prompt: str, max_tokens: int, leave_after: int | None, out: list):
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["stream"] = True
    text, chunks = "", 0
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", f"{router}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return  # the client leaves mid-stream: closing the connection
    # A leaver whose stream ended first (the server may send several tokens in one chunk to a
    # client that reads slowly) completed too: it is counted apart from the stayers.
    out.append((prompt, text, leave_after is None))


def test_200_concurrent_streams_with_20_percent_leaving_leak_nothing(fleet, offline):
    router = fleet["router"]["url"]
    rng = random.Random(0)
    prompts = [*SHORT, *(f"question {i}: explain pages" for i in range(6)), LONG, LONG + " more"]
    done: list = []
    clients = []
    for i in range(200):
        leave = rng.randint(0, 6) if i % 5 == 0 else None
        clients.append(_client(router, rng.choice(prompts), 16, leave, done))

    async def run_all():
        await asyncio.wait_for(asyncio.gather(*clients), timeout=400)

    asyncio.run(run_all())
    assert sum(stayed for _, _, stayed in done) == 160  # every client that stayed got its text
    for prompt, text, _ in done:
        assert text == offline(prompt, 16), prompt[:30]
    for name, child in fleet.items():
        if name != "router":
            wait_until(lambda c=child: idle(c["url"]), 10, f"{name} to be idle and hold nothing")


async def _stream_until_done(router: str, prompt: str) -> str:
    """'done', 'error' (an SSE error event or a cut stream) — never a hang."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": 300, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    try:
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{router}/v1/completions", json=body) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith('data: {"error"'):
                    return "error"
                if line == "data: [DONE]":
                    return "done"
    except httpx.HTTPError:
        pass
    return "error"


def test_engines_and_router_dying_under_load(fleet, offline, fleet_events):
    router = fleet["router"]["url"]
    prefill = fleet["prefill"]["url"]

    # 1. Kill a decoding engine mid-stream (the decode engine if the router gave it streams,
    #    else the colocated one): its clients get a clean error, the others finish.
    async def streams_with_kill():
        tasks = [
            asyncio.ensure_future(_stream_until_done(router, f"long answer {i}")) for i in range(6)
        ]
        loads: dict[str, float] = {}

        def some_running() -> bool:
            for name in ("decode", "engine-0"):
                loads[name] = metric(fleet[name]["url"], "vllm:num_requests_running")
            return sum(loads.values()) > 0

        await asyncio.to_thread(wait_until, some_running, 60, "streams to start")
        victim = "decode" if loads["decode"] else "engine-0"
        os.kill(pids_of({victim: fleet[victim]})[victim], signal.SIGKILL)
        return victim, dict(loads), await asyncio.wait_for(asyncio.gather(*tasks), 180)

    victim, loads, outcomes = asyncio.run(streams_with_kill())
    assert "error" in outcomes and set(outcomes) <= {"error", "done"}, outcomes
    if all(loads.values()):  # streams on both engines: the survivor's finished
        assert "done" in outcomes, outcomes
    for prompt in SHORT:  # new requests succeed on the engines left
        r = httpx.post(f"{router}/v1/completions", timeout=120, json=_body(prompt))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(prompt, 8)

    # ... and once the supervisor has restarted it, the router admits it again and sends it
    # what it is the better pick for: prompts it alone holds (prefix affinity). Short prompts
    # could go to either engine by load and tie-break: they proved nothing (and flaked).
    restarted = fleet[victim]["url"]
    wait_until(lambda: _healthy(restarted), 120, f"{victim} to be restarted")
    probes = iter(range(10_000))
    wait_until(
        lambda: _routed_to_holder(
            router, fleet[victim], f"probe {next(probes)} {LONG}", "", offline, fleet_events
        ),
        120,
        f"the router to send the restarted {victim} a prompt it holds",
    )

    # 2. Kill the prefill engine: long prompts fall back to prefilling on the decode side.
    #    First a prefix the router knows only the decode engine holds (a long prompt after it
    #    goes there, through the prefill engine); then, the instant the prefill engine is
    #    dead (before its supervisor restarts it), another long prompt after that prefix.
    decode = fleet["decode"]["url"]
    warm = iter(range(10_000))
    held = ""

    def decode_holds_a_prefix() -> bool:
        nonlocal held
        held = f"w{next(warm)} {SHORT[3]} " * 8
        return _routed_to_holder(router, fleet["decode"], held, LONG, offline, fleet_events)

    wait_until(decode_holds_a_prefix, 120, "the router to send the decode engine its prefix")
    skipped = _skipped_prefills(router)
    os.kill(pids_of({"prefill": fleet["prefill"]})["prefill"], signal.SIGKILL)
    before = metric(router, "pagefleet_router:requests_total", pod=decode.removeprefix("http://"))
    prompt = held + OTHER_LONG
    r = httpx.post(f"{router}/v1/completions", timeout=120, json=_body(prompt))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(prompt, 8)
    pod = decode.removeprefix("http://")
    assert metric(router, "pagefleet_router:requests_total", pod=pod) == before + 1
    assert _skipped_prefills(router) == skipped + 1  # prefill_failed or no_prefill_pod
    wait_until(lambda: _healthy(prefill), 120, "prefill to be restarted")

    # 3. Kill the router: clients retry until the restarted router answers; engines leak nothing.
    os.kill(pids_of({"router": fleet["router"]})["router"], signal.SIGKILL)
    wait_until(lambda: _healthy(router), 120, "the router to be restarted")
    r = httpx.post(f"{router}/v1/completions", timeout=120, json=_body(SHORT[0]))
    assert r.json()["choices"][0]["text"] == offline(SHORT[0], 8)
    for name, child in fleet.items():
        if name != "router":
            wait_until(lambda c=child: idle(c["url"]), 15, f"{name} to be idle")


def _routed_to_holder(router: str, child: dict, held: str, rest: str, offline, events) -> bool:
    """Send `held` to the engine directly and wait until its KV events for it are out (the
    router reads the same stream: on a busy machine it could route before they arrived, every
    time), then `held + rest` through the router: True if the router sent it to that engine
    (the right answer either way). False while the router has not yet applied the events
    (then the caller tries a new prompt: one routed elsewhere is cached there too, and would
    tie)."""
    engine = child["url"]
    assert httpx.post(f"{engine}/v1/completions", timeout=120, json=_body(held)).status_code == 200
    r = httpx.post(f"{engine}/tokenize", timeout=60, json={"model": "demo", "prompt": held})
    tokens = r.json()["tokens"]
    wait_until(
        lambda: _published(events, [tokens], child["name"]), 30, f"{child['name']}'s KV events"
    )
    pod = engine.removeprefix("http://")
    before = metric(router, "pagefleet_router:requests_total", pod=pod)
    r = httpx.post(f"{router}/v1/completions", timeout=120, json=_body(held + rest))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(held + rest, 8)
    return metric(router, "pagefleet_router:requests_total", pod=pod) == before + 1


def _skipped_prefills(router: str) -> float:
    return sum(
        metric(router, "pagefleet_router:pd_decisions_total", outcome=o)
        for o in ("prefill_failed", "no_prefill_pod")
    )


def _body(prompt: str) -> dict:
    return {"model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0}


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _events_of(children: dict):
    """A prefix index fed by every engine's KV events, from their replay buffers on (so a
    late subscriber misses nothing), as the router's is (with the fleet's CurveZMQ keys)."""
    from pagefleet.router.kv_subscriber import KVEventSubscriber
    from pagefleet.router.prefix_index import PrefixIndex

    index = PrefixIndex("precise")
    curve = fleet_curve(children)
    subscribers = [
        KVEventSubscriber(
            name, endpoint, index.apply, index.remove_pod, _replay(endpoint), curve
        ).start(catch_up_ms=200)
        for name, endpoint in events_endpoints(children).items()
    ]
    try:
        yield index
    finally:
        for sub in subscribers:
            sub.stop()


def _published(index, prefixes: list[list[int]], engine: str | None = None) -> bool:
    """Every prefix's blocks are in the published events of one engine (`engine`, or any)."""
    from pagefleet.common.block_hash import hash_blocks

    def held(prefix: list[int]) -> int:
        holders = index.match(hash_blocks(prefix, 16), now=0)
        return holders.get(engine, 0) if engine else max(holders.values(), default=0)

    return all(held(p) == len(p) // 16 for p in prefixes)


def _replay(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + 1}"


def test_simulated_fleet_of_8_routes_shared_prefixes_to_one_engine(tmp_path, tiny_model):
    with (
        fleet_up(tmp_path, "--simulate", "--engines", "8", "--model", tiny_model) as children,
        _events_of(children) as published,
    ):
        router = children["router"]["url"]
        engines = [c["url"] for n, c in children.items() if n != "router"]
        assert len(engines) == 8
        rng = random.Random(1)
        groups = [[rng.randrange(10, 500) for _ in range(480)] for _ in range(4)]
        for turn in range(5):
            for prefix in groups:
                prompt = prefix + [rng.randrange(10, 500) for _ in range(24)]
                body = {"model": "demo", "prompt": prompt, "max_tokens": 2}
                assert httpx.post(f"{router}/v1/completions", json=body, timeout=60).is_success
            if turn == 0:  # the first turn's blocks are published (the router reads the same
                wait_until(  # stream; until then its speculative entries route the next turns)
                    lambda: _published(published, [g[:480] for g in groups]),
                    30,
                    "the engines' KV events for the first turn",
                )
        hits = sum(metric(e, "vllm:prefix_cache_hits_total") for e in engines)
        queries = sum(metric(e, "vllm:prefix_cache_queries_total") for e in engines)
        # After each group's first request, its 480-token prefix (30 blocks) must be found:
        # 4 groups x 4 later turns x 480 tokens of 4 x 5 x 504 queried.
        assert hits >= 0.95 * 4 * 4 * 480, (hits, queries)
        used = sum(1 for e in engines if metric(e, "vllm:prefix_cache_queries_total") > 0)
        assert used >= 2  # groups spread over engines rather than piling onto one
