"""The `mp` executor: worker ranks 1..N-1 as spawned processes on the engine's node.

Devices: every rank sees the node's GPUs (NCCL finds peer-to-peer paths that way) and rank r
uses `cuda:r`, so rank 0 (the engine process) uses `cuda:0`; CPU ranks (gloo) use `cpu`.
A worker dies with the engine, even when the engine is SIGKILLed: a thread in the worker waits
on multiprocessing's parent sentinel (a pipe the parent holds open until it exits) and ends
the worker when it fires. PR_SET_PDEATHSIG is not used: it fires when the *thread* that
spawned the worker exits, which kills workers started from a short-lived thread.

Workers never run the user's script: multiprocessing's spawn would import the parent's
`__main__` again in each child (to unpickle what it defines), so a script that builds
`LLM(tensor_parallel_size=2)` without an `if __name__ == "__main__":` guard would build it again
in rank 1 and die in multiprocessing's bootstrap check. A worker needs nothing from it (its
entry and arguments are pagefleet's own), so the children are started with `__main__` hidden.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import traceback
import types
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from pagefleet.engine.distributed.executor import DEVICE_ENV, RankSpec, load_entry

log = logging.getLogger(__name__)

# Exit code of a worker whose engine went away (it did not fail on its own).
ORPHANED_EXIT_CODE = 70


def rank_device(rank: int, backend: str) -> str:
    """The torch device of `rank` under this executor."""
    return f"cuda:{rank}" if backend == "nccl" else "cpu"


def describe_exit(rank: int, pid: int | None, exitcode: int | None) -> str:
    """A worker's end in words: its exit code, or the signal that killed it."""
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    return f"tensor-parallel rank {rank} (pid {pid}) {how}"


def run_worker_rank(rank: int, spec: RankSpec, env: dict[str, str]) -> None:
    """A worker process's main: follow the engine's death, then run the rank's entry."""
    os.environ.update(env)
    _exit_with_parent()
    try:
        load_entry(spec.entry)(rank, spec)
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing: nothing to follow
        return
    threading.Thread(
        target=_exit_when_ready, args=(parent.sentinel,), name="engine-watch", daemon=True
    ).start()


def _exit_when_ready(sentinel: int) -> None:
    wait([sentinel])
    # os._exit: the rank may sit in a collective that no Python-level exit could interrupt.
    os._exit(ORPHANED_EXIT_CODE)


@contextlib.contextmanager
def _main_module_hidden():
    """While a worker is spawned: a `__main__` with no file or spec, so the child does not
    import the user's script (see the module docstring)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class MpExecutor:
    """Worker ranks as daemon processes of the spawn context (no forked CUDA state)."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._processes: list[BaseProcess] = []
        self._stopping = False

    def master_addr(self) -> str:
        return "127.0.0.1"

    def rank0_device(self, backend: str) -> str:
        return rank_device(0, backend)

    def start(self, spec: RankSpec) -> None:
        if self._processes:
            raise RuntimeError("executor already started")
        for rank in range(1, spec.world_size):
            env = {**spec.env, DEVICE_ENV: rank_device(rank, spec.backend)}
            process = self._context.Process(
                target=run_worker_rank,
                args=(rank, spec, env),
                name=f"pagefleet-tp-rank-{rank}",
                daemon=True,
            )
            with _main_module_hidden():
                process.start()
            self._processes.append(process)
        log.info(
            "started %d tensor-parallel worker ranks (pids %s)",
            len(self._processes),
            ", ".join(str(p.pid) for p in self._processes),
        )

    def pids(self) -> list[int]:
        """The worker ranks' process ids, rank 1 first."""
        return [p.pid for p in self._processes if p.pid is not None]

    def failure(self) -> str | None:
        if self._stopping:
            return None
        for rank, process in enumerate(self._processes, start=1):
            if process.exitcode is not None:
                return describe_exit(rank, process.pid, process.exitcode)
        return None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        for process in self._processes:
            if process.exitcode is None:
                process.terminate()
        for process in self._processes:
            process.join(timeout_s / 2)
            if process.exitcode is None:
                process.kill()
                process.join(timeout_s / 2)
        self._processes = []
