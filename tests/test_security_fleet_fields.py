"""Attacks on the fields only the router may set (issue 14, findings 1 and 8), by a plain client,
straight at the engines and through the router of a real P/D fleet that shares a fleet secret.

Each attack must fail with a clear 403 and leave no trace (no connection to the attacker's
address, no poisoned prefix cache, no pinned block), while the router's own P/D keeps pulling
KV over NIXL and answering exactly as one colocated engine does.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from pathlib import Path

import httpx
import pytest
import torch

from pagefleet.common.fleet_auth import FieldSigner, FleetSecret
from pagefleet.engine.kv_transfer.layout import CompatRecord
from pagefleet.engine.kv_transfer.service import KVTransferServer
from pagefleet.engine.llm import LLM
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.router.pd import signed_headers
from server_utils import (
    FLEET_ENV,
    fleet_secret,
    free_port,
    metric_value,
    running_router,
    running_server,
)

MAX_TOKENS = 8
# Prompts of three full blocks and one token (decode-only through the router: under 64 tokens).
SSRF_PROMPT = list(range(40, 89))
DIRECT_POISON = list(range(100, 149))
ROUTER_POISON = list(range(150, 199))
LONG = list(range(200, 400))  # 200 tokens: disaggregated through the router
LONG_B = list(range(300, 500))
SIGNED_POISON = list(range(250, 299))
PROMPTS = [DIRECT_POISON, ROUTER_POISON, SIGNED_POISON, LONG, LONG_B]


def kv_flags(role: str, **extra) -> list[str]:
    config = {"kv_connector": "nixl", "kv_role": role, "kv_port": free_port(), **extra}
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints) -> dict[tuple[int, ...], str]:
    """Greedy outputs of one colocated engine: what every path must give."""
    llm = LLM(tiny_checkpoints["llama"], max_model_len=256, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    llm.engine.close()
    return {tuple(p): o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def fleet(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with (
        running_server(path, *kv_flags("kv_producer"), env=FLEET_ENV) as (prefill, _),
        running_server(path, *kv_flags("kv_consumer", transfer_timeout=5.0), env=FLEET_ENV) as (
            decode,
            _,
        ),
        running_router(
            "--endpoints",
            f"{prefill}@prefill,{decode}@decode",
            "--pd-threshold-tokens",
            "64",
            env=FLEET_ENV,
        ) as (router, _),
    ):
        yield {"prefill": prefill, "decode": decode, "router": router, "model": path}


class Listener:
    """An attacker's TCP port: counts the connections an engine makes to it."""

    def __init__(self) -> None:
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(16)
        self._server.settimeout(0.1)
        self.port = self._server.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.accepted.append(self._server.accept()[0])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self.accepted:
            conn.close()
        self._server.close()


class _HoldEverything:
    def blocks_of(self, transfer_id: str, reader: str) -> list[int]:
        return list(range(64))

    def release(self, transfer_id: str, reader: str) -> bool:
        return True


