"""Disaggregated prefill/decode end to end: a prefill engine, a decode engine (separate
processes) and the router; greedy output equals colocated output over NIXL and TCP, only
missing blocks cross the wire, and every fault ends in a correct answer (or a clean abort)
with no block left held on either side."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagefleet.common.fleet_auth import FieldSigner
from pagefleet.engine.llm import LLM
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.router.pd import release_prefill, signed_headers
from server_utils import (
    FLEET_ENV,
    fleet_secret,
    free_port,
    metric_value,
    running_router,
    running_server,
    wait_until,
)

MAX_LEN = 1024
SHARED = list(range(3, 203))  # a 200-token shared prefix
PROMPTS = (
    [[5, 6, 7], list(range(10, 40))]  # short: the decode pod serves them alone
    + [SHARED + [300 + i] * (i + 1) for i in range(8)]  # shared prefix, different tails
    + [list(range(20 + i, 420 + i)) for i in range(4)]  # long, distinct
    + [list(range(7, 90)), SHARED[:64], SHARED + SHARED[:37]]  # block-aligned and odd lengths
)
MAX_TOKENS = 8


def kv_flags(connector: str, role: str, port: int = 0, **extra) -> list[str]:
    config = {"kv_connector": connector, "kv_role": role, "kv_port": port or free_port(), **extra}
    return ["--kv-transfer-config", json.dumps(config), "--max-model-len", str(MAX_LEN)]


@pytest.fixture(scope="module")
def colocated(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], max_model_len=MAX_LEN, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    llm.engine.close()
    return [o.outputs[0].text for o in outs]


@contextlib.contextmanager
def pd_fleet(path: str, connector: str, threshold: int = 48):
    with (
        running_server(path, *kv_flags(connector, "kv_producer"), env=FLEET_ENV) as (
            prefill,
            p_proc,
        ),
        running_server(path, *kv_flags(connector, "kv_consumer"), env=FLEET_ENV) as (decode, _),
        running_router(
            "--endpoints",
            f"{prefill}@prefill,{decode}@decode",
            "--pd-threshold-tokens",
            str(threshold),
            env=FLEET_ENV,
        ) as (router, _),
    ):
        yield prefill, decode, router, p_proc


def complete(router: str, prompt: list[int], stream: bool = False, **extra) -> str:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    if not stream:
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{router}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def pd_decisions(router: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{router}/metrics", timeout=5).text
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pagefleet_router:pd_decisions_total"
    }


def assert_nothing_held(prefill: str, decode: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        held = metric_value(prefill, "pagefleet:kv_transfer_held_blocks")
        usage = [metric_value(b, "vllm:kv_cache_usage_perc") for b in (prefill, decode)]
        running = metric_value(decode, "vllm:num_requests_running")
        if held == 0 and usage == [0.0, 0.0] and running == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"held {held} blocks, usage {usage}, running {running}")
        time.sleep(0.1)


@pytest.mark.parametrize("connector", ["nixl", "tcp"])
def test_pd_output_equals_colocated_output(tiny_checkpoints, colocated, connector):
    # Threshold 0: every request goes through the prefill pod, short ones and ones whose
    # prefix the decode pod already caches (it then pulls only the rest).
    with pd_fleet(tiny_checkpoints["llama"], connector, 0) as (prefill, decode, router, _):
        for i, (prompt, expected) in enumerate(zip(PROMPTS, colocated, strict=True)):
            got = complete(router, prompt, stream=i % 3 == 0)
            assert got == expected, f"prompt {i} ({len(prompt)} tokens)"
        disaggregated = metric_value(
            router, "pagefleet_router:pd_decisions_total", {"outcome": "disaggregated"}
        )
        assert disaggregated == len(PROMPTS)
        assert metric_value(decode, "pagefleet:kv_transfer_transfers_total") == len(PROMPTS)
        assert metric_value(decode, "pagefleet:kv_transfer_failures_total") == 0
        assert metric_value(decode, "pagefleet:kv_transfer_bytes_total") > 0
        # Every pull moved its blocks over the configured data path and none over the other:
        # a NIXL fleet that quietly fell back to TCP fails here (outputs alone cannot tell).
        other = {"nixl": "tcp", "tcp": "nixl"}[connector]
        # (SHARED[:64] is four full blocks the decode pod holds by then: nothing to pull.)
        assert pulls(decode, connector) == len(PROMPTS) - 1
        assert pulls(decode, other) == 0
        assert_nothing_held(prefill, decode)


def pulls(engine: str, path: str) -> float:
    return metric_value(engine, "pagefleet:kv_transfer_pulls_total", {"path": path})


def test_only_blocks_missing_on_the_decode_pod_cross_the_wire(tiny_checkpoints, colocated):
    path = tiny_checkpoints["llama"]
    with pd_fleet(path, "tcp") as (prefill, decode, router, _):
        first = list(range(11, 111))  # 100 tokens: 6 full blocks of 16 and a partial one
        complete(router, first)
        before = metric_value(decode, "pagefleet:kv_transfer_bytes_total")
        second = first + list(range(200, 260))  # 160 tokens: 10 blocks
        complete(router, second)
        pulled = metric_value(decode, "pagefleet:kv_transfer_bytes_total") - before
        config = json.loads((Path(path) / "config.json").read_text())
        heads = config.get("num_key_value_heads", config["num_attention_heads"])
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        block_bytes = config["num_hidden_layers"] * 2 * heads * 16 * head_dim * 4
        assert pulled == (10 - 6) * block_bytes  # the 6 full blocks of `first` stayed local
        assert_nothing_held(prefill, decode)


@contextlib.contextmanager
def black_hole():
    """A TCP port that accepts connections and never answers (a hung prefill pod)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted, stop = [], threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def as_router(base: str, body: dict) -> httpx.Response:
    """POST with kv_transfer_params signed as the fleet's router signs them."""
    headers = signed_headers({}, body, FieldSigner(fleet_secret()))
    return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)


