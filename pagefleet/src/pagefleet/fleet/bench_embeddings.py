"""`pagefleet bench serve --endpoint embeddings`: batches of the benchmark's texts sent to
`/v1/embeddings` (one request carries --batch-size inputs); each request is timed end to end
and counts its embeddings and prompt tokens (the server's usage)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

from pagefleet.fleet.bench_serve import RequestResult


def embedding_batches(conversations: list, batch_size: int) -> list[list[str]]:
    """The dataset's texts (first turns) grouped into requests of `batch_size` inputs."""
    texts = [c.turns[0] for c in conversations]
    return [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]


async def embed_request(client, args, texts: list[str]) -> RequestResult:
    import httpx

    body = {"model": args.model, "input": texts, "encoding_format": "base64"}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        response = await client.post("/v1/embeddings", json=body)
    except httpx.HTTPError as e:
        result.error = repr(e)
        return result
    if response.status_code != 200:
        result.error = f"HTTP {response.status_code}: {response.content[:200]!r}"
        return result
    try:
        answer = response.json()
    except json.JSONDecodeError as e:
        result.error = repr(e)
        return result
    if len(answer.get("data") or ()) != len(texts):
        result.error = f"{len(answer.get('data') or ())} embeddings for {len(texts)} inputs"
        return result
    return replace(
        result,
        ok=True,
        e2e=time.perf_counter() - start,
        prompt_tokens=answer["usage"]["prompt_tokens"],
        embeddings=len(texts),
    )
