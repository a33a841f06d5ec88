"""Streaming tool-call parsing: the resumable scanners (`ToolStream`) against re-parsing the
whole output at every chunk (what streaming did before), on one long Hermes call streamed
4 characters a chunk; the two take turns over --rounds rounds, ratio of the medians.

    .venv/bin/python benchmarks/tool_stream.py [--chars 4500 16000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagefleet.engine.server.tool_parsers import ToolStream, parse_hermes

CHUNK = 4  # characters a token, about


def call_text(chars: int) -> str:
    """A `write` call whose file content makes the output about `chars` characters long."""
    arguments = json.dumps({"path": "a.py", "content": "x = 1\n" * (chars // 7)})
    return f'Sure.\n<tool_call>\n{{"name": "write", "arguments": {arguments}}}\n</tool_call>'


def streamed(text: str) -> float:
    stream = ToolStream(parse_hermes)
    start = time.perf_counter()
    for end in range(CHUNK, len(text) + CHUNK, CHUNK):
        stream.delta(text[:end], end >= len(text))
    return time.perf_counter() - start


def reparsed(text: str) -> float:
    start = time.perf_counter()
    for end in range(CHUNK, len(text) + CHUNK, CHUNK):
        parse_hermes(text[:end], end >= len(text))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chars", type=int, nargs="+", default=[4500, 16000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for chars in args.chars:
        text = call_text(chars)
        new, old = [], []
        for _ in range(args.rounds):
            new.append(streamed(text))
            old.append(reparsed(text))
        a, b = statistics.median(new), statistics.median(old)
        print(
            f"{len(text)} chars, {CHUNK}-char chunks: streamed {a * 1e3:.1f} ms, "
            f"re-parse per chunk {b * 1e3:.1f} ms, ratio {b / a:.0f}x"
        )


if __name__ == "__main__":
    main()
