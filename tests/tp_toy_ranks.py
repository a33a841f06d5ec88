"""A toy tensor-parallel rank for the executor tests: join the group through rank 0's store,
all-reduce the rank number once, then idle like a worker waiting for the engine's next step."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from pagefleet.engine.distributed.executor import RankSpec

# Bounds every rendezvous and collective, so a test that goes wrong fails instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def join_group(rank: int, spec: RankSpec) -> None:
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def all_reduce_rank(rank: int) -> float:
    """The sum over the group of every rank's number (0 + 1 + ... + N-1 when all take part)."""
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return float(value.item())


def worker_main(rank: int, spec: RankSpec) -> None:
    """The toy worker rank: one all-reduce, then wait forever (the executor stops it)."""
    join_group(rank, spec)
    all_reduce_rank(rank)
    threading.Event().wait()


def idle_main(rank: int, spec: RankSpec) -> None:
    """A worker rank that never joins the group: what the supervision tests kill."""
    threading.Event().wait()
