"""HTTP pieces the engine and the router share: OpenAI-shaped errors, the bearer-key check,
the request-body limit, waiting for a client to disconnect, and a streamed response that
cleans up as soon as its client leaves."""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse


class APIError(Exception):
    """An OpenAI-shaped error to answer with (the apps turn it into a JSON response)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param), status, headers=headers)


def bearer_ok(authorization: str, api_key: str) -> bool:
    """Constant-time check of an `Authorization: Bearer <key>` header."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode())


def check_api_key(
    authorization: str, api_key: str | None, path: str, open_paths: tuple[str, ...]
) -> JSONResponse | None:
    """The 401 to answer, or None when the key is right, not required, or the path is open."""
    if not api_key or path in open_paths or bearer_ok(authorization, api_key):
        return None
    return error_response(401, "invalid or missing API key", "authentication_error")


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 before any handler sees it, whether
    it declares its length or comes chunked. The body is read here, up to the limit, and
    replayed to the app; the rest is never read (the connection closes)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return None
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._reject(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await self.app(scope, _Replay(b"".join(chunks), receive), send)

    async def _reject(self, scope, receive, send):
        response = error_response(
            413,
            f"request body larger than {self.limit} bytes",
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


class _Replay:
    """An ASGI receive that gives the buffered body once, then the client's own messages
    (a disconnect, which handlers wait for)."""

    def __init__(self, body: bytes, receive) -> None:
        self._body, self._receive = body, receive

    async def __call__(self):
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()


async def wait_disconnect(request: Request) -> None:
    """Return once the client has gone (call after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that closes its body the moment it ends. Starlette leaves an
    unfinished body to the garbage collector: a client that left would keep its requests
    running, its upstream connection open and its counters unset until a collection happened
    to find the generator. Once the client is gone Starlette cancels the response's scope
    again at every await, so a body shields the awaits of its own cleanup
    (`anyio.CancelScope(shield=True)`): an interrupted close is no close."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()
