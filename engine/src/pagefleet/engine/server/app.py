"""The OpenAI-compatible HTTP API of one engine (FastAPI), built on `AsyncLLM`.

Handlers tokenize, validate and translate; the engine runs on its own thread, so a slow
client or a burst of requests never stalls a step. A client that disconnects aborts its
request (its blocks are freed at the next step).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagefleet.common import __version__
from pagefleet.common.fleet_auth import FieldSigner
from pagefleet.common.http_errors import (
    APIError,
    BodyLimit,
    ClosingStreamingResponse,
    check_api_key,
    error_body,
    error_response,
    wait_disconnect,
)
from pagefleet.common.names import TENANT_HEADER
from pagefleet.engine.client import EngineClient
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.outputs import RequestOutput, TokenLogprobs
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.server.fleet_fields import check_fleet_fields
from pagefleet.engine.server.limits import RequestLimits, Tokenization, max_token_bytes
from pagefleet.engine.server.lora_routes import LORA_ROUTES, LoRAUpdates, adapter_cards, adapter_of
from pagefleet.engine.server.metrics import EngineMetrics
from pagefleet.engine.server.protocol import (
    MAX_EMBEDDING_INPUTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagefleet.engine.server.responses import (
    choice_part,
    completion_logprobs,
    continuous_usage,
    echoed_prompt,
    next_text_offset,
    prompt_logprobs_json,
)
from pagefleet.engine.server.tool_parsers import (
    Parser,
    ToolCallConfig,
    ToolStream,
    choose_parser,
    finish_reason,
    message_fields,
    new_call_id,
)
from pagefleet.engine.validation import InvalidRequest


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_body_bytes: int = 4 << 20
    fleet_signer: FieldSigner | None = None  # verifies the router's kv_transfer_params
    max_sequences_per_request: int | None = None  # prompts x n; default: --max-num-seqs
    tool_calls: ToolCallConfig = field(default_factory=ToolCallConfig)  # --enable-auto-tool-choice
    chat_template: str | None = None  # --chat-template: instead of the checkpoint's
    lora_updates: LoRAUpdates | None = None  # --allow-runtime-lora-updating, --lora-root


@dataclass
class ServerState:
    """Everything the handlers share, kept on `app.state.server`."""

    engine: EngineClient
    config: ServerConfig
    tokenizer: Any  # the event loop's own, to render logprobs (see Tokenization)
    tokens: Tokenization  # tokenizing on a thread of its own, with the request limits
    limits: RequestLimits
    metrics: EngineMetrics
    draining: bool = False  # set by SIGTERM: /health fails, in-flight requests finish


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="pagefleet", version=__version__)
    # Inside the key check (middleware added later wraps it): bodies of clients without the
    # key are never read.
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.state.server = server_state(engine, config)
    for exc_class, handler in _EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_class, handler)
    app.middleware("http")(_auth_and_ids)
    from pagefleet.engine.server.embeddings import serving_routes  # it imports this module

    for method, path, endpoint in serving_routes(_ROUTES, engine.limits.runner):
        app.add_api_route(path, endpoint, methods=[method])
    return app


def server_state(engine: EngineClient, config: ServerConfig) -> ServerState:
    limits = engine.limits
    request_limits = RequestLimits(
        limits.max_model_len,
        max_token_bytes(engine.tokenizer),
        config.max_sequences_per_request or _default_max_sequences(limits),
        config.max_waiting_requests,
    )
    return ServerState(
        engine=engine,
        config=config,
        tokenizer=engine.tokenizer,
        tokens=Tokenization(engine.tokenizer, request_limits, config.chat_template),
        limits=request_limits,
        metrics=EngineMetrics(engine, config.served_model_name),
    )


def _default_max_sequences(limits) -> int:
    """Per request: as many sequences as run at once; a pooling engine queues its inputs, up
    to OpenAI's limit on one embeddings request."""
    return MAX_EMBEDDING_INPUTS if limits.pooling is not None else limits.max_num_seqs


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ------------------------------------------------------------------ errors and middleware


async def _apierror_response(_, exc: APIError):
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)


async def _invalid_request(_, exc: InvalidRequest):
    return error_response(400, str(exc), "invalid_request_error", exc.param)


