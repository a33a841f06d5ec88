"""Supervision of the worker ranks: a dead rank fails the engine loudly instead of leaving rank 0
hung in a collective that will never complete. `watch` polls the executor in a daemon thread;
`fail_engine` is the engine's verdict (health 503 for a moment, then exit non-zero)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagefleet.engine.distributed.executor import Executor

log = logging.getLogger(__name__)

# How long a failing engine keeps answering /health with 503 before it exits: long enough for
# a probe or a router to see why, short enough that Kubernetes restarts it promptly.
DEFAULT_FAIL_GRACE_S = 2.0
FAILED_EXIT_CODE = 1
DEFAULT_CLEANUP_TIMEOUT_S = 5.0


@dataclass
class Supervision:
    """A running watch; `stop()` before a planned shutdown, so leaving workers are no failure."""

    thread: threading.Thread
    stopped: threading.Event

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout_s)


def watch(
    executor: Executor, on_failure: Callable[[str], None], interval_s: float = 0.2
) -> Supervision:
    """Poll `executor.failure()` every `interval_s` in a daemon thread; call `on_failure(reason)`
    once, on the first failure, then stop watching."""
    stopped = threading.Event()
    thread = threading.Thread(
        target=_watch_loop,
        args=(executor, on_failure, interval_s, stopped),
        name="tp-supervisor",
        daemon=True,
    )
    thread.start()
    return Supervision(thread, stopped)


def _watch_loop(
    executor: Executor,
    on_failure: Callable[[str], None],
    interval_s: float,
    stopped: threading.Event,
) -> None:
    while not stopped.wait(interval_s):
        try:
            reason = executor.failure()
        except Exception as exc:  # a broken executor is as fatal as a dead rank
            reason = f"supervising the worker ranks failed: {exc!r}"
        if reason is not None and not stopped.is_set():
            stopped.set()
            on_failure(reason)
            return


def fail_engine(
    reason: str,
    mark_unhealthy: Callable[[str], None] | None = None,
    grace_s: float = DEFAULT_FAIL_GRACE_S,
    cleanup: Callable[[], None] | None = None,
    cleanup_timeout_s: float = DEFAULT_CLEANUP_TIMEOUT_S,
) -> None:
    """Fail the engine process: log `reason` loudly, mark health unhealthy (so /health answers
    503 during `grace_s`), run `cleanup` (the executor's shutdown: a private Ray cluster leaves
    processes behind otherwise) for at most `cleanup_timeout_s`, then exit non-zero with
    os._exit. os._exit, not sys.exit: rank 0's main thread may be blocked in a collective
    waiting for the dead rank, and no Python-level exit (atexit, joining threads) may wait on
    it."""
    log.critical("engine failed: %s; exiting in %.1fs", reason, grace_s)
    if mark_unhealthy is not None:
        try:
            mark_unhealthy(reason)
        except Exception:
            log.exception("could not mark the engine unhealthy")
    time.sleep(max(grace_s, 0.0))
    if cleanup is not None:
        # In a thread of its own: a cleanup stuck on the dead rank must not keep the engine up.
        worker = threading.Thread(target=_run_cleanup, args=(cleanup,), daemon=True)
        worker.start()
        worker.join(cleanup_timeout_s)
    # No logging.shutdown(): a handler lock held by a stuck thread would hang the exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FAILED_EXIT_CODE)


def _run_cleanup(cleanup: Callable[[], None]) -> None:
    try:
        cleanup()
    except Exception:
        log.exception("cleanup of a failed engine failed")
