"""The router in front of real tiny-model engines: prefix affinity (approximate and precise),
streaming pass-through, failover when an engine dies."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from pagefleet.router.main import static_pods
from server_utils import (
    free_port_pair,
    metric_value,
    running_router,
    running_server,
    wait_until,
)

LONG = " ".join(f"word{i % 37} cache block" for i in range(90))  # ~250 tokens


def routed_pod(router: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(httpx.get(f"{router}/metrics").text):
        for s in family.samples:
            if s.name == "pagefleet_router:requests_total":
                counts[s.labels["pod"]] = s.value
    return counts


@contextlib.contextmanager
def fleet(path: str, n: int = 3, events: bool = False):
    with contextlib.ExitStack() as stack:
        engines, event_ports = [], []
        for _ in range(n):
            flags = ["--max-model-len", "1024"]
            if events:
                port = free_port_pair()  # events, and replay on the next port
                event_ports.append(port)
                flags += [
                    "--kv-events-config",
                    json.dumps(
                        {
                            "enable_kv_cache_events": True,
                            "endpoint": f"tcp://127.0.0.1:{port}",
                            "replay_endpoint": f"tcp://127.0.0.1:{port + 1}",
                        }
                    ),
                ]
            engines.append(stack.enter_context(running_server(path, *flags)))
        yield engines, event_ports


def test_static_endpoints_are_validated():
    pods = static_pods("http://a:1,http://b:2@prefill")
    assert [(p.name, p.role) for p in pods] == [("a:1", "both"), ("b:2", "prefill")]
    for bad in ("", "ftp://x", "http://a@chef"):
        with pytest.raises(ValueError):
            static_pods(bad)


def test_repeated_prompt_sticks_to_its_pod_and_hits_its_cache(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with fleet(path) as (engines, _):
        urls = ",".join(base for base, _ in engines)
        with running_router("--endpoints", urls, "--tokenizer", path) as (router, _):
            body = {"model": "tiny", "prompt": LONG, "max_tokens": 4, "temperature": 0}
            first = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
            assert first.status_code == 200
            (pod,) = routed_pod(router)
            engine = next(b for b, _ in engines if b.endswith(pod))
            hits_before = metric_value(engine, "vllm:prefix_cache_hits_total")
            # Other traffic in between does not move it.
            for i in range(4):
                httpx.post(
                    f"{router}/v1/completions",
                    timeout=60,
                    json={**body, "prompt": f"other prompt {i}"},
                )
            second = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
            assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
            assert metric_value(engine, "vllm:prefix_cache_hits_total") - hits_before >= 240
            assert routed_pod(router)[pod] >= 2
            # Streams pass through untouched, ending in [DONE]. (How many tokens share a chunk
            # depends on how fast the client reads: the text, not the chunk count, is checked.)
            with httpx.stream(
                "POST", f"{router}/v1/completions", timeout=60, json={**body, "stream": True}
            ) as r:
                lines = [x for x in r.iter_lines() if x.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 2
            chunks = [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]]
            assert "".join(chunks) == first.json()["choices"][0]["text"]


def test_precise_index_follows_engine_events(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with fleet(path, events=True) as (engines, ports):
        urls = ",".join(base for base, _ in engines)
        kv = ",".join(f"tcp://127.0.0.1:{p}" for p in ports)
        flags = (
            "--endpoints",
            urls,
            "--tokenizer",
            path,
            "--prefix-index",
            "precise",
            "--kv-events-endpoints",
            kv,
        )
        with running_router(*flags) as (router, _):
            # Warm the LAST engine directly, behind the router's back: only its KV events
            # can tell the router where this prefix lives.
            target, _ = engines[-1]
            pod = target.removeprefix("http://")
            body = {"model": "tiny", "prompt": LONG, "max_tokens": 2, "temperature": 0}
            assert httpx.post(f"{target}/v1/completions", json=body, timeout=60).status_code == 200
            # Then probes, each warmed on the target and routed once: the first routed to the
            # target as a prefix hit proves the router applied its events, and so (same stream,
            # in order) the first prompt's. A probe routed elsewhere pollutes only itself.
            probes = iter(range(1000))

            def probe_hits_the_target() -> bool:
                probe = {**body, "prompt": f"probe {next(probes)} {LONG}"}
                assert httpx.post(f"{target}/v1/completions", json=probe, timeout=60)
                hits = metric_value(router, "pagefleet_router:predicted_hit_blocks_total")
                sent = routed_pod(router).get(pod, 0)
                assert httpx.post(f"{router}/v1/completions", json=probe, timeout=60)
                return (
                    routed_pod(router).get(pod, 0) == sent + 1
                    and metric_value(router, "pagefleet_router:predicted_hit_blocks_total") > hits
                )

            wait_until(probe_hits_the_target, 30, "the target's KV events to reach the router")
            before = routed_pod(router)
            for _ in range(3):
                assert (
                    httpx.post(f"{router}/v1/completions", json=body, timeout=60).status_code == 200
                )
            after = routed_pod(router)
            moved = {name: after[name] - before.get(name, 0) for name in after}
            assert {name: n for name, n in moved.items() if n} == {pod: 3}


def test_requests_keep_succeeding_when_an_engine_dies(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with fleet(path) as (engines, _):
        urls = ",".join(base for base, _ in engines)
        with running_router("--endpoints", urls, "--tokenizer", path) as (router, _):
            body = {"model": "tiny", "prompt": LONG, "max_tokens": 3, "temperature": 0}
            assert httpx.post(f"{router}/v1/completions", json=body, timeout=60).status_code == 200
            (pod,) = routed_pod(router)
            victim = next(proc for base, proc in engines if base.endswith(pod))
            victim.kill()
            victim.wait(timeout=30)
            for i in range(6):  # the favourite pod is gone: retried elsewhere, then ejected
                r = httpx.post(
                    f"{router}/v1/completions", timeout=60, json={**body, "prompt": LONG + f" {i}"}
                )
                assert r.status_code == 200, r.text
            deadline = time.monotonic() + 5
            while metric_value(router, "pagefleet_router:ejections_total") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)


def test_router_refuses_bad_bodies_and_passes_keys_upstream(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with running_server(path, "--api-key", "engine-key") as (engine, _):
        flags = (
            "--endpoints",
            engine,
            "--tokenizer",
            path,
            "--upstream-api-key",
            "engine-key",
            "--api-key",
            "router-key",
        )
        with running_router(*flags) as (router, _):
            auth = {"Authorization": "Bearer router-key"}
            assert httpx.get(f"{router}/v1/models").status_code == 401
            # Every operation the router declares (embeddings, pooling, tokenize... as well as
            # generation) refuses a keyless or wrong-keyed client before it reads the body.
            spec = httpx.get(f"{router}/openapi.json", headers=auth).json()
            operations = [(m, p) for p, ops in spec["paths"].items() for m in ops]
            assert ("post", "/v1/embeddings") in operations, operations
            for method, route in operations:
                if route in ("/health", "/livez", "/metrics"):  # probes and scrapes stay open
                    continue
                for headers in ({}, {"Authorization": "Bearer engine-key"}):
                    r = httpx.request(method, f"{router}{route}", json={}, headers=headers)
                    assert r.status_code == 401, (method, route, headers, r.text)
            models = httpx.get(f"{router}/v1/models", headers=auth)
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
            for body in ({"messages": ["hi"]}, {"messages": "x"}, {"prompt": 5}, [1, 2]):
                url = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
                r = httpx.post(f"{router}{url}", json=body, headers=auth)
                assert r.status_code == 400, (body, r.text)
                assert r.json()["error"]["code"] == 400
            ok = httpx.post(
                f"{router}/v1/completions",
                headers=auth,
                timeout=60,
                json={"prompt": "hello", "max_tokens": 3},
            )
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_client_leaving_a_non_streaming_request_aborts_it_on_the_engine(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with (
        running_server(
            path,
            "--simulate",
            "--simulate-profile",
            '{"decode_s_per_seq": 0.05}',
            "--max-model-len",
            "1024",
        ) as (engine, _),
        running_router("--endpoints", engine, "--tokenizer", path) as (router, _),
    ):
        body = {"prompt": "slow one", "max_tokens": 900, "ignore_eos": True}
        for _ in range(2):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{router}/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 5
        while metric_value(engine, "vllm:num_requests_running") > 0:
            assert time.monotonic() < deadline, "the engine kept generating for nobody"
            time.sleep(0.1)
        assert metric_value(router, "pagefleet_router:inflight", {"pod": engine[7:]}) == 0


def test_a_client_leaving_a_stream_through_the_router_aborts_it_on_the_engine(tiny_checkpoints):
    """A streaming client reads a few tokens through the router and leaves: the router closes
    its upstream stream, the engine aborts the request (running drops to 0, one abort counted)
    long before its 900 tokens. Fails for: a relay that keeps reading the upstream stream after
    the client left (e.g. a pump task nobody cancels): the engine generates for nobody. (Not
    for dropping `response.aclose()` alone: httpcore closes a connection whose read was
    cancelled, so that mutant behaves the same.)"""
    path = tiny_checkpoints["llama"]
    profile = '{"decode_s_per_seq": 0.05}'
    with (
        running_server(
            path, "--simulate", "--simulate-profile", profile, "--max-model-len", "1024"
        ) as (engine, _),
        running_router("--endpoints", engine, "--tokenizer", path) as (router, _),
    ):
        body = {"prompt": "slow one", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as r:
            # The line iterator stays open until the check: breaking out of a `for` over it
            # closes it, and with it the connection (the client would have left already).
            lines = r.iter_lines()
            chunks = 0
            while chunks < 3:
                chunks += next(lines).startswith("data: {")
            assert metric_value(engine, "vllm:num_requests_running") == 1  # still generating
        # Leaving the block closes the connection: the client is gone.
        deadline = time.monotonic() + 10
        while metric_value(engine, "vllm:num_requests_running") > 0:
            assert time.monotonic() < deadline, "the engine kept generating for nobody"
            time.sleep(0.1)
        aborted = {"finished_reason": "abort"}
        assert metric_value(engine, "vllm:request_success_total", aborted) == 1
        assert metric_value(engine, "vllm:generation_tokens_total") < 900
        assert metric_value(router, "pagefleet_router:inflight", {"pod": engine[7:]}) == 0
