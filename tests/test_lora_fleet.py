"""LoRA adapters across a fleet of real processes: a prefill engine with two adapters, a decode
engine with one that loads more at run time, and the router (two engines, not three: CI's
seconds; which of several pods the router picks for an adapter is tests/test_lora_router.py's).

The router sends an adapter's requests only to a decode engine that serves it (learned from
the engines' /v1/models, run-time loads included) and disaggregates them: the prefill engine
computes the prompt with the adapter, the decode engine pulls it and decodes with the same
adapter (greedy equal to transformers + peft). Run-time loading is refused outside the root,
above the rank limit, for missing files; unknown adapters are 404s."""

from __future__ import annotations

import contextlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from lora_adapters import peft_text, write_adapters
from test_pd import as_router, kv_flags, pulls

from pagefleet.router.pd import release_prefill
from server_utils import (
    FLEET_ENV,
    fleet_secret,
    metric_value,
    running_router,
    running_server,
    wait_until,
)

MAX_TOKENS = 8
LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
LONG = list(range(40, 120))  # 5 full blocks: worth disaggregating at the 32-token threshold


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    found = write_adapters(tiny_checkpoints["llama"], root / "trained")
    allowed = root / "allowed"
    allowed.mkdir()
    shutil.copytree(found["chat"], allowed / "chat")
    shutil.copytree(found["wide"], allowed / "wide")  # rank 16: above the limit
    (allowed / "empty").mkdir()
    os.symlink(found["math"], allowed / "escape")  # a symlink out of the root
    return {**found, "root": str(allowed)}


@pytest.fixture(scope="module")
def fleet(tiny_checkpoints, adapters):
    path = tiny_checkpoints["llama"]
    modules = ("--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}")
    updates = ("--allow-runtime-lora-updating", "--lora-root", adapters["root"])
    engines = {
        "prefill": (*kv_flags("tcp", "kv_producer"), *LORA, *modules),
        "sql": (*kv_flags("tcp", "kv_consumer"), *LORA, *modules[:2], *updates),
    }
    with contextlib.ExitStack() as stack:
        # The engines start together (each waits for its health), then the router.
        starting = {
            name: running_server(path, *flags, env=FLEET_ENV, timeout=180)
            for name, flags in engines.items()
        }
        with ThreadPoolExecutor(len(starting)) as pool:
            started = {name: pool.submit(cm.__enter__) for name, cm in starting.items()}
        for name, cm in starting.items():
            if started[name].exception() is None:  # stopped on the way out, whatever fails
                stack.push(cm.__exit__)
        urls = {name: future.result()[0] for name, future in started.items()}
        endpoints = f"{urls['prefill']}@prefill,{urls['sql']}@decode"
        urls["router"], _ = stack.enter_context(
            running_router(
                "--endpoints",
                endpoints,
                "--model",
                "tiny",
                "--pd-threshold-tokens",
                "32",
                env=FLEET_ENV,
            )
        )
        yield urls


def complete(base: str, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json={**body, "ignore_eos": True}, timeout=120)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_adapter_requests_go_where_it_is_loaded_and_disaggregate_with_it(
    fleet, adapters, tiny_checkpoints
):
    """Fails for: a router that does not take an adapter's name as the model's (404), a prefill
    or decode side that drops the adapter (the output changes), a decode engine that
    recomputes instead of pulling."""
    models = httpx.get(f"{fleet['sql']}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("sql", "tiny")]
    base = tiny_checkpoints["llama"]
    for i in range(4):
        prompt = [LONG[0] + i, *LONG]
        response = complete(fleet["router"], "sql", prompt)
        assert text_of(response) == peft_text(base, adapters["sql"], prompt, MAX_TOKENS)
        assert response.json()["model"] == "sql"
    assert pulls(fleet["sql"], "tcp") == 4  # every prompt came from the prefill engine
    info = {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert metric_value(fleet["sql"], "vllm:lora_requests_info", info) > 0
    assert complete(fleet["router"], "nonexistent", LONG).status_code == 404
    assert complete(fleet["sql"], "chat", LONG).status_code == 404  # not on this engine


def test_kv_of_one_adapter_is_never_decoded_with_another(fleet):
    params = prefill_directly_as(fleet["prefill"], "sql", LONG)
    assert params["remote_lora_name"] == "sql"
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 2, "kv_transfer_params": params}
    refused = as_router(fleet["sql"], body)
    assert refused.status_code == 400 and "LoRA adapter 'sql'" in refused.text
    release_prefill(params, fleet_secret())


def prefill_directly_as(prefill: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = as_router(prefill, {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def load(base: str, name: str, path: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    return httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=30)


def test_run_time_loading_is_confined_to_the_root(fleet, adapters):
    engine = fleet["sql"]
    for path in ("../trained/chat", adapters["chat"], "escape", "/etc", "chat/../../trained/sql"):
        refused = load(engine, "evil", path)
        assert refused.status_code == 403, (path, refused.text)
    assert load(engine, "x", "empty").status_code == 404
    assert load(engine, "x", "nothing-here").status_code == 404
    too_big = load(engine, "wide", "wide")
    assert too_big.status_code == 400 and "--max-lora-rank 8" in too_big.text
    assert load(engine, "tiny", "chat").status_code == 400  # the base model's name
    assert load(engine, "bad name!", "chat").status_code == 400
    unknown = httpx.post(f"{engine}/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert unknown.status_code == 404
    names = [m["id"] for m in httpx.get(f"{engine}/v1/models").json()["data"]]
    assert names == ["tiny", "sql"]  # nothing refused was registered


def test_an_adapter_loaded_at_run_time_is_routed_to_and_unloaded(fleet, adapters, tiny_checkpoints):
    engine, router = fleet["sql"], fleet["router"]
    # No decode engine serves chat yet: the router has nowhere to send it.
    assert complete(router, "chat", LONG[:20]).status_code != 200
    served = metric_value(engine, "vllm:e2e_request_latency_seconds_count")
    assert load(engine, "chat", "chat").status_code == 200
    assert load(engine, "chat", "chat").status_code == 400  # already loaded
    # The router learns the engine's adapters from its /v1/models within a second.
    wait_until(lambda: complete(router, "chat", LONG[:20]).status_code == 200, 30, "routing")
    prompt = LONG[5:60]
    expected = peft_text(tiny_checkpoints["llama"], adapters["chat"], prompt, MAX_TOKENS)
    assert text_of(complete(router, "chat", prompt)) == expected
    assert metric_value(engine, "vllm:e2e_request_latency_seconds_count") >= served + 2
    unloaded = httpx.post(f"{engine}/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert unloaded.status_code == 200
    assert complete(engine, "chat", LONG).status_code == 404
