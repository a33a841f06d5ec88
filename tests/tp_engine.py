"""A toy engine process for the executor tests: rank 0 of a tensor-parallel group started by an
executor, supervised as the real engine is. Prints one JSON line per event on stdout,
after EVENT_PREFIX.

    python tests/tp_engine.py --backend mp|ray --world-size N [--hang] [--grace-s S]

Without --hang: one all-reduce, then a clean shutdown (exit 0). With --hang (world size >= 3):
after the all-reduce rank 0 waits to receive from the last rank, which idles and never sends.
When a test then kills rank 1, rank 0 keeps waiting: gloo only fails an operation whose own
sockets close, so this is the CPU picture of an NCCL collective stuck on a dead peer, and only
the supervisor (fail_engine) can end it."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

from pagefleet.engine.distributed.executor import RankSpec, free_master_port, make_executor
from pagefleet.engine.distributed.supervisor import fail_engine, watch
from tp_toy_ranks import all_reduce_rank, join_group

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


EVENT_PREFIX = "tp-engine-event "  # Ray's drivers also print worker output to stdout


def emit(event: str, **fields) -> None:
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


def mark_unhealthy(reason: str) -> None:
    emit("unhealthy", reason=reason)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["mp", "ray"], required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--grace-s", type=float, default=0.2)
    args = parser.parse_args()

    executor = make_executor(args.backend)
    spec = RankSpec(
        world_size=args.world_size,
        master_addr=executor.master_addr(),
        master_port=free_master_port(),
        backend="gloo",
        entry="tp_toy_ranks:worker_main",
        env={"PYTHONPATH": TESTS_DIR},
    )
    executor.start(spec)
    on_failure = functools.partial(
        fail_engine,
        mark_unhealthy=mark_unhealthy,
        grace_s=args.grace_s,
        cleanup=executor.shutdown,
    )
    supervision = watch(executor, on_failure, interval_s=0.1)
    join_group(0, spec)
    emit("ranks", master_addr=spec.master_addr, **ranks_info(executor))
    emit("sum", value=all_reduce_rank(0))
    if args.hang:
        emit("waiting")
        try:
            dist.recv(torch.zeros(1), src=args.world_size - 1)  # never completes: workers idle
        except RuntimeError:
            # The executor's cleanup stopped the rank it waited on: like the engine's step loop,
            # leave the verdict (and the exit) to the supervisor.
            emit("collective_failed")
            threading.Event().wait()
        emit("returned")  # a hang that ends without the supervisor is a failure too
        sys.exit(3)
    supervision.stop()
    dist.destroy_process_group()
    executor.shutdown()
    emit("stopped")


def ranks_info(executor) -> dict:
    if hasattr(executor, "pids"):
        return {"pids": executor.pids()}
    import ray

    placements = executor.placements()
    return {
        "local_cluster_dir": executor.local_cluster_dir,
        "pids": [p.pid for p in placements],
        "nodes": [ray.get_runtime_context().get_node_id()] + [p.node_id for p in placements],
    }


if __name__ == "__main__":
    main()
