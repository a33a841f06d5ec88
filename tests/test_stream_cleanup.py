"""A client that leaves a stream frees it at once, not when the garbage collector next runs.

Starlette (ASGI spec 2.3, as uvicorn speaks it) cancels a streamed response when the client
disconnects and leaves the unfinished body generator to be finalized by the collector; CI saw
an idle server keep left streams running, and uncounted, for over 30 seconds. These tests drive
the pieces the way Starlette does, holding the generators as a reference cycle would.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import anyio

from pagefleet.common.http_errors import ClosingStreamingResponse
from pagefleet.engine.server.app import _merge


async def _serve_until_client_leaves(body) -> list[bytes]:
    """Run one streamed response; after the first chunk the client stops reading (the write
    never completes) and disconnects."""
    sent: list[bytes] = []
    first_chunk = asyncio.Event()

    async def receive():
        await first_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            if sent:
                await asyncio.Event().wait()  # a write to a client that stopped reading
            sent.append(message["body"])
            first_chunk.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    await ClosingStreamingResponse(body)(scope, receive, send)
    return sent


def test_a_left_stream_closes_its_body_and_finishes_its_cleanup():
    cleaned: list[str] = []

    async def body():
        try:
            for i in range(10_000):
                yield f"data: {i}\n\n"
        finally:
            with anyio.CancelScope(shield=True):  # as the engine's and the router's bodies do
                await asyncio.sleep(0)  # cleanup that awaits (closing an upstream, aborting)
                cleaned.append("done")

    async def main() -> tuple[list[bytes], list[str]]:
        stream = body()  # held, as a reference cycle would hold it until a collection
        sent = await asyncio.wait_for(_serve_until_client_leaves(stream), 30)
        return sent, list(cleaned)  # before asyncio.run's shutdown closes leftover generators

    sent, cleaned_when_answered = asyncio.run(main())
    assert sent == [b"data: 0\n\n"]  # the client left after the first chunk
    assert cleaned_when_answered == ["done"]


def test_closing_a_merge_whose_reader_stopped_closes_every_stream():
    """Producers faster than the reader fill the merge's bounded queue; closing the merge must
    still stop its pumps and close each stream (before, a pump blocked forever on the full
    queue and the streams were never closed)."""
    closed: list[int] = []

    async def stream(i: int):
        try:
            for k in range(1000):
                yield k
                await asyncio.sleep(0)
        finally:
            await asyncio.sleep(0)
            closed.append(i)

    async def main():
        async with aclosing(_merge([stream(0), stream(1)])) as merged:
            await anext(merged)
            for _ in range(20):  # the reader stalls; the pumps fill the queue
                await asyncio.sleep(0)

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert sorted(closed) == [0, 1]
