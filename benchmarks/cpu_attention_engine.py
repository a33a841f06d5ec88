"""Attention backends through the whole engine on CPU: torch (gather) vs the numba paged kernel
under each of numba's threading layers, end to end on a cut of offline_throughput.py's
decode-heavy workload (b).

Each variant runs in a fresh process (a numba threading layer is chosen once per process, and
a second OpenMP runtime beside torch's is exactly what is being measured), variants
alternating round by round so load on a shared machine hits all alike. Output tokens per
second of generate() after a warm-up; ratios against torch from the same round.

    .venv/bin/python benchmarks/cpu_attention_engine.py [--requests 64] [--rounds 3] \
        [--neighbours N]  # N processes each spinning a core beside every measurement
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, attention backend, environment): numba's default layer here is OpenMP (the system
# libgomp); workqueue is numba's own pool; one thread runs the kernel serially on the caller;
# tbb needs `pip install tbb` (not a dependency: not run unless named in --variants).
VARIANTS = {
    "torch": ("torch", {}),
    "numba-omp": ("numba", {"NUMBA_THREADING_LAYER": "omp"}),
    "numba-workqueue": ("numba", {"NUMBA_THREADING_LAYER": "workqueue"}),
    "numba-1thread": ("numba", {"NUMBA_NUM_THREADS": "1"}),
    "numba-tbb": ("numba", {"NUMBA_THREADING_LAYER": "tbb"}),
}


def child(path: str, backend: str, num_requests: int, threads: int) -> None:
    """One measurement: print the engine's tok/s on the first num_requests of workload (b)."""
    import torch
    from offline_throughput import run_engine, workload

    if os.environ.get("NUMBA_THREADING_LAYER") == "tbb":
        import ctypes

        ctypes.CDLL(os.path.join(sys.prefix, "lib", "libtbb.so.12"), mode=ctypes.RTLD_GLOBAL)

    torch.set_num_threads(threads)
    requests = workload("b")[:num_requests]
    result = run_engine(path, requests, attention_backend=backend, max_num_seqs=256)
    print(json.dumps(result))


def measure(path: str, variant: str, num_requests: int, threads: int, neighbours: int) -> float:
    """tok/s of one variant in a fresh process, beside `neighbours` busy processes (each
    spinning one core) that start before it and are killed after it."""
    backend, env = VARIANTS[variant]
    cmd = [sys.executable, __file__, "--child", path, "--backend", backend]
    cmd += ["--requests", str(num_requests), "--threads", str(threads)]
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(neighbours)]
    try:
        done = subprocess.run(
            cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return json.loads(done.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "numba-tbb"))
    parser.add_argument("--neighbours", type=int, default=0)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="torch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.backend, args.requests, args.threads)
        return
    from offline_throughput import SHAPE

    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    variants = args.variants.split(",")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(Path(tmp) / "bench", "LlamaForCausalLM", **SHAPE))
        for round_no in range(args.rounds):
            for variant in variants:
                rates[variant].append(
                    measure(path, variant, args.requests, args.threads, args.neighbours)
                )
                print(f"round {round_no + 1}: {variant} {rates[variant][-1]:.1f} tok/s", flush=True)
    base = rates.get("torch")
    for variant in variants:
        ratios = [r / b for r, b in zip(rates[variant], base, strict=True)] if base else []
        print(
            f"{variant}: median {statistics.median(rates[variant]):.1f} tok/s"
            + (f", per round vs torch {' '.join(f'{r:.2f}x' for r in ratios)}" if ratios else "")
        )


if __name__ == "__main__":
    main()
