"""Structured outputs: what a JSON-schema grammar costs a step, at concurrency 1 and 64.

The ~57M Llama-style checkpoint of offline_throughput.py, float32 on CPU. Each round runs the
same seeded requests twice, interleaved (the machine is shared): free (ignore_eos) and under a
JSON schema that cannot finish within max_tokens (an array of at least 1000 objects), so both
sides decode the same number of tokens. Reports decode step time and tokens/s per side and
their ratio (median over rounds), the time the grammar path itself takes per decode step (masks
and logit processing, matcher advance: timed inside the engine, so less sensitive to a busy
machine than the A/B ratio) against the free step, plus grammar compile time cold (a schema
never seen) and cached (the LRU hit every later request with that schema gets).

    .venv/bin/python benchmarks/structured_outputs.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import SHAPE  # the same checkpoint shape

import pagefleet.engine.llm_engine as llm_engine
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model.tiny import write_tiny_checkpoint
from pagefleet.engine.sampling_params import StructuredOutputsParams


def schema(tag: str = "") -> dict:
    item = {
        "type": "object",
        "properties": {
            f"id{tag}": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["a", "b", "c"]},
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            },
        },
        "required": [f"id{tag}", "name", "kind", "pos"],
    }
    return {"type": "array", "items": item, "minItems": 1000}


def constraint(tag: str = "") -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(schema(tag), sort_keys=True))


class GrammarTimer:
    """Wall time spent in the grammar path of the engine (masks + logit_bias, advancing)."""

    def __init__(self, engine) -> None:
        self.seconds = 0.0
        constrain, advance = llm_engine.constrain_logits, llm_engine.advance_grammar
        llm_engine.constrain_logits = self._timed(constrain)
        llm_engine.advance_grammar = self._timed(advance)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run(llm: LLM, concurrency: int, max_tokens: int, grammar: bool, seed: int) -> dict:
    """Decode `concurrency` requests to max_tokens; step time over decode steps only."""
    engine = llm.engine
    timer = engine.grammar_timer
    timer.seconds = 0.0
    so = constraint() if grammar else None
    for i in range(concurrency):
        prompt = [10 + (seed * 131 + i * 17 + j) % 31000 for j in range(32)]
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, seed=seed * 1000 + i, structured_outputs=so
        )
        engine.add_request(None, prompt, params)
    steps, tokens = [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t
        if engine.scheduler.running and not any(  # a pure decode step
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            steps.append(dt)
        tokens += sum(len(c.token_ids) for o in outputs if o.finished for c in o.outputs)
    wall = time.perf_counter() - start
    return {
        "step_ms": 1e3 * statistics.median(steps),
        "tok_s": tokens / wall,
        "tokens": tokens,
        "grammar_ms_per_step": 1e3 * timer.seconds / max(len(steps), 1),
    }


def compile_times(llm: LLM, n: int = 5) -> tuple[float, float]:
    """(cold, cached) seconds to get a compiled grammar, medians over `n` fresh schemas."""
    compiler = llm.engine.grammars.compiler
    cold, cached = [], []
    for i in range(n):
        so = constraint(tag=f"_{time.monotonic_ns()}_{i}")
        t = time.perf_counter()
        compiler.wait(compiler.compile(so))
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiler.wait(compiler.compile(so))
        cached.append(time.perf_counter() - t)
    return statistics.median(cold), statistics.median(cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens-c1", type=int, default=64)
    parser.add_argument("--tokens-c64", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(Path(tmp) / "bench", "LlamaForCausalLM", **SHAPE))
        llm = LLM(path, max_model_len=512, max_num_seqs=64)
        llm.engine.grammar_timer = GrammarTimer(llm.engine)
        cold, cached = compile_times(llm)
        print(f"grammar compile: cold {cold * 1e3:.2f} ms, cached {cached * 1e6:.1f} us")
        run(llm, 4, 8, True, seed=99)  # warm-up, both paths
        run(llm, 4, 8, False, seed=99)
        for concurrency, max_tokens in ((1, args.tokens_c1), (64, args.tokens_c64)):
            ratios, step_ratios, free_runs, json_runs = [], [], [], []
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                got = {g: run(llm, concurrency, max_tokens, g, seed=r) for g in order}
                free_runs.append(got[False])
                json_runs.append(got[True])
                ratios.append(got[True]["tok_s"] / got[False]["tok_s"])
                step_ratios.append(got[True]["step_ms"] / got[False]["step_ms"])
            med = statistics.median
            print(
                f"concurrency {concurrency:>2}: free {med(x['tok_s'] for x in free_runs):7.1f}"
                f" tok/s, step {med(x['step_ms'] for x in free_runs):6.1f} ms | json schema"
                f" {med(x['tok_s'] for x in json_runs):7.1f} tok/s, step"
                f" {med(x['step_ms'] for x in json_runs):6.1f} ms | throughput ratio"
                f" {med(ratios):.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)}),"
                f" step-time ratio {med(step_ratios):.3f}"
            )
            grammar_ms = med(x["grammar_ms_per_step"] for x in json_runs)
            free_step = med(x["step_ms"] for x in free_runs)
            print(
                f"  grammar path: {grammar_ms:.2f} ms per decode step ="
                f" {100 * grammar_ms / free_step:.1f}% of the free step"
            )


if __name__ == "__main__":
    main()