def test_faults_end_in_correct_answers_and_nothing_held(tiny_checkpoints, colocated):
    path = tiny_checkpoints["llama"]
    long_i = 10
    prompt, expected = PROMPTS[long_i], colocated[long_i]
    with (
        pd_fleet(path, "nixl") as (prefill, decode, router, p_proc),
        running_server(
            path,
            *kv_flags("nixl", "kv_consumer", transfer_timeout=1.0),
            "--served-model-name",
            "other-model",  # an incompatible peer: the handshake refuses it
            env=FLEET_ENV,
        ) as (odd_decode, _),
    ):
        direct = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        direct |= {"ignore_eos": True}

        def prefill_params() -> dict:
            body = {**direct, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            return as_router(prefill, body).json()["kv_transfer_params"]

        def decode_with(base: str, params: dict, model: str = "tiny") -> list[int]:
            r = as_router(base, {**direct, "model": model, "kv_transfer_params": params})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        # 1. Incompatible handshake: refused, the decode engine recomputes, the hold is freed.
        fallbacks = metric_value(odd_decode, "pagefleet:kv_transfer_fallbacks_total")
        assert decode_with(odd_decode, prefill_params(), "other-model") == expected
        assert metric_value(odd_decode, "pagefleet:kv_transfer_fallbacks_total") == fallbacks + 1
        assert_nothing_held(prefill, odd_decode)

        # 2. A prefill pod that never answers (the router signed its address): the pull times
        #    out (1 s), local prefill.
        with black_hole() as port:
            params = prefill_params()
            started = time.monotonic()
            assert decode_with(odd_decode, {**params, "remote_port": port}, "other-model") == (
                expected
            )
            assert time.monotonic() - started < 10
        release_prefill(params, fleet_secret())  # never read: freed as the router does
        assert_nothing_held(prefill, odd_decode)

        # 3. A client leaves a disaggregated stream after its first token: it reached both
        #    engines (the prefill answered, the decode engine streamed), then a clean abort
        #    with nothing held. (Leaving on a timer could leave before any engine saw it, and
        #    "nothing held" would hold for nothing.)
        transfers = metric_value(decode, "pagefleet:kv_transfer_transfers_total")
        body = {**direct, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert expected.startswith(json.loads(first[6:])["choices"][0]["text"])
        assert metric_value(decode, "pagefleet:kv_transfer_transfers_total") == transfers + 1
        assert_nothing_held(prefill, decode, within=10.0)

        # 4. The prefill pod dies holding blocks: the decode pod computes the prompt itself,
        #    and requests through the router keep succeeding on the decode pod alone.
        params = prefill_params()
        p_proc.kill()
        p_proc.wait(timeout=30)
        assert decode_with(decode, params) == expected
        other, other_expected = PROMPTS[long_i + 1], colocated[long_i + 1]
        assert complete(router, other) == other_expected
        decisions = pd_decisions(router)
        # before or after the router ejects the dead pod
        assert decisions.get("prefill_failed", 0) + decisions.get("no_prefill_pod", 0) >= 1, (
            decisions
        )
        assert metric_value(decode, "vllm:kv_cache_usage_perc") == 0


def prefill_directly(prefill: str, prompt: list[int]) -> dict:
    """What the router does first: the prefill engine computes the prompt and holds it."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    body["kv_transfer_params"] = {"do_remote_decode": True}
    r = as_router(prefill, body)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode_directly(
    decode: str, prompt: list[int], params: dict, max_tokens: int = MAX_TOKENS
) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "kv_transfer_params": params}
    r = as_router(decode, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def held_blocks(engine: str) -> float:
    return metric_value(engine, "pagefleet:kv_transfer_held_blocks")


def test_a_hold_nobody_reads_expires_and_cannot_be_read_after(tiny_checkpoints, colocated):
    """A prefill engine with hold_timeout 1 s frees blocks no decode engine came for; a decode
    engine that comes later finds nothing held and computes the prompt itself. Fails for: the
    hold timeout disabled (the blocks stay held until the test's 15 s deadline), or a pull
    that succeeds from an expired hold (no fallback counted)."""
    path = tiny_checkpoints["llama"]
    prompt, expected = PROMPTS[10], colocated[10]
    with (
        running_server(
            path, *kv_flags("tcp", "kv_producer"), "--kv-hold-timeout", "1", env=FLEET_ENV
        ) as (prefill, _),
        running_server(path, *kv_flags("tcp", "kv_consumer"), env=FLEET_ENV) as (decode, _),
    ):
        params = prefill_directly(prefill, prompt)
        assert len(params["remote_block_ids"]) == -(-len(prompt) // 16)
        wait_until(lambda: held_blocks(prefill) == 0, 15, "the hold to expire")
        assert metric_value(prefill, "vllm:kv_cache_usage_perc") == 0
        assert decode_directly(decode, prompt, params) == expected
        assert metric_value(decode, "pagefleet:kv_transfer_fallbacks_total") == 1


@pytest.mark.parametrize("status", [500, 400])
def test_the_router_releases_the_prefill_hold_when_decode_does_not_answer_200(
    tiny_checkpoints, status
):
    """The prefill engine holds the prompt (hold timeout 600 s), the decode pod answers
    `status`: no decode engine will read the blocks, so the router releases them at once.
    Fails for: the release on a non-200 decode answer removed (the blocks stay held for 600 s;
    this test waits 10)."""
    from fake_engine import FakeEngine, Script, wait_scraped

    path = tiny_checkpoints["llama"]
    with (
        running_server(
            path, *kv_flags("tcp", "kv_producer"), "--kv-hold-timeout", "600", env=FLEET_ENV
        ) as (prefill, _),
        FakeEngine("decode", Script(status=status)) as decode,
        running_router(
            "--endpoints",
            f"{prefill}@prefill,{decode.url}@decode",
            "--pd-threshold-tokens",
            "0",
            env=FLEET_ENV,
        ) as (router, _),
    ):
        wait_scraped(decode)
        body = {"model": "tiny", "prompt": PROMPTS[10], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
        assert r.status_code == (502 if status >= 500 else status), r.text
        # The prefill engine did hold the blocks: its answer reached the decode pod.
        assert "remote_block_ids" in decode.received[0]["kv_transfer_params"]
        assert pd_decisions(router) == {"disaggregated": 1.0}
        wait_until(lambda: held_blocks(prefill) == 0, 10, "the router to release the hold")
        assert metric_value(prefill, "vllm:kv_cache_usage_perc") == 0


def test_kv_both_engines_prefill_for_each_other(tiny_checkpoints, colocated):
    """Two engines with kv_role kv_both: each prefills for the other and decodes from the
    other, over NIXL. Fails for: kv_both not producing (no transfer service, no hold) or not
    consuming (the kv_transfer_params ignored: no pull, the prompt computed locally)."""
    path = tiny_checkpoints["llama"]
    with (
        running_server(path, *kv_flags("nixl", "kv_both"), env=FLEET_ENV) as (a, _),
        running_server(path, *kv_flags("nixl", "kv_both"), env=FLEET_ENV) as (b, _),
    ):
        for producer, consumer, i in ((a, b, 10), (b, a, 11)):
            prompt, expected = PROMPTS[i], colocated[i]
            params = prefill_directly(producer, prompt)
            assert decode_directly(consumer, prompt, params) == expected
            assert pulls(consumer, "nixl") == 1
            assert metric_value(consumer, "pagefleet:kv_transfer_fallbacks_total") == 0
            wait_until(lambda p=producer: held_blocks(p) == 0, 10, "the pull to release the hold")