async def _invalid_body(_, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message = "malformed JSON body"
    return error_response(
        400, f"{param + ': ' if param else ''}{message}", "invalid_request_error", param
    )


async def _http(_, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), kind)


async def _unexpected(_, exc: Exception):  # JSON, never plain text; details stay in the log
    return error_response(500, "internal error (see the server log)", "internal_error")


_EXCEPTION_HANDLERS = (
    (APIError, _apierror_response),
    (InvalidRequest, _invalid_request),
    (RequestValidationError, _invalid_body),
    (StarletteHTTPException, _http),
    (Exception, _unexpected),
)


async def _auth_and_ids(request: Request, call_next):
    denied = check_api_key(
        request.headers.get("authorization", ""),
        _state(request).config.api_key,
        request.url.path,
        ("/health", "/metrics", "/version"),
    )
    if denied is not None:
        return denied
    response = await call_next(request)
    request_id = request.headers.get("x-request-id")
    if request_id:
        response.headers["X-Request-Id"] = request_id
    return response


# ------------------------------------------------------------------ request checks


def _check_model(state: ServerState, name: str | None) -> LoRARequest | None:
    """The LoRA adapter the request's `model` names (None: the base model); 404 if unknown."""
    return adapter_of(state.engine, state.config.served_model_name, name)


def _check_capacity(state: ServerState, sequences: int) -> None:
    # Every sequence counts: n samples of each of a request's prompts.
    state.limits.check_capacity(state.engine.num_waiting_sequences, sequences)


def _check_fleet(state: ServerState, req, request: Request) -> None:
    check_fleet_fields(
        req.kv_transfer_params, request.headers, state.config.fleet_signer, time.time()
    )


async def _encode(
    state: ServerState, prompt: str | list[int], add_special_tokens: bool = True
) -> list[int]:
    if isinstance(prompt, str):
        return await state.tokens.encode(prompt, add_special_tokens)
    return list(prompt)


async def _chat_prompt(state: ServerState, req: ChatCompletionRequest | TokenizeRequest):
    messages = [m.for_template() for m in req.messages]
    tools = [t.for_template() for t in req.tools or ()]
    if (
        getattr(req, "tool_choice", None) == "none"
        and state.config.tool_calls.exclude_tools_when_tool_choice_none
    ):
        tools = []
    return await state.tokens.chat(messages, req.add_generation_prompt, tools)


def _tool_parser(state: ServerState, req: ChatCompletionRequest) -> Parser | None:
    try:
        return choose_parser(
            req.tool_choice,
            bool(req.tools),
            req.parallel_tool_calls is not False,
            state.config.tool_calls,
        )
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None


def _request_id(request: Request, prefix: str) -> str:
    return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"


# ------------------------------------------------------------------ submitting


def _submit(
    state: ServerState,
    rid: str,
    token_ids: list[int],
    params: SamplingParams,
    lora: LoRARequest | None = None,
):
    """Submit now (so the next capacity check counts it); outputs come from the returned
    generator, with metrics observed on the way."""
    # Unique inside the engine even when clients reuse an X-Request-Id.
    engine_id = f"{rid}.{uuid.uuid4().hex[:8]}"
    try:
        if lora is None:
            stream = state.engine.generate(token_ids, params, engine_id)
        else:
            stream = state.engine.generate(token_ids, params, engine_id, lora_request=lora)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return _observe(state.metrics, stream, params)


async def _observe(
    metrics: EngineMetrics, stream, params: SamplingParams
) -> AsyncIterator[RequestOutput]:
    previous = None
    try:
        async for out in stream:
            metrics.observe(previous, out)
            previous = out
            yield out
    except ValueError as e:
        raise APIError(400, str(e)) from None
    finally:
        await stream.aclose()
        if previous is None or not previous.finished:
            metrics.count_abort(params.n)


async def _last(gen) -> RequestOutput | None:
    final = None
    async for out in gen:
        final = out
    return final


async def _collect(gens, request: Request) -> list[RequestOutput]:
    """Final outputs of several streams; a client disconnect aborts them all."""
    tasks = [asyncio.ensure_future(_last(g)) for g in gens]
    gone = asyncio.ensure_future(wait_disconnect(request))
    pending = {*tasks, gone}
    try:
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not gone and task.exception() is not None:
                    raise task.exception()
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
            if gone.done():  # the client left: the finally below aborts the requests
                raise APIError(499, "client closed the request")
    finally:
        await _cancel_and_close([*tasks, gone], gens)


