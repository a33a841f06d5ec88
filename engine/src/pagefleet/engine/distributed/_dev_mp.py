"""TEMPORARY stand-in for the mp executor while it is built on another branch (issue 18): the
lead deletes this file on merge and `LLMEngine` calls `make_executor` instead. Starts ranks
1..N-1 as spawned local processes running `RankSpec.entry`; no supervision beyond `failure()`.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import time

from pagefleet.engine.distributed.executor import RankSpec


def run_rank(rank: int, spec: RankSpec) -> None:
    os.environ.update(spec.env)
    module, function = spec.entry.split(":")
    getattr(importlib.import_module(module), function)(rank, spec)


class DevMpExecutor:
    def __init__(self) -> None:
        self.processes: list[multiprocessing.Process] = []

    def start(self, spec: RankSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, spec.world_size):
            proc = ctx.Process(
                target=run_rank, args=(rank, spec), name=f"pagefleet-rank-{rank}", daemon=True
            )
            proc.start()
            self.processes.append(proc)

    def failure(self) -> str | None:
        for rank, proc in enumerate(self.processes, start=1):
            if proc.exitcode is not None:
                return f"tensor-parallel rank {rank} exited with code {proc.exitcode}"
        return None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()


def make_executor(backend: str) -> DevMpExecutor:
    if backend != "mp":
        raise ValueError(f"--distributed-executor-backend {backend}: only mp on this branch")
    return DevMpExecutor()
