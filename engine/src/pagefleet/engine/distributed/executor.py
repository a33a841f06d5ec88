"""Where an engine's tensor-parallel ranks run. Rank 0 is the engine process itself (it owns
the scheduler, the KV manager and sampling); ranks 1..N-1 run `RankSpec.entry` in worker
processes (`mp`) or Ray actors (`ray`). Every rank joins one torch.distributed group through
rank 0's TCP store. A rank that dies fails the engine: `failure()` says which and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class RankSpec:
    """What every worker rank is started with."""

    world_size: int
    master_addr: str  # rank 0's address, reachable from every rank (its node's IP for Ray)
    master_port: int  # rank 0's torch.distributed TCP store
    backend: str  # torch.distributed backend: gloo (CPU) or nccl (CUDA)
    entry: str  # "module:function", called in each worker rank as function(rank, spec)
    payload: bytes = b""  # pickled arguments for the entry (model path, dtype, block size...)
    # Environment each worker rank starts with (e.g. CUDA_VISIBLE_DEVICES is set per rank by
    # the executor, not here).
    env: dict[str, str] = field(default_factory=dict)


class Executor(Protocol):
    """Starts and watches worker ranks 1..world_size-1."""

    def start(self, spec: RankSpec) -> None:
        """Start every worker rank; returns once each has been launched (not joined)."""

    def failure(self) -> str | None:
        """Why a worker rank is gone (exit code, signal, actor death), or None while all run."""

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every worker rank (they are also stopped when the engine process exits)."""