# ------------------------------------------------------------------ endpoints


async def health(request: Request):
    state = _state(request)
    if state.draining or not state.engine.is_running:
        return error_response(
            503,
            "shutting down" if state.draining else "engine stopped",
            "service_unavailable",
        )
    return Response(status_code=200)


async def prometheus(request: Request):
    registry = _state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def version():
    return {"version": __version__}


async def models(request: Request):
    state = _state(request)
    name = state.config.served_model_name
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "pagefleet",
                "root": name,  # never the checkpoint's path
                "max_model_len": state.limits.max_model_len,
            },
            *adapter_cards(state.engine, name, state.limits.max_model_len),
        ],
    }


async def tokenize(req: TokenizeRequest, request: Request):
    state = _state(request)
    _check_model(state, req.model)
    if req.messages is not None:
        ids = await _chat_prompt(state, req)
    else:
        ids = await state.tokens.encode(req.prompt, req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.limits.max_model_len}


async def detokenize(req: DetokenizeRequest, request: Request):
    state = _state(request)
    _check_model(state, req.model)
    state.engine.limits.rules.check_token_ids(req.tokens, "token ids", "tokens")
    return {"prompt": await state.tokens.decode(req.tokens)}


async def completions(req: CompletionRequest, request: Request):
    state = _state(request)
    lora = _check_model(state, req.model)
    _check_fleet(state, req, request)
    sequences = state.limits.check_sequences(len(req.prompts()), req.n)
    prompts = [await _encode(state, p, req.add_special_tokens) for p in req.prompts()]
    rules = state.engine.limits.rules
    params = [
        _params(req, rules.fit_max_tokens(len(p), req.max_tokens), req.logprobs) for p in prompts
    ]
    for prompt, sp in zip(prompts, params, strict=True):  # every one before any is submitted
        state.engine.check_request(prompt, sp)
    await _check_fields(state, req, params[0], request)
    rid = _request_id(request, "cmpl")
    _check_capacity(state, sequences)  # and submit at once, with no await in between
    gens = [
        _submit(state, f"{rid}-{i}", p, sp, lora)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    created = int(time.time())
    model, tokenizer = _model_name(state, lora), state.tokenizer
    if req.stream:
        return _sse(_completion_chunks(gens, rid, created, model, req, prompts, tokenizer))
    finals = await _collect(gens, request)
    choices = []
    for i, (prompt, out) in enumerate(zip(req.prompts(), finals, strict=True)):
        echo = echoed_prompt(req, prompt, out, tokenizer)
        for c in out.outputs:
            part = choice_part(c, echo=echo)
            choices.append(
                {
                    "index": i * req.n + c.index,
                    "text": part.text,
                    "logprobs": completion_logprobs(part.logprobs, part.token_ids, tokenizer)
                    if req.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **_prompt_logprobs(req, out, tokenizer),
                }
            )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(prompts, finals),
        **_kv_transfer_params(finals),
    }


async def chat(req: ChatCompletionRequest, request: Request):
    state = _state(request)
    lora = _check_model(state, req.model)
    _check_fleet(state, req, request)
    sequences = state.limits.check_sequences(1, req.n)
    parser = _tool_parser(state, req)
    prompt = await _chat_prompt(state, req)
    max_tokens = state.engine.limits.rules.fit_max_tokens(len(prompt), req.requested_max_tokens())
    top = req.top_logprobs or 0
    params = _params(req, max_tokens, top if req.logprobs else None)
    state.engine.check_request(prompt, params)
    await _check_fields(state, req, params, request)
    rid = _request_id(request, "chatcmpl")
    _check_capacity(state, sequences)  # and submit at once, with no await in between
    gen = _submit(state, rid, prompt, params, lora)
    created = int(time.time())
    model, tokenizer = _model_name(state, lora), state.tokenizer
    if req.stream:
        return _sse(_chat_chunks(gen, rid, created, model, req, prompt, tokenizer, parser))
    (final,) = await _collect([gen], request)
    choices = []
    for c in final.outputs:
        message, reason = _message(req, c.text, c.finish_reason, parser)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": _chat_logprobs(c.logprobs, c.token_ids, tokenizer, top)
                if req.logprobs
                else None,
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage([prompt], [final]),
        **_prompt_logprobs(req, final, tokenizer),
        **_kv_transfer_params([final]),
    }