@contextlib.contextmanager
def rogue_peer(model_dir: str):
    """A KV-transfer service serving random KV in the engines' exact format, run by someone
    without the fleet secret (it knows the model, so it can build the compatibility record)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    shape = (config["num_hidden_layers"], 2, heads, 64, 16, head_dim)
    pool = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    compat = CompatRecord.from_pool_shape("tiny", "float32", "float32", shape)
    secret = FleetSecret(b"the-attackers-own-secret-0123456789")
    server = KVTransferServer(_HoldEverything(), pool, compat, "rogue", secret=secret)
    port = server.start()
    try:
        yield port
    finally:
        server.stop(grace=0)


def remote_prefill_params(port: int) -> dict:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "rogue",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": list(range(8)),
        "remote_request_id": "stolen",
    }


def complete(base: str, prompt: list[int], stream: bool = False, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "stream": stream, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = response.text.splitlines()
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return response.json()["choices"][0]["text"]


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert "kv_transfer_params" in error["message"]
    assert error["code"] == 403


def test_a_client_cannot_make_the_decode_engine_connect_anywhere(fleet):
    """SSRF (finding 1): before, the engine connected to whatever remote_host/port a client
    sent (a request hung 22 s on an attacker's listener)."""
    listener = Listener()
    try:
        params = remote_prefill_params(listener.port)
        response = complete(fleet["decode"], SSRF_PROMPT, kv_transfer_params=params)
        assert listener.accepted == [], "the engine connected to the client's address"
        assert_refused(response)
        via_router = complete(fleet["router"], SSRF_PROMPT, kv_transfer_params=params)
        assert listener.accepted == [], "the engine connected to the client's address"
        assert_refused(via_router)
    finally:
        listener.close()


@pytest.mark.parametrize("entry", ["decode", "router"])
def test_a_rogue_peer_cannot_poison_the_shared_prefix_cache(fleet, reference, entry):
    """Cache poisoning (finding 1): before, a fake peer's random KV for a prefix entered the
    decode engine's prefix cache, and a later innocent greedy request with that prefix
    returned different text; through the router too, which forwarded the raw body."""
    prompt = DIRECT_POISON if entry == "decode" else ROUTER_POISON
    with rogue_peer(fleet["model"]) as port:
        attack = complete(fleet[entry], prompt, kv_transfer_params=remote_prefill_params(port))
    innocent = complete(fleet["router"], prompt)
    assert text_of(innocent) == reference[tuple(prompt)], "the prefix cache was poisoned"
    assert_refused(attack)


def test_even_signed_params_never_make_an_engine_read_from_an_unproven_peer(fleet, reference):
    """Defence in depth: should the router ever sign a rogue address (a compromised prefill
    pod answering with one), the decode engine's handshake still refuses a peer that cannot
    prove the fleet secret, computes the prompt itself, and caches nothing foreign."""
    decode = fleet["decode"]
    fallbacks = metric_value(decode, "pagefleet:kv_transfer_fallbacks_total")
    with rogue_peer(fleet["model"]) as port:
        body = {"model": "tiny", "prompt": SIGNED_POISON, "max_tokens": MAX_TOKENS}
        body |= {"temperature": 0, "ignore_eos": True}
        body["kv_transfer_params"] = remote_prefill_params(port)
        headers = signed_headers({}, body, FieldSigner(fleet_secret()))
        r = httpx.post(f"{decode}/v1/completions", json=body, headers=headers, timeout=120)
    assert text_of(r) == reference[tuple(SIGNED_POISON)]
    assert metric_value(decode, "pagefleet:kv_transfer_fallbacks_total") == fallbacks + 1
    innocent = complete(fleet["router"], SIGNED_POISON)
    assert text_of(innocent) == reference[tuple(SIGNED_POISON)]


def held_blocks(prefill: str) -> float:
    return metric_value(prefill, "pagefleet:kv_transfer_held_blocks")


def test_legitimate_pd_through_the_router_still_transfers_and_matches(fleet, reference):
    decode, router = fleet["decode"], fleet["router"]
    transfers = metric_value(decode, "pagefleet:kv_transfer_transfers_total")
    failures = metric_value(decode, "pagefleet:kv_transfer_failures_total")
    for prompt, stream in ((LONG, False), (LONG_B, True)):
        assert text_of(complete(router, prompt, stream=stream)) == reference[tuple(prompt)]
    assert metric_value(decode, "pagefleet:kv_transfer_transfers_total") == transfers + 2
    assert metric_value(decode, "pagefleet:kv_transfer_failures_total") == failures
    outcome = {"outcome": "disaggregated"}
    assert metric_value(router, "pagefleet_router:pd_decisions_total", outcome) >= 2


def test_a_client_cannot_pin_blocks_on_the_prefill_engine(fleet, reference):
    """Pinning (finding 8): before, any client's `do_remote_decode` made the prefill engine
    hold the prompt's blocks for 120 s; 18 such requests left its pool 96.5% full with
    nothing running."""
    prefill = fleet["prefill"]
    responses = [
        complete(
            entry,
            list(range(i, i + 200)),
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )
        for i in range(0, 18 * 3, 3)
        for entry in [prefill if i % 2 else fleet["router"]]
    ]
    assert held_blocks(prefill) == 0, "a client pinned blocks"
    for response in responses:
        assert_refused(response)
    assert text_of(complete(fleet["router"], LONG_B)) == reference[tuple(LONG_B)]
