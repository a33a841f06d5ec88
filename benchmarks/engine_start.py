"""Engine start: what a `pagefleet serve` pays before its first request (a pod's model-load
phase, every scale from zero, every test's engine).

1. End to end: `pagefleet serve` of the tiny model, process start -> /health answering, at the
   default --kv-cache-memory (4 GiB on CPU) and at 0.05 GiB, `--rounds` times each (median).
2. Its two parts that this tree changed, each against what it replaced, in the same run:
   - the KV pool: an anonymous mapping zeroed by the kernel on first touch
     (`kv_cache/pool_memory.zeroed`) vs `torch.zeros` writing all of it, at 4 GiB;
   - structured outputs' import: `pagefleet.engine.structured` vs the same plus
     `llguidance.torch` (which pulls in torch._dynamo), each in a fresh interpreter.

    .venv/bin/python benchmarks/engine_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from procs import process, wait_healthy

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
GiB = 1 << 30


def time_to_health(model: str, *flags: str) -> float:
    """Seconds from the process' start to /health answering 200 (asked every 20 ms)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [PAGEFLEET, "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    started = time.monotonic()
    with process(argv):
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120, interval=0.02)
        return time.monotonic() - started


def pool_allocation(rounds: int) -> tuple[float, float]:
    """Median seconds to a usable 4 GiB float32 pool: (torch.zeros, zeroed)."""
    import torch

    from pagefleet.engine.kv_cache.pool_memory import zeroed

    shape, cpu = (GiB // 4,), torch.device("cpu")
    written, mapped = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        pool = torch.zeros(shape, dtype=torch.float32)
        written.append(time.perf_counter() - t)
        del pool
        t = time.perf_counter()
        pool = zeroed(shape, torch.float32, cpu)
        mapped.append(time.perf_counter() - t)
        del pool
    return statistics.median(written), statistics.median(mapped)


def import_seconds(statement: str, rounds: int) -> float:
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    runs = [
        float(subprocess.check_output([sys.executable, "-c", code], text=True))
        for _ in range(rounds)
    ]
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(Path(tmp) / "tiny", "LlamaForCausalLM"))
        for label, flags in (
            ("default KV (4 GiB)", ()),
            ("--kv-cache-memory 0.05", ("--kv-cache-memory", "0.05")),
        ):
            runs = [time_to_health(model, *flags) for _ in range(args.rounds)]
            print(f"serve -> /health, {label}: median {statistics.median(runs):.2f} s {runs}")
    written, mapped = pool_allocation(args.rounds)
    print(
        f"4 GiB pool: torch.zeros {written:.3f} s, zeroed {mapped:.4f} s ({written / mapped:.0f}x)"
    )
    torch_only = import_seconds("import torch", args.rounds)
    ours = import_seconds("import pagefleet.engine.structured", args.rounds)
    before = import_seconds("import pagefleet.engine.structured, llguidance.torch", args.rounds)
    print(
        f"import (torch alone {torch_only:.2f} s): structured {ours:.2f} s, "
        f"with llguidance.torch {before:.2f} s ({before / ours:.2f}x)"
    )


if __name__ == "__main__":
    main()
