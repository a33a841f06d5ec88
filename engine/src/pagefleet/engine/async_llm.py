"""AsyncLLM: the engine on its own thread, driven from asyncio.

The forward pass blocks, so it runs on a dedicated thread that owns the `LLMEngine`; the event
loop only queues commands (add, abort) and receives outputs. HTTP handling therefore never
stalls a step, and a step never stalls HTTP. An abort (or a cancelled consumer) takes effect at
the next step boundary, where the request's blocks are freed.

Outputs are cumulative, so each request keeps only its newest undelivered one: a consumer that
stops reading costs one output, not one per step. One that leaves output unread for longer
than `client_stall_timeout` has its request aborted (its blocks freed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from pagefleet.common.fleet_auth import FleetSecret
from pagefleet.common.kv_events import KVEventListener
from pagefleet.engine.client import EngineLimits, EngineObserver, EngineStats
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.engines import make_engine
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.pooling.params import PoolingParams
from pagefleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagefleet.engine.structured import GrammarError

logger = logging.getLogger("pagefleet.engine")
_STOP = object()
_TICK = ("tick",)  # wakes the loop for KV-transfer work


class _Slot:
    """One request's undelivered output, on the consumer's event loop. The newest output
    replaces an unread one (outputs are cumulative); a failure is never replaced. Output left
    unread for longer than `stall_timeout` calls `on_stall` once."""

    def __init__(self, on_stall: Callable[[], None], stall_timeout: float | None) -> None:
        self.item: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()
        self.on_stall, self.stall_timeout = on_stall, stall_timeout
        self.unread_since: float | None = None
        self.stalled = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self.item, BaseException):
            return
        now = time.monotonic()
        if self.item is None:
            self.unread_since = now
        elif self._stalled(now) and not getattr(item, "finished", True):
            self.stalled = True
            self.on_stall()
        self.item = item
        self.ready.set()

    def _stalled(self, now: float) -> bool:
        return (
            not self.stalled
            and self.stall_timeout is not None
            and now - self.unread_since > self.stall_timeout
        )

    async def take(self) -> RequestOutput | BaseException:
        await self.ready.wait()
        item, self.item, self.unread_since = self.item, None, None
        self.ready.clear()
        return item


class RequestStream:
    """Async iterator over one request's outputs. Its registration is released when it ends,
    when it is closed, or when it is garbage-collected unread (a finalizer), so a client that
    vanished before reading never leaks a request."""

    def __init__(self, llm: AsyncLLM, request_id: str, slot: _Slot) -> None:
        self.request_id = request_id
        self._slot = slot
        self._state = {"finished": False}
        self._release = weakref.finalize(self, _release, weakref.ref(llm), request_id, self._state)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._release.alive:
            raise StopAsyncIteration
        try:
            item = await self._slot.take()
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
    """The engine's `EngineClient` (see client.py): what the server may use of it."""

    def __init__(
        self, build: Callable[[], LLMEngine], client_stall_timeout: float | None = None
    ) -> None:
        """`build` makes the engine on the engine's own thread, which then runs its loop and,
        when the loop stops, closes it. One thread for all of it, because libgomp keeps an
        OpenMP team for every thread that ran a parallel region (loading runs many), and
        while it manages more threads than there are CPUs it stops spin-waiting between
        regions: a team left on the loading thread made every step's small matmuls wake
        sleeping workers (single-stream decode at one thread's speed, benchmarks/cpu_peer.py).
        And processes the engine starts (Ray's) may be tied to the thread that started them."""
        self.client_stall_timeout = client_stall_timeout
        self._observers: list[EngineObserver] = []  # told of stalled aborts, on the loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (consumer's loop, its slot, sequences: n)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Slot, int]] = {}
        # Re-entrant: a RequestStream's finalizer (garbage collection can run it at any
        # allocation, on whichever thread holds this lock) releases its stream under it.
        self._lock = threading.RLock()
        self._closing = False  # the engine's close has begun (on whichever thread)
        self._error: BaseException | None = None
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(build, built), name="pagefleet-engine", daemon=True
        )
        self.engine: LLMEngine  # set on the engine's thread before `built` completes
        self._thread.start()
        built.result()  # the build's error, raised here
        # The server tokenizes on the event loop while the engine thread detokenizes: HF fast
        # tokenizers are not safe to share across threads, so each side has its own.
        from pagefleet.common.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.engine.args.tokenizer or self.engine.args.model)

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        kv_event_listener: KVEventListener | None = None,
        fleet_secret: FleetSecret | None = None,
        client_stall_timeout: float | None = None,
    ) -> AsyncLLM:
        return cls(lambda: make_engine(args, kv_event_listener, fleet_secret), client_stall_timeout)

    # ------------------------------------------------------------------ asyncio side

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Submit now (synchronously: the request counts as unfinished from this call on) and
        return its stream: the cumulative output after every step that advances it. Closing
        the stream early, or dropping it unread, aborts the request. `lora_request`: a
        registered adapter (list_loras), or None for the base model."""
        if self.engine.limits.pooling is not None:
            raise ValueError("this engine runs the pooling runner: it does not generate")
        return self._submit(prompt, params, request_id, lora_request)

    def encode(
        self, prompt: str | list[int], params: PoolingParams, request_id: str
    ) -> RequestStream:
        """A pooling engine's request, submitted now; its stream yields one output, once the
        vector is pooled (or the request aborted)."""
        if self.engine.limits.pooling is None:
            raise ValueError("this engine runs the generate runner: it does not pool")
        return self._submit(prompt, params, request_id)

    def _submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        if self._error is not None:
            raise RuntimeError("the engine loop has died") from self._error
        if not self._thread.is_alive():
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        slot = _Slot(lambda: self._abort_stalled(request_id), self.client_stall_timeout)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (loop, slot, params.n)
        self._commands.put(("add", request_id, prompt, params, lora_request))
        return RequestStream(self, request_id, slot)

    async def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Register an adapter on the engine thread (ValueError if it cannot run here)."""
        return await self._on_engine_thread(self.engine.add_lora, lora_request)

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter on the engine thread (KeyError: unknown; ValueError: in use)."""
        await self._on_engine_thread(self.engine.remove_lora, name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters requests may name (a copy: safe from any thread)."""
        return self.engine.list_loras()

    async def _on_engine_thread(self, fn, *args):
        if not self._thread.is_alive():
            raise RuntimeError("the engine is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, args, future))
        return await asyncio.wrap_future(future)

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished or released."""
        return len(self._streams)

    @property
    def num_unfinished_sequences(self) -> int:
        """Their sequences (n of each)."""
        with self._lock:
            return sum(n for _, _, n in self._streams.values())

    @property
    def num_waiting_sequences(self) -> int:
        """Unfinished sequences not running yet: what admission control counts."""
        return self.num_unfinished_sequences - self.engine.scheduler.num_running

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The scheduler's rules, applied now on the caller's thread (they read only limits
        fixed at start-up); nothing is submitted."""
        self.engine.limits.rules.check(prompt_token_ids, params)

    async def check_structured_outputs(
        self, constraint: StructuredOutputsParams, tenant: str = ""
    ) -> None:
        """Compile `constraint` now, in `tenant`'s turn (off the engine thread; the engine then
        finds it cached); raises GrammarError (a ValueError) if it does not compile within
        the time limit."""
        compiler = self.engine.grammars.compiler
        entry = compiler.compile(constraint, tenant)
        if entry.future.done():  # cached: however long ago it compiled (or failed)
            compiler.result(entry)
            return
        remaining = compiler.timeout_s - (time.monotonic() - entry.started)
        try:  # shielded: a waiter's timeout must not cancel the shared compile
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(entry.future)), remaining)
        except TimeoutError:
            compiler.result(entry)  # raises the timeout (and uncaches it) once past the limit
            raise GrammarError("structured output grammar took too long to compile") from None

    def subscribe(self, observer: EngineObserver) -> None:
        """Tell `observer` of every step, KV pull and stalled abort from now on."""
        self._observers.append(observer)
        self.engine.subscribe(observer)

    def _abort_stalled(self, request_id: str) -> None:
        logger.warning(
            "request %s: its client left output unread for %.0f s; aborting it",
            request_id,
            self.client_stall_timeout,
        )
        self.abort(request_id)
        for observer in self._observers:
            observer.on_stall_abort()

    def _release(self, request_id: str, finished: bool) -> None:
        if not finished:
            self.abort(request_id)
        with self._lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop the request at the next step; safe from any thread."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop, which closes the engine on its way out. A loop still in a step
        after `timeout` has the engine closed from here instead (as a dead rank needs)."""
        self._commands.put(_STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return
        if self._begin_close():  # still in a step: close from here
            self.engine.close()
        else:  # the loop is closing the engine: that ends first
            self._thread.join()

    def _begin_close(self) -> bool:
        """True for the one caller that closes the engine."""
        with self._lock:
            first, self._closing = not self._closing, True
        return first

    @property
    def is_running(self) -> bool:
        # A failed tensor-parallel rank fails the engine (it exits a moment later).
        return self._thread.is_alive() and self.engine.failure is None

    # ------------------------------------------------------------------ engine thread

    def _run(self, build: Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            engine = build()
        except BaseException as e:
            built.set_exception(e)
            return
        if engine.connector is not None:  # a finished pull or a release wakes an idle loop
            engine.connector.wake = lambda: self._commands.put(_TICK)
        self.engine = engine
        built.set_result(None)
        try:
            self._serve()
        finally:
            if self._begin_close():
                engine.close()

    def _serve(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                # Held blocks expire by time: an idle loop still wakes now and then.
                if not self._drain(block, 0.25 if self.engine.holds_blocks else None):
                    return
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
                for request_id, error in self.engine.take_failures():
                    self._deliver(request_id, error)
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
        if command[0] == "call":
            _, fn, args, future = command
            try:
                future.set_result(fn(*args))
            except Exception as e:  # the caller's error, never the loop's
                future.set_exception(e)
            return
        _, request_id, prompt, params, lora_request = command
        try:
            self.engine.add_request(request_id, prompt, params, lora_request=lora_request)
        except Exception as e:  # a bad request fails alone, never the engine loop
            error = e if isinstance(e, ValueError) else ValueError(f"invalid request: {e!r}")
            self._deliver(request_id, error)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, slot, _ = target
            # A closed consumer loop raises RuntimeError: nobody is left to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(slot.put, item)
