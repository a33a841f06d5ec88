"""AsyncLLM: the engine on its own thread, driven from asyncio.

The forward pass blocks, so it runs on a dedicated thread that owns the `LLMEngine`; the event
loop only queues commands (add, abort) and receives outputs. HTTP handling therefore never
stalls a step, and a step never stalls HTTP. An abort (or a cancelled consumer) takes effect at
the next step boundary, where the request's blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import weakref
from typing import Any

from pagefleet.engine.config import EngineArgs
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.kv_events import KVEventListener

_STOP = object()
_TICK = ("tick",)  # wakes the loop for KV-transfer work


class RequestStream:
    """Async iterator over one request's outputs. Its registration is released when it ends,
    when it is closed, or when it is garbage-collected unread (a finalizer), so a client that
    vanished before reading never leaks a request."""

    def __init__(self, llm: AsyncLLM, request_id: str, queue_: asyncio.Queue) -> None:
        self.request_id = request_id
        self._queue = queue_
        self._state = {"finished": False}
        self._release = weakref.finalize(self, _release, weakref.ref(llm), request_id, self._state)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._release.alive:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self._release()
            raise
        if isinstance(item, BaseException):
            self._state["finished"] = True  # it never started in the engine
            self._release()
            raise item
        if item.finished:
            self._state["finished"] = True
            self._release()
        return item

    async def aclose(self) -> None:
        self._release()


def _release(llm_ref, request_id: str, state: dict) -> None:
    llm = llm_ref()
    if llm is not None:
        llm._release(request_id, state["finished"])


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Re-entrant: a RequestStream's finalizer (garbage collection can run it at any
        # allocation, on whichever thread holds this lock) releases its stream under it.
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name="pagefleet-engine", daemon=True)
        self._error: BaseException | None = None
        # The server tokenizes on the event loop while the engine thread detokenizes: HF fast
        # tokenizers are not safe to share across threads, so each side has its own.
        from pagefleet.engine.model.loader import load_tokenizer

        self.tokenizer = load_tokenizer(engine.args.model)
        if engine.connector is not None:  # a finished pull or a release wakes an idle loop
            engine.connector.wake = lambda: self._commands.put(_TICK)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, kv_event_listener: KVEventListener | None = None
    ) -> AsyncLLM:
        return cls(LLMEngine(args, kv_event_listener))

    # ------------------------------------------------------------------ asyncio side

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Submit now (synchronously: the request counts as unfinished from this call on) and
        return its stream: the cumulative output after every step that advances it. Closing
        the stream early, or dropping it unread, aborts the request."""
        if self._error is not None:
            raise RuntimeError("the engine loop has died") from self._error
        if not self._thread.is_alive():
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        queue_: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (loop, queue_)
        self._commands.put(("add", request_id, prompt, params))
        return RequestStream(self, request_id, queue_)

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished or released."""
        return len(self._streams)

    def _release(self, request_id: str, finished: bool) -> None:
        if not finished:
            self.abort(request_id)
        with self._lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop the request at the next step; safe from any thread."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                # Held blocks expire by time: an idle loop still wakes now and then.
                if not self._drain(block, 0.25 if self.engine.holds_blocks else None):
                    return
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
        except BaseException as e:  # deliver the failure to every waiting consumer
            self._error = e
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, RuntimeError(f"engine loop failed: {e!r}"))
            raise

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands (waiting for one if idle); False when asked to stop."""
        try:
            command = self._commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: tuple[Any, ...]) -> None:
        if command is _TICK:
            return  # the step that follows does the work
        if command[0] == "abort":
            output = self.engine.abort_request(command[1])
            if output is not None:  # a consumer still reading gets the final, aborted output
                self._deliver(command[1], output)
            return
        _, request_id, prompt, params = command
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as e:  # a bad request fails alone, never the engine loop
            error = e if isinstance(e, ValueError) else ValueError(f"invalid request: {e!r}")
            self._deliver(request_id, error)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            # A closed consumer loop raises RuntimeError: nobody is left to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stream.put_nowait, item)
