"""Routing embeddings (`/v1/embeddings`, `/pooling`): what the router hashes for prefix affinity.

A pooling engine that pools the last token keeps prefix caching, so inputs that open alike
(one instruction before every query, one document header before each of its chunks) compute
less on the pod that holds that opening: benchmarks/embeddings.py measured the work saved
(docs/benchmarks.md, issue 36). One request may carry many inputs; its first stands for them.
Mean and CLS pooling engines cache nothing (their /metrics say enable_prefix_caching False):
the router records no blocks for them, so they are picked on load alone.
"""

from __future__ import annotations

POOLING_PATHS = ("/v1/embeddings", "/pooling")


def routed_prompt(path: str, body: dict):
    """The prompt whose blocks route the request: a completion's `prompt`, an embeddings
    request's first input (text or token ids)."""
    if path not in POOLING_PATHS:
        return body.get("prompt", "")
    given = body.get("input", "")
    if isinstance(given, list) and given and isinstance(given[0], str | list):
        return given[0]
    return given
