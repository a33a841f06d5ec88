"""Processes the benchmarks start (engines, routers) and waiting for them to answer."""

from __future__ import annotations

import contextlib
import subprocess
import time

import httpx


@contextlib.contextmanager
def process(argv: list[str], stop_timeout: float = 120.0, env: dict[str, str] | None = None):
    """A quiet child process, terminated (and waited for) when the block ends."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=stop_timeout)


def wait_healthy(url: str, timeout: float = 300.0, interval: float = 0.2) -> None:
    """Until `url`/health answers 200, asked every `interval` seconds; TimeoutError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(interval)
    raise TimeoutError(url)