def _model_name(state: ServerState, lora: LoRARequest | None) -> str:
    """The `model` an answer names: the adapter the request ran with, or the base model."""
    return lora.lora_name if lora is not None else state.config.served_model_name


def _message(req, text: str, reason: str | None, parser: Parser | None) -> tuple[dict, str | None]:
    """A finished choice's message (its tool calls parsed out) and finish reason."""
    if parser is None:
        return {"role": "assistant", "content": text}, reason
    parsed = parser(text, True)
    fields = message_fields(parsed, [new_call_id() for _ in parsed.calls])
    return {"role": "assistant", **fields}, finish_reason(parsed, reason, _named(req))


def _named(req: ChatCompletionRequest) -> bool:
    return req.tool_choice not in ("none", "auto", "required")


_ROUTES = (
    ("GET", "/health", health),
    ("GET", "/metrics", prometheus),
    ("GET", "/version", version),
    ("GET", "/v1/models", models),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat),
    *LORA_ROUTES,
)


def _prompt_logprobs(req, out: RequestOutput, tokenizer) -> dict:
    """vLLM's `prompt_logprobs` field, when the client asked for it by name."""
    if req.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs, tokenizer)}


def _kv_transfer_params(finals) -> dict:
    """A prefill engine's answer carries where the decode engine reads the blocks (vLLM)."""
    params = next((f.kv_transfer_params for f in finals if f.kv_transfer_params), None)
    return {"kv_transfer_params": params} if params else {}


async def _check_fields(state: ServerState, req, params: SamplingParams, request: Request) -> None:
    """Count (and log) fields the server ignores; compile the request's grammar now (cached
    for the engine), so a constraint that cannot compile is a 400 before any response."""
    ignored = req.ignored_fields()
    if ignored:
        state.metrics.count_ignored(ignored)
    if params.structured_outputs is not None:
        try:
            tenant = _tenant(request.headers.get(TENANT_HEADER), req.user)
            await state.engine.check_structured_outputs(params.structured_outputs, tenant)
        except ValueError as e:
            raise APIError(400, str(e), param=_constraint_field(req)) from None


def _tenant(header: str | None, user: str | None) -> str:
    """Whose turn a grammar compile waits in: the tenant header (the router forwards it),
    else OpenAI's `user` field, else everyone's shared turn. Hashed: a fixed-size key."""
    name = header or user
    if not name:
        return ""
    return hashlib.blake2b(name.encode("utf-8", "replace"), digest_size=8).hexdigest()


def _constraint_field(req) -> str | None:
    """The request field that carries the output constraint (for an error's param): a
    constraint field, else tool_choice (required or a named function is enforced as one)."""
    names = ("response_format", "structured_outputs", "guided_json", "guided_regex")
    names += ("guided_choice", "guided_grammar")
    field = next((name for name in names if getattr(req, name, None) is not None), None)
    return field or ("tool_choice" if getattr(req, "tools", None) else None)


