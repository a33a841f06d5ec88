"""Compile a request's `StructuredOutputsParams` into an llguidance matcher on a few threads,
off the engine thread, with a bounded LRU cache keyed by the params (plain, hashable data).

A compiled grammar is a pristine matcher; each sequence gets a cheap deep copy of it.

Compiles wait their turn per tenant (`fair_pool.FairPool`): a client that sends many distinct
slow grammars queues behind itself, while another tenant's compile waits for at most one
compile of each tenant ahead of it, not for the whole flood (whose own compiles may time out).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from pagefleet.engine.sampling_params import StructuredOutputsParams
from pagefleet.engine.structured.fair_pool import FairPool

# Every grammar's work is bounded by fuel (llguidance's limits, well under its defaults): a
# hostile regex or schema fails with an error instead of holding a compile thread for long.
PARSER_LIMITS = dict(
    initial_lexer_fuel=500_000,  # ~10 ms of regex analysis at build
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=200_000,
    verbose_errors=False,  # errors go back to clients: never echo parser internals
)
# Compact JSON (no free whitespace): a model cannot pad an object with blanks until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The constraint cannot be compiled (bad syntax, unsupported schema, limits, timeout)."""


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (serialized) for one constraint. Pure; raises GrammarError on
    text that is not even well-formed (a schema that is not JSON, say)."""
    try:
        if params.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(
                params.json, defaults=dict(JSON_OPTIONS)
            )
        if params.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=dict(JSON_OPTIONS)
            )
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar or ""))
    except GrammarError:
        raise
    except Exception as e:  # the converters raise ValueError and friends on bad text
        raise GrammarError(f"invalid structured output constraint: {e}") from None


def build_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]):
    """llguidance's view of the checkpoint's tokenizer, over the model's (padded) vocabulary."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(
        hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None
    )


def compile_matcher(tokenizer, source: str) -> llguidance.LLMatcher:
    """Build (and check) a pristine matcher: the compiled grammar."""
    limits = llguidance.LLParserLimits(**PARSER_LIMITS)
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=limits)
    if matcher.is_error():
        raise GrammarError(f"invalid structured output constraint: {matcher.get_error()}")
    return matcher


@dataclass
class Compilation:
    """One cache entry: the compile's future and when it started (for the timeout)."""

    future: Future = field(default_factory=Future)
    started: float = field(default_factory=time.monotonic)


class GrammarCompiler:
    """Thread-safe: the engine thread and the API server's handlers both submit compiles."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_ids: frozenset[int],
        *,
        max_workers: int = 2,
        cache_size: int = 256,
        timeout_s: float = 10.0,
    ) -> None:
        self.timeout_s = timeout_s
        self._hf_tokenizer, self._vocab_size, self._eos_ids = hf_tokenizer, vocab_size, eos_ids
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._pool = FairPool(max_workers, "pagefleet-grammar")
        self._cache: OrderedDict[StructuredOutputsParams, Compilation] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # compiles started (cache misses)

    def compile(self, params: StructuredOutputsParams, tenant: str = "") -> Compilation:
        """The compilation of `params` for `tenant`: cached (and queued in this tenant's turn
        too while it has not started), or queued now in the tenant's turn."""
        with self._lock:
            entry = self._cache.get(params)
            if entry is not None:
                self._cache.move_to_end(params)
                self._pool.submit(tenant, entry.future, self._compile, params)  # no-op if begun
                return entry
            entry = Compilation()
            self._pool.submit(tenant, entry.future, self._compile, params)
            self.compiles += 1
            self._cache[params] = entry
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # a waiter still holds its own entry
            return entry

    def result(self, entry: Compilation) -> llguidance.LLMatcher | None:
        """The compiled grammar if ready, None while compiling; raises GrammarError if the
        compile failed or has run past the timeout."""
        if entry.future.done():
            return entry.future.result()
        if time.monotonic() - entry.started > self.timeout_s:
            with self._lock:  # do not cache a timeout for good: the machine may have been busy
                for key, cached in list(self._cache.items()):
                    if cached is entry:
                        del self._cache[key]
            raise GrammarError(f"structured output grammar took over {self.timeout_s:g} s")
        return None

    def wait(self, entry: Compilation) -> llguidance.LLMatcher:
        """Block until compiled (or failed, or timed out); for callers off the engine thread."""
        remaining = self.timeout_s - (time.monotonic() - entry.started)
        try:
            return entry.future.result(timeout=max(remaining, 0.0))
        except TimeoutError:
            self.result(entry)  # raises the timeout, uncaching the entry
            raise

    def close(self) -> None:
        self._pool.close()

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        return compile_matcher(self._llg_tokenizer(), grammar_source(params))

    def _llg_tokenizer(self):
        with self._tokenizer_lock:  # built once, on first use (about a second for 150k vocabs)
            if self._tokenizer is None:
                self._tokenizer = build_tokenizer(
                    self._hf_tokenizer, self._vocab_size, self._eos_ids
                )
            return self._tokenizer
