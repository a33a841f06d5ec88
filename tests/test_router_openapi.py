"""The router's OpenAPI document declares the bodies it accepts (the engine's schemas, from the
one generated copy), so a schema-driven fuzzer has something to send it: every operation of a
real router in front of a real engine answers fuzzed input without a 5xx, and neither process
grows without bound."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from server_utils import rss_bytes, running_router, running_server

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def test_the_routers_body_schemas_are_the_engines():
    """Fails when engine/server/protocol.py changed and the router's copy was not regenerated
    (python scripts/gen_router_openapi.py), and when a router-only field is declared."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_router_openapi
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from pagefleet.router.openapi import body_schemas

    assert body_schemas() == json.loads(gen_router_openapi.render())
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert "kv_transfer_params" not in body_schemas()[name]["properties"]


def test_fuzzing_the_router_through_to_an_engine_finds_no_server_error(tiny_checkpoints):
    import schemathesis

    path = tiny_checkpoints["llama"]
    with (
        running_server(path, timeout=180) as (engine, engine_proc),
        running_router("--endpoints", engine, "--tokenizer", path, "--model", "tiny") as (
            router,
            router_proc,
        ),
    ):
        schema = schemathesis.openapi.from_url(f"{router}/openapi.json")
        operations = {op.path: op for op in (r.ok() for r in schema.get_all_operations())}
        posts = {"/v1/completions", "/v1/chat/completions"}
        assert posts <= set(operations)
        # Bodies are declared, so the fuzzer sends real ones (the pooling endpoints' too: this
        # engine generates, so it refuses them with a 400).
        for path_ in posts | {"/v1/embeddings", "/pooling"}:
            assert operations[path_].body, f"{path_} declares no request body"
        before = {p.pid: rss_bytes(p.pid) for p in (engine_proc, router_proc)}
        for operation in operations.values():

            @given(case=operation.as_strategy())
            @settings(
                max_examples=12 if operation.path in posts else 2,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def check(case):
                response = case.call(timeout=120)
                assert response.status_code < 500, (case.path, case.body, response.text[:500])

            check()
        for pid, rss in before.items():
            grown = (rss_bytes(pid) - rss) / MiB
            assert grown < 200, f"process {pid} grew by {grown:.0f} MiB under the fuzz"
