"""The tensor-parallel rank group: joining it through rank 0's TCP store, and the collectives
the model and the step protocol use (all-reduce, gather to rank 0, broadcast from rank 0, and
for expert parallelism all-to-all and all-gather).

The group is a process-group object of its own (not torch.distributed's global default), so
an engine process can hold several engines, and closing one leaves nothing behind. Gloo on CPU,
NCCL on CUDA (one device per rank).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Joining waits this long for every rank; a collective this long for the slowest rank (a
# rank that died is caught sooner by the executor's supervision).
JOIN_TIMEOUT = timedelta(minutes=10)
OP_TIMEOUT = timedelta(minutes=30)
LENGTH_BYTES = 8  # gather_bytes: each rank's length, ahead of its padded bytes


# Ranks of one node meet through a store file (its path in this variable) instead of a TCP
# store: a TCPStore listens on every interface, whatever host it is given, and takes no
# credentials, so anyone who reaches the machine could join or stall the rendezvous.
STORE_FILE_ENV = "PAGEFLEET_TP_STORE_FILE"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass
class RankZeroStore:
    """Rank 0's store and how workers reach it: a TCP port (ranks on other nodes) or a file
    in a directory only this user reads (ranks of one node)."""

    store: dist.Store
    port: int = 0
    file: str | None = None

    def close(self) -> None:
        if self.file is not None:
            shutil.rmtree(os.path.dirname(self.file), ignore_errors=True)


def open_store(host: str, world_size: int) -> RankZeroStore:
    """Rank 0's store: a file for ranks of one node (`host` loopback), else a TCP store on a
    free port of `host` (reachable by the other nodes' ranks: keep it inside the group's
    network, as the operator's NetworkPolicies do)."""
    if is_loopback(host):
        path = os.path.join(tempfile.mkdtemp(prefix="pf-tp-"), "store")  # mode 0700
        return RankZeroStore(dist.FileStore(path, world_size), file=path)
    store = dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False
    )
    return RankZeroStore(store, port=store.port)


def _gloo(store: dist.Store, rank: int, size: int, host: str | None) -> dist.ProcessGroup:
    """Gloo, bound to loopback for ranks of one node (its pairs listen on no other address)."""
    if host is None or not is_loopback(host):
        return dist.ProcessGroupGloo(store, rank, size, OP_TIMEOUT)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = OP_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def local_device(rank: int, device_type: str) -> torch.device:
    """CUDA: one device per rank, counted within the node (an executor that sets
    CUDA_VISIBLE_DEVICES to one device per rank leaves each rank cuda:0); CPU: cpu."""
    if device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


@dataclass
class CollectiveTimer:
    """Seconds spent inside collectives, by kind (for benchmarks/tp_overhead.py)."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total(self) -> float:
        return sum(self.seconds.values())


class RankGroup:
    """One rank's membership of the tensor-parallel group."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        backend: str,
        device: torch.device,
        host: str | None = None,
    ) -> None:
        self.rank, self.size, self.backend, self.device = rank, size, backend, device
        self.store = store  # rank 0's store must outlive the group
        if backend == "gloo":
            self.pg = _gloo(store, rank, size, host)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = OP_TIMEOUT
            self.pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            raise ValueError(f"torch.distributed backend {backend!r}: gloo or nccl")
        self.timer: CollectiveTimer | None = None  # set to measure time in collectives
        self.on_close: Callable[[], None] | None = None  # rank 0: remove its store's file

    @classmethod
    def join(
        cls, host: str, port: int, rank: int, size: int, backend: str, device: torch.device
    ) -> RankGroup:
        """A worker rank joins rank 0's store (its file, when rank 0 named one) and the group."""
        path = os.environ.get(STORE_FILE_ENV)
        if path:
            store: dist.Store = dist.FileStore(path, size)
        else:
            store = dist.TCPStore(host, port, size, is_master=False, timeout=JOIN_TIMEOUT)
        return cls(store, rank, size, backend, device, host)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter() if self.timer else 0.0
        self.pg.allreduce([x]).wait()
        if self.timer:
            self._note("all_reduce", start, x)
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape everywhere) on rank 0, in rank order; None elsewhere."""
        start = time.perf_counter() if self.timer else 0.0
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.pg.gather([parts] if self.rank == 0 else [], [x], opts).wait()
        if self.timer:
            self._note("gather", start, x)
        return parts if self.rank == 0 else None

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Rows send_counts[r] of `x` (in rank order) go to rank r; returns the rows every
        rank sent here, in rank order (recv_counts[r] from rank r)."""
        start = time.perf_counter() if self.timer else 0.0
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        self.pg.alltoall_base(out, x.contiguous(), recv_counts, send_counts).wait()
        if self.timer:
            self._note("all_to_all", start, out)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape everywhere), concatenated along dim 0 in rank order."""
        start = time.perf_counter() if self.timer else 0.0
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        if self.timer:
            self._note("all_gather", start, x)
        return torch.cat(parts)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype on every rank)."""
        start = time.perf_counter() if self.timer else 0.0
        self.pg.broadcast(x, 0).wait()
        if self.timer:
            self._note("broadcast", start, x)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks each rank's memory allows)."""
        return self.min_each([value])[0]

    def min_each(self, values: list[int]) -> list[int]:
        """Position by position, the smallest of every rank's `values` (same length on all)."""
        if not values:
            return []
        x = torch.tensor(values, dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([x], opts).wait()
        return x.tolist()

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's `data` (any length) on rank 0, in rank order; None elsewhere."""
        longest = -self.min_over_ranks(-len(data))
        buf = torch.zeros(LENGTH_BYTES + longest, dtype=torch.uint8)
        buf[:LENGTH_BYTES] = torch.tensor(list(len(data).to_bytes(LENGTH_BYTES, "little")))
        if data:
            buf[LENGTH_BYTES : LENGTH_BYTES + len(data)] = torch.frombuffer(
                bytearray(data), dtype=torch.uint8
            )
        parts = self.gather_to_first(buf.to(self.device))
        if parts is None:
            return None
        out = []
        for part in parts:
            raw = part.cpu().numpy().tobytes()
            size = int.from_bytes(raw[:LENGTH_BYTES], "little")
            out.append(raw[LENGTH_BYTES : LENGTH_BYTES + size])
        return out

    def _note(self, kind: str, start: float, x: torch.Tensor) -> None:
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.timer.add(kind, time.perf_counter() - start)

    def close(self) -> None:
        """Leave the group (its communicators are freed; the store closes with rank 0)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self.on_close is not None:
            self.on_close()
