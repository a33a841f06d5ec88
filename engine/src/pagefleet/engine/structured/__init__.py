"""Structured outputs: grammars compiled off the engine thread, a matcher per sequence, and the
per-step token masks (plus `logit_bias`) applied to the logits before sampling.

The grammar engine is llguidance, chosen by measurement over xgrammar (docs/benchmarks.md,
issue 24): on this project's CPU box both compile a nested JSON schema and mask a 32k vocabulary
fast enough (xgrammar: 1.4-23 ms compile, 8-25 us/step; llguidance: ~1 ms compile because its
lexer is lazy, 28-51 us/step), so the deciding points were elsewhere. llguidance's wheel is abi3
with no Python dependencies, where xgrammar pins torch, triton and transformers ranges and needs
apache-tvm-ffi (a risk for an image pinned to one torch); and llguidance bounds every grammar's
work with fuel limits (`LLParserLimits`), so a pathological regex fails with an error instead of
pinning a compile thread, which is what a hostile client needs. It also rolls back and
validates token lists, which speculative decoding uses.
"""

from pagefleet.engine.structured.compiler import GrammarCompiler, GrammarError
from pagefleet.engine.structured.gate import GrammarGate, advance_grammar, trim_drafts
from pagefleet.engine.structured.logits import constrain_logits
from pagefleet.engine.structured.matcher import SequenceGrammar

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarGate",
    "SequenceGrammar",
    "advance_grammar",
    "constrain_logits",
    "trim_drafts",
]
