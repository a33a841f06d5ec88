"""A few worker threads that take queued jobs in turn across tenants: round robin over the
tenants with work queued, in the order they started waiting, FIFO within a tenant (the same
order as the router's flow control). Jobs complete plain `concurrent.futures.Future`s.

One future may be queued by several tenants (a grammar two clients asked for): whichever
turn comes first runs it, the later ones find it begun and skip it. Tenants beyond
`max_tenants` share one line, so a client inventing tenant names gets no more than one share.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

OVERFLOW_TENANT = "~overflow"


class FairPool:
    def __init__(self, workers: int, name: str, max_tenants: int = 64) -> None:
        self.max_tenants = max_tenants
        # tenant -> its jobs, oldest first; the dict's order is the round-robin turn
        self._lines: OrderedDict[str, deque[tuple[Future, Callable, tuple]]] = OrderedDict()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, tenant: str, future: Future, fn: Callable, *args: Any) -> None:
        """Queue `fn(*args)` to complete `future` in `tenant`'s turn (nothing if it has begun)."""
        with self._ready:
            if self._closed or future.running() or future.done():
                return
            if tenant not in self._lines and len(self._lines) >= self.max_tenants:
                tenant = OVERFLOW_TENANT
            self._lines.setdefault(tenant, deque()).append((future, fn, args))
            self._ready.notify()

    def _next(self) -> tuple[Future, Callable, tuple] | None:
        """The next job not yet begun, in turn; marked running (under the lock)."""
        while self._lines:
            tenant, line = next(iter(self._lines.items()))
            job = line.popleft()
            if line:
                self._lines.move_to_end(tenant)
            else:
                del self._lines[tenant]
            if not (job[0].running() or job[0].done()) and job[0].set_running_or_notify_cancel():
                return job
        return None

    def _work(self) -> None:
        while True:
            with self._ready:
                job = self._next()
                while job is None and not self._closed:
                    self._ready.wait()
                    job = self._next()
                if job is None:
                    return
            future, fn, args = job
            try:
                result = fn(*args)
            except BaseException as e:  # the waiter sees it, as with an executor
                future.set_exception(e)
            else:
                future.set_result(result)

    def close(self) -> None:
        """Stop taking jobs; queued ones are cancelled (running ones finish on their own)."""
        with self._ready:
            self._closed = True
            for line in self._lines.values():
                for future, _, _ in line:
                    future.cancel()
            self._lines.clear()
            self._ready.notify_all()
