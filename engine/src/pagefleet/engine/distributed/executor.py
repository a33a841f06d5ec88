"""Where an engine's tensor-parallel ranks run. Rank 0 is the engine process itself (it owns
the scheduler, the KV manager and sampling); ranks 1..N-1 run `RankSpec.entry` in worker
processes (`mp`) or Ray actors (`ray`). Every rank joins one torch.distributed group through
rank 0's TCP store. A rank that dies fails the engine: `failure()` says which and why.

How the engine drives an executor (the supervisor must watch before rank 0 joins the group, so
a rank that dies during the rendezvous fails the engine instead of hanging it):

    executor = make_executor(choose_backend(flag, tp, node_device_count(device)))
    addr = executor.master_addr()
    spec = RankSpec(tp, addr, free_master_port(), "gloo" or "nccl", "pkg.mod:worker_main", ...)
    executor.start(spec)
    on_failure = partial(fail_engine, mark_unhealthy=..., grace_s=..., cleanup=executor.shutdown)
    supervision = watch(executor, on_failure)          # supervisor.py
    torch.distributed.init_process_group(..., init_method=spec.init_method, rank=0, ...)
    ... serve ...
    supervision.stop(); <tell the workers to leave>; executor.shutdown()

Devices: a worker rank reads its torch device from `worker_device()` (the executor sets
`PAGEFLEET_DEVICE` per rank: `cuda:<rank>` under `mp`, where every rank sees the node's GPUs
and rank 0 uses `cuda:0`; `cuda:0` under Ray, which gives each actor its own GPU; `cpu` for
gloo). Rank 0 asks the executor: `executor.rank0_device()`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Protocol

EXECUTOR_BACKENDS = ("mp", "ray")

# The environment variable through which an executor tells a worker rank its torch device.
DEVICE_ENV = "PAGEFLEET_DEVICE"


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

    @property
    def init_method(self) -> str:
        """The `init_method` every rank passes to `torch.distributed.init_process_group`."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


class Executor(Protocol):
    """Starts and watches worker ranks 1..world_size-1."""

    def master_addr(self) -> str:
        """Rank 0's address as the worker ranks reach it (the value for `RankSpec.master_addr`)."""

    def rank0_device(self, backend: str) -> str:
        """The torch device rank 0 (the engine process) uses for the torch.distributed backend."""

    def start(self, spec: RankSpec) -> None:
        """Start every worker rank; returns once each has been launched (not joined)."""

    def failure(self) -> str | None:
        """Why a worker rank is gone (exit code, signal, actor death), or None while all run."""

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every worker rank (they are also stopped when the engine process exits)."""


def choose_backend(
    requested: str | None, tensor_parallel_size: int, node_devices: int | None
) -> str:
    """The executor backend: the one asked for, else `mp` while the ranks fit on this node's
    devices and `ray` when they do not. `node_devices` None means unlimited (CPU ranks)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tensor_parallel_size}")
    if requested is not None:
        if requested not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"unknown distributed executor backend {requested!r}; "
                f"expected one of {', '.join(EXECUTOR_BACKENDS)}"
            )
        return requested
    if node_devices is not None and tensor_parallel_size > node_devices:
        return "ray"
    return "mp"


def node_device_count(device: str) -> int | None:
    """How many ranks this node's devices hold: its CUDA devices, or None (unlimited) on CPU."""
    if not device.startswith("cuda"):
        return None
    import torch  # lazily: the choice rule above stays usable without the model stack

    return torch.cuda.device_count()


def make_executor(backend: str, **options: Any) -> Executor:
    """An executor of `backend` (one of EXECUTOR_BACKENDS), built with its own options
    (MpExecutor takes none; RayExecutor: address, placement_strategy, num_cpus, ...)."""
    if backend == "mp":
        from pagefleet.engine.distributed.mp_executor import MpExecutor

        return MpExecutor(**options)
    if backend == "ray":
        # Ray is the optional `ray` extra: imported only when asked for.
        from pagefleet.engine.distributed.ray_executor import RayExecutor

        return RayExecutor(**options)
    raise ValueError(
        f"unknown distributed executor backend {backend!r}; "
        f"expected one of {', '.join(EXECUTOR_BACKENDS)}"
    )


def free_master_port(host: str = "") -> int:
    """A TCP port free on this host for rank 0's store (all interfaces: other nodes connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def worker_device(default: str = "cpu") -> str:
    """The torch device this worker rank's executor gave it (see the module docstring)."""
    return os.environ.get(DEVICE_ENV, default)


def load_entry(entry: str) -> Any:
    """The function named by a RankSpec entry, "package.module:function"."""
    module_name, sep, func_name = entry.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"rank entry must be 'module:function', got {entry!r}")
    import importlib

    return getattr(importlib.import_module(module_name), func_name)
