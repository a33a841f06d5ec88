"""HTTP pieces the engine and the router share: OpenAI-shaped errors, the bearer-key check,
and waiting for a client to disconnect."""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse


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


async def wait_disconnect(request: Request) -> None:
    """Return once the client has gone (call after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
