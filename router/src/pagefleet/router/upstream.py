"""The router's connections to engines: an httpx transport over aiohttp's keep-alive pool.

The router speaks httpx everywhere (tests hand it httpx clients with mock transports), but
httpcore's pool and its pure-Python HTTP/1.1 parser cost the relay dearly under load: every
request start and end scans the pool quadratically in its idle connections, and every SSE
chunk passes h11 and anyio (issue 23's profile). aiohttp's pool and C parser do the same work
for a fraction of the CPU; this transport keeps httpx's interface and exceptions on top.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

# Engines run uvicorn, which closes idle keep-alive connections after 5 s; reusing one it is
# closing would fail a request that never reached it, so connections retire a little earlier.
KEEPALIVE_S = 4.0
# Request headers aiohttp sets itself from the URL and the body.
_OWN_HEADERS = {b"host", b"content-length", b"transfer-encoding", b"connection"}


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx requests sent on aiohttp's pooled connections; responses stream their raw bytes
    (closing one before its end closes its connection, which aborts the engine's request)."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S) -> None:
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None  # made on the loop that uses it

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=0, keepalive_timeout=self.keepalive_s, use_dns_cache=True
            )
            # Bodies stay as the engine sent them: httpx decodes (or the relay forwards) them.
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout") or {}
        body = await request.aread()
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() not in _OWN_HEADERS
        ]
        try:
            upstream = await self._open().request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=timeout.get("connect"), sock_read=timeout.get("read")
                ),
            )
        except Exception as e:
            raise _as_httpx(e, request) from e
        return httpx.Response(
            upstream.status,
            headers=list(upstream.raw_headers),
            stream=_Body(upstream, request),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _Body(httpx.AsyncByteStream):
    def __init__(self, upstream: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self.upstream, self.request = upstream, request

    async def __aiter__(self):
        try:
            async for chunk in self.upstream.content.iter_any():
                yield chunk
        except Exception as e:
            raise _as_httpx(e, self.request) from e

    async def aclose(self) -> None:
        if self.upstream.content.at_eof():
            self.upstream.release()  # the connection goes back to the pool
        else:
            self.upstream.close()  # cut short: the engine sees its client leave


def _as_httpx(error: Exception, request: httpx.Request) -> Exception:
    """aiohttp's failures as the httpx errors the router handles (others pass unchanged)."""
    message = repr(error)
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(error, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(error, asyncio.TimeoutError):  # aiohttp's read timeouts are TimeoutErrors
        return httpx.ReadTimeout(message, request=request)
    if isinstance(error, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(error, aiohttp.ClientError | OSError):
        return httpx.ReadError(message, request=request)
    return error


def engine_gone(error: httpx.HTTPError) -> bool:
    """Whether a request that failed before the first byte of its answer found no engine
    there: its connection was refused, timed out or was reset (an engine that is starting,
    has died or was deleted). A read timeout is not one: the engine took the request and is
    slow, or frozen."""
    return isinstance(
        error,
        httpx.ConnectError | httpx.ConnectTimeout | httpx.RemoteProtocolError | httpx.ReadError,
    )
