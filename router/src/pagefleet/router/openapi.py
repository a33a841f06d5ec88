"""The router's OpenAPI document, with the request bodies it accepts declared: the engine's own
schemas for /v1/completions, /v1/chat/completions, /v1/embeddings and /pooling, less the fields
only the router may set. They come from openapi_bodies.json, which scripts/gen_router_openapi.py
generates from engine/server/protocol.py (the router never imports the engine; a test fails
when the copy drifts). The router forwards a body as sent and engines validate it in full: the
declaration is for clients and fuzzers, not a second validation.
"""

from __future__ import annotations

import json
from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

BODIES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/embeddings": "EmbeddingRequest",
    "/pooling": "EmbeddingRequest",
}


def body_schemas() -> dict:
    return json.loads(files("pagefleet.router").joinpath("openapi_bodies.json").read_text())


def declare_bodies(app: FastAPI) -> None:
    """Make `app.openapi()` declare BODIES (built once, on the first request for it)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(body_schemas())
            for path, name in BODIES.items():
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}
                    },
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
