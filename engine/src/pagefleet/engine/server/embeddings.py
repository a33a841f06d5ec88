"""The pooling runner's front door: OpenAI's `/v1/embeddings` and vLLM's `/pooling`.

Every input is checked (shape and count in protocol.py, size before tokenizing, length and
vocabulary after) before any is submitted, so a bad request is a 400 naming the input's index
with no work queued. Each input is one prefill-only engine request; the response waits for all
of them (a client that leaves aborts them all). `serving_routes` gives each engine the routes
of its runner: a pooling engine refuses completions and chat with a 400, a generation engine
refuses embeddings likewise.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from pagefleet.common.http_errors import APIError
from pagefleet.engine.outputs import PoolingRequestOutput
from pagefleet.engine.pooling.params import PoolingParams
from pagefleet.engine.server.app import (
    ServerState,
    _check_capacity,
    _check_model,
    _collect,
    _request_id,
    _state,
)
from pagefleet.engine.server.protocol import EmbeddingRequest
from pagefleet.engine.validation import InvalidRequest


async def embeddings(req: EmbeddingRequest, request: Request):
    """OpenAI's embeddings: one vector per input, as floats or base64 (little-endian float32)."""
    if req.task is not None:
        raise APIError(400, "task is a /pooling field", param="task")
    return await _pool(req, request, "embd", "embedding", "embedding")


async def pooling(req: EmbeddingRequest, request: Request):
    """vLLM's /pooling: the same vectors under `data`, task `embed` (the one this runner
    serves)."""
    return await _pool(req, request, "pool", "pooling", "data")


async def _pool(req: EmbeddingRequest, request: Request, prefix: str, kind: str, key: str):
    state = _state(request)
    _check_model(state, req.model)
    if req.ignored_fields():
        state.metrics.count_ignored(req.ignored_fields())
    params = _params(state, req)
    prompts = await _prompts(state, req, params)
    rid = _request_id(request, prefix)
    _check_capacity(state, len(prompts))  # and submit at once, with no await in between
    gens = [_submit(state, f"{rid}-{i}", p, params) for i, p in enumerate(prompts)]
    finals = await _collect(gens, request)
    num_tokens = sum(len(p) for p in prompts)
    return {
        "id": rid,
        "object": "list",
        "created": int(time.time()),
        "model": state.config.served_model_name,
        "data": [
            {"index": i, "object": kind, key: _encoded(out, req.encoding_format)}
            for i, out in enumerate(finals)
        ],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def _params(state: ServerState, req: EmbeddingRequest) -> PoolingParams:
    if req.dimensions is not None:
        try:
            state.engine.limits.pooling.check_dimensions(req.dimensions)
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions") from None
    return PoolingParams(req.dimensions, req.truncate_prompt_tokens)


async def _prompts(state: ServerState, req: EmbeddingRequest, params: PoolingParams):
    """Each input's token ids as the engine will run them (truncated if asked), every one
    checked against the engine's rules; a 400 names the first bad input's index."""
    inputs = req.inputs()
    state.limits.check_sequences(len(inputs), 1, "input")
    texts = [x for x in inputs if isinstance(x, str)]
    if texts:
        # With truncation a text may be longer than the context (the body limit bounds it).
        check = params.truncate_prompt_tokens is None
        inputs = await state.tokens.encode_many(texts, req.add_special_tokens, "input", check)
    rules = state.engine.limits.rules
    prompts = []
    for i, ids in enumerate(inputs):
        try:
            ids = params.truncate(list(ids), rules.max_model_len)
            rules.check_prefill_only(ids)
        except ValueError as e:
            where = f"input[{i}]: " if len(inputs) > 1 else ""
            param = e.param if isinstance(e, InvalidRequest) else "truncate_prompt_tokens"
            raise APIError(400, f"{where}{e}", param=param) from None
        prompts.append(ids)
    return prompts


def _submit(state: ServerState, rid: str, token_ids: list[int], params: PoolingParams):
    try:
        # Unique inside the engine even when clients reuse an X-Request-Id.
        stream = state.engine.encode(token_ids, params, f"{rid}.{uuid.uuid4().hex[:8]}")
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return _observe(state, stream)


async def _observe(state: ServerState, stream) -> AsyncIterator[PoolingRequestOutput]:
    finished = False
    try:
        async for out in stream:
            state.metrics.observe_pooled(out)
            finished = True
            yield out
    except ValueError as e:
        raise APIError(400, str(e)) from None
    finally:
        await stream.aclose()
        if not finished:
            state.metrics.count_abort(1)


def _encoded(out: PoolingRequestOutput, encoding_format: str) -> list[float] | str:
    vector = out.outputs.data
    if vector is None:
        raise APIError(500, "a request ended without its vector (engine aborted it)")
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def serving_routes(routes, runner: str):
    """The app's routes for an engine of `runner`: the other runner's endpoints answer 400."""
    if runner == "pooling":
        for method, path, endpoint in routes:
            if path in GENERATION_APIS:
                endpoint = _refusal(POOLING_ONLY.format(GENERATION_APIS[path]))
            yield method, path, endpoint
        yield from POOLING_ROUTES
        return
    yield from routes
    for method, path, _ in POOLING_ROUTES:
        yield method, path, _refusal(GENERATION_ONLY.format(POOLING_APIS[path]))


def _refusal(message: str):
    async def refuse(request: Request):
        raise APIError(400, message)

    return refuse


POOLING_ROUTES = (("POST", "/v1/embeddings", embeddings), ("POST", "/pooling", pooling))
POOLING_APIS = {"/v1/embeddings": "Embeddings", "/pooling": "Pooling"}
GENERATION_APIS = {"/v1/completions": "Completions", "/v1/chat/completions": "Chat Completions"}
POOLING_ONLY = (
    "This model does not support the {} API: the engine runs the pooling runner "
    "(--runner pooling); use /v1/embeddings or /pooling"
)
GENERATION_ONLY = (
    "This model does not support the {} API: the engine runs the generate runner; serve an "
    "embedding model with --runner pooling (or auto on a checkpoint that declares pooling)"
)