def _params(req, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def _cancel_and_close(tasks, gens) -> None:
    """Stop the tasks iterating the streams, then close the streams (which aborts unfinished
    requests in the engine). A stream can only be closed once no task is inside it."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for g in gens:
        await g.aclose()


async def _sse_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except APIError as e:  # after the first byte: a clean error event, then the end
            yield f"data: {json.dumps(error_body(e.message, e.type, e.status, e.param))}\n\n"
        except Exception as e:  # the engine failed mid-stream
            body = error_body(f"internal error: {e}", "internal_error", 500)
            yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def _sse(chunks: AsyncIterator[dict]) -> ClosingStreamingResponse:
    return ClosingStreamingResponse(
        _sse_events(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _merge(gens) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index. The queue is
    bounded: when the client stops reading, the streams stop being drained (each keeps only
    its latest output, and aborts its request once stalled too long)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(gens) + 1)
    done = object()

    async def pump(i, gen):
        # Nothing is put once cancelled: the consumer is gone and the queue may be full.
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as e:  # re-raised in the consumer
            await queue.put((i, e))
            return
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        with anyio.CancelScope(shield=True):  # see ClosingStreamingResponse
            await _cancel_and_close(tasks, gens)


async def _completion_chunks(gens, rid, created, model, req: CompletionRequest, prompts, tokenizer):
    sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, sample) -> (chars, tokens)
    offsets: dict[tuple[int, int], int] = {}  # text_offset of the next token
    finals: dict[int, RequestOutput] = {}
    async with aclosing(_merge(gens)) as merged:
        async for i, out in merged:
            for c in out.outputs:
                key = (i, c.index)
                chars, toks = sent.get(key, (0, 0))
                if len(c.text) == chars and not c.finished and len(c.token_ids) == toks:
                    continue
                if key in sent and sent[key] == (-1, -1):
                    continue  # its final chunk went out already
                # The echo goes with each choice's first chunk.
                echo = None if key in sent else echoed_prompt(req, req.prompts()[i], out, tokenizer)
                part = choice_part(c, chars, toks, echo)
                logprobs = None
                if req.logprobs is not None and part.logprobs is not None:
                    logprobs = completion_logprobs(
                        part.logprobs, part.token_ids, tokenizer, offsets.get(key, 0)
                    )
                    offsets[key] = next_text_offset(logprobs, offsets.get(key, 0))
                choice = {
                    "index": i * req.n + c.index,
                    "text": part.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                sent[key] = (-1, -1) if c.finished else (len(c.text), len(c.token_ids))
                yield {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    **continuous_usage(req, len(prompts[i]), len(c.token_ids)),
                }
            if out.finished:
                finals[i] = out
    if req.stream_options and req.stream_options.include_usage:
        yield {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [],
            "usage": _usage(prompts, [finals[i] for i in sorted(finals)]),
        }


async def _chat_chunks(
    gen, rid, created, model, req: ChatCompletionRequest, prompt, tokenizer, parser=None
):
    def chunk(choices):
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }

    yield {
        **chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(req.n)
            ]
        ),
        **continuous_usage(req, len(prompt), 0),
    }
    sent: dict[int, tuple[int, int]] = {}
    # Per choice: the tool-call parser's state (what of its snapshot went out).
    tool_streams = {i: ToolStream(parser) for i in range(req.n)} if parser else {}
    final = None
    async with aclosing(_merge([gen])) as merged:
        async for _, out in merged:
            for c in out.outputs:
                chars, toks = sent.get(c.index, (0, 0))
                if chars < 0:
                    continue
                if len(c.text) == chars and not c.finished and len(c.token_ids) == toks:
                    continue
                logprobs = None
                if req.logprobs and c.logprobs is not None:
                    logprobs = _chat_logprobs(
                        c.logprobs[toks:], c.token_ids[toks:], tokenizer, req.top_logprobs or 0
                    )
                reason = c.finish_reason
                if parser is None:
                    delta = {"content": c.text[chars:]} if len(c.text) > chars else {}
                else:
                    stream = tool_streams[c.index]
                    delta = stream.delta(c.text, c.finished)
                    if reason is not None:
                        reason = finish_reason(stream.parsed(c.text), reason, _named(req))
                sent[c.index] = (-1, -1) if c.finished else (len(c.text), len(c.token_ids))
                yield {
                    **chunk(
                        [
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": logprobs,
                                "finish_reason": reason,
                                "stop_reason": c.stop_reason,
                            }
                        ]
                    ),
                    **continuous_usage(req, len(prompt), len(c.token_ids)),
                }
            if out.finished:
                final = out
    if req.stream_options and req.stream_options.include_usage and final is not None:
        yield {**chunk([]), "usage": _usage([prompt], [final])}


def _usage(prompts: list[list[int]], finals: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def _chat_logprobs(entries: list[TokenLogprobs] | None, tokens: list[int], tokenizer, top_k: int):
    if entries is None:
        return None

    def item(tok: int, logprob: float) -> dict:
        text = _token_text(tokenizer, tok)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for entry, token in zip(entries, tokens, strict=True):
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= top_k)
        content.append(
            {**item(token, entry[token].logprob), "top_logprobs": [item(t, lp) for _, t, lp in top]}
        )
    return {"content": content}
