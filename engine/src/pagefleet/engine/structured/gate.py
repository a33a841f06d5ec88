"""The engine's side of structured outputs, in one place: a constrained request waits here while
its grammar compiles (off the engine thread), then each of its sequences gets its matcher and
the engine queues it; every step a sequence's matcher advances over the tokens it kept, and
drafts its grammar rejects are cut before they are verified.

`GrammarGate` holds the waiting requests by key (the engine's request id) and makes the
compiler on first use; `advance_grammar` and `trim_drafts` are the per-step rules.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.sampling_params import StructuredOutputsParams
from pagefleet.engine.structured.compiler import Compilation, GrammarCompiler, GrammarError
from pagefleet.engine.structured.matcher import SequenceGrammar

logger = logging.getLogger("pagefleet.engine")


@dataclass
class _Waiting:
    compilation: Compilation
    requests: list[Request]  # the sequences that get a matcher each


class GrammarGate:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the API server's handlers ask for the compiler too
        self._waiting: dict[str, _Waiting] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler (pool and cache), made on first use."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def admit(
        self,
        key: str,
        constraint: StructuredOutputsParams,
        requests: list[Request],
        tenant: str = "",
    ) -> bool:
        """Start the compile (or find it cached): True if it is ready and every request now
        carries its matcher, False while it compiles (the requests wait here under `key`).
        Raises GrammarError if the compile failed or timed out."""
        waiting = _Waiting(self.compiler.compile(constraint, tenant), requests)
        if self._attach(waiting):
            return True
        self._waiting[key] = waiting
        return False

    def take_ready(self) -> tuple[list[str], list[tuple[str, GrammarError]]]:
        """The keys whose requests now carry their matchers (to be queued), and those whose
        compile failed (to be failed); both leave the gate."""
        ready, failed = [], []
        for key, waiting in list(self._waiting.items()):
            try:
                if not self._attach(waiting):
                    continue
                ready.append(key)
            except GrammarError as e:
                failed.append((key, e))
            del self._waiting[key]
        return ready, failed

    def discard(self, key: str) -> None:
        """Forget a waiting request (aborted)."""
        self._waiting.pop(key, None)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` for a waiting compile to end (nothing else to do meanwhile)."""
        futures = [w.compilation.future for w in self._waiting.values()]
        concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()

    def _attach(self, waiting: _Waiting) -> bool:
        compiled = self.compiler.result(waiting.compilation)
        if compiled is None:
            return False
        for request in waiting.requests:
            request.grammar = SequenceGrammar(compiled)
        return True


def advance_grammar(request: Request, start: int) -> RequestStatus | None:
    """Walk the request's matcher over the tokens this step kept (from `start`, after stop
    strings cut them); the status to end it with: stopped when the grammar is complete (as
    EOS would end it), aborted when a token broke it, None to go on."""
    grammar = request.grammar
    if not grammar.accept(request.all_token_ids[start:]):
        logger.warning("request %s: a token broke its grammar; aborting", request.request_id)
        return RequestStatus.FINISHED_ABORTED
    if grammar.finished and not request.status.finished:
        return RequestStatus.FINISHED_STOPPED
    return None


def trim_drafts(requests: list[Request]) -> None:
    """Cut each constrained request's drafts where its grammar rejects one: never worth
    verifying."""
    for request in requests:
        if request.grammar is not None and request.spec_token_ids:
            del request.spec_token_ids[request.grammar.draft_prefix(request.spec_token_ids) :]
