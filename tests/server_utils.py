"""Start `pagefleet serve` as a real subprocess on 127.0.0.1 and wait until it is healthy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[1]} exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.args[1]} did not become healthy")
        time.sleep(0.2)


@contextmanager
def running(command: str, *flags: str, timeout: float = 60.0):
    """`pagefleet COMMAND` on a free loopback port; yields (base URL, process) once healthy,
    and kills it afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [PAGEFLEET, command, "--host", "127.0.0.1", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, timeout)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


def running_server(model: str, *flags: str, timeout: float = 60.0):
    defaults = (
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--num-gpu-blocks-override",
        "256",
    )
    return running("serve", model, *defaults, *flags, timeout=timeout)


def running_router(*flags: str, timeout: float = 60.0):
    return running("router", *flags, timeout=timeout)


def metric_value(base: str, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in (labels or {}).items()
            ):
                return sample.value
    raise KeyError(name)
