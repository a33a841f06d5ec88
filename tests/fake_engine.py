"""A scripted stand-in engine for router tests: `/health`, a `/metrics` page with the gauges the
router scores pods by, and completions endpoints that answer as told (a status, a hang, a stream
cut after its first chunk, a prefill pod's kv_transfer_params). It records what it received, so
a test can prove which pods a request reached and in what order, without relying on a tie-break.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagefleet.fleet.up import free_port


@dataclass
class Script:
    """How the fake answers completions."""

    status: int = 200
    hang: bool = False  # never answer (a hung pod)
    cut_stream_after_first_chunk: bool = False
    kv_transfer_params: dict | None = None  # answer as a prefill pod holding blocks
    text: str = "fake answer"


@dataclass
class FakeEngine:
    name: str
    script: Script = field(default_factory=Script)
    waiting: float = 0.0  # vllm:num_requests_waiting
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc
    received: list[dict] = field(default_factory=list)
    received_headers: list[dict] = field(default_factory=list)  # each request's, lower-case
    scrapes: int = 0
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return self.url.removeprefix("http://")

    def __enter__(self) -> FakeEngine:
        config = uvicorn.Config(
            build_app(self),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, f"fake engine {self.name} did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def build_app(fake: FakeEngine) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        card = {"id": "tiny", "object": "model", "owned_by": fake.name}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        fake.scrapes += 1
        return Response(
            f"vllm:num_requests_waiting {fake.waiting}\n"
            f"vllm:num_requests_running 0.0\n"
            f"vllm:kv_cache_usage_perc {fake.kv_usage}\n",
            media_type="text/plain",
        )

    async def complete(request: Request):
        body = await request.json()
        fake.received.append(body)
        fake.received_headers.append(dict(request.headers))
        script = fake.script
        if script.hang:
            await asyncio.sleep(3600)
        if script.status != 200:
            return JSONResponse(
                {"error": {"message": f"{fake.name} fails", "code": script.status}},
                script.status,
            )
        if body.get("stream"):
            return StreamingResponse(_stream(fake), media_type="text/event-stream")
        answer = {"id": fake.name, "choices": [{"index": 0, "text": script.text}]}
        if script.kv_transfer_params is not None:
            answer["kv_transfer_params"] = script.kv_transfer_params
        return answer

    app.post("/v1/completions")(complete)
    app.post("/v1/chat/completions")(complete)
    return app


async def _stream(fake: FakeEngine):
    chunk = {"id": fake.name, "choices": [{"index": 0, "text": fake.script.text}]}
    yield f"data: {json.dumps(chunk)}\n\n"
    if fake.script.cut_stream_after_first_chunk:
        raise ConnectionResetError("the engine died mid-stream")
    yield "data: [DONE]\n\n"


def wait_scraped(*fakes: FakeEngine, timeout: float = 30.0) -> None:
    """Until the router has read every fake's gauges: a second scrape started, so the first
    one's values are in (scrapes run one after another)."""
    start = {f.name: f.scrapes for f in fakes}
    deadline = time.monotonic() + timeout
    while any(f.scrapes < start[f.name] + 2 for f in fakes):
        assert time.monotonic() < deadline, "the router never scraped the fake engines"
        time.sleep(0.05)
