"""Regenerate router/src/pagefleet/router/openapi_bodies.json from the engine's request models
(after changing engine/server/protocol.py; tests/test_router_openapi.py fails until then).

The router declares the bodies it accepts with the engine's own schemas, less the fields only
the router may set, and never imports the engine: this file is the one copy it ships.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "router" / "src" / "pagefleet" / "router" / "openapi_bodies.json"
ROUTER_ONLY = ("kv_transfer_params",)  # the router refuses it from clients (403)


def bodies() -> dict:
    """Component schemas: CompletionRequest, ChatCompletionRequest, EmbeddingRequest (the
    body of /v1/embeddings and /pooling) and what they refer to."""
    from pydantic.json_schema import models_json_schema

    from pagefleet.engine.server.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        EmbeddingRequest,
    )

    _, schemas = models_json_schema(
        [
            (CompletionRequest, "validation"),
            (ChatCompletionRequest, "validation"),
            (EmbeddingRequest, "validation"),
        ],
        ref_template="#/components/schemas/{model}",
    )
    components = schemas["$defs"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        for field in ROUTER_ONLY:
            components[name]["properties"].pop(field, None)
    return components


def render() -> str:
    return json.dumps(bodies(), indent=1, sort_keys=True) + "\n"


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
