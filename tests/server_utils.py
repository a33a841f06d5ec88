"""Start `pagefleet serve` as a real subprocess on 127.0.0.1 and wait until it is healthy."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from pagefleet.fleet.up import free_port, free_port_pair  # noqa: F401 - shared with tests

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
# The secret a test fleet's router and engines share (passed as the environment variable).
FLEET_SECRET = "test-fleet-secret-not-for-production"
FLEET_ENV = {"PAGEFLEET_FLEET_SECRET": FLEET_SECRET}


def fleet_secret():
    from pagefleet.common.fleet_auth import FleetSecret

    return FleetSecret(FLEET_SECRET.encode())


def wait_until(predicate, timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll `predicate` until it holds; fail after `timeout` seconds (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[1]} exited {proc.returncode}: {_log_of(proc)}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.args[1]} did not become healthy")
        time.sleep(0.2)


def _log_of(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")[-4000:]


PORT_ATTEMPTS = 3  # a free port can be taken by another process before the server binds it


@contextmanager
def running(command: str, *flags: str, timeout: float = 60.0, env: dict | None = None):
    """`pagefleet COMMAND` on a free loopback port; yields (base URL, process) once healthy,
    and kills it afterwards. Its output goes to a file (`proc.log_path`): a pipe nobody reads
    would fill up and block the server on its next log line. A server that lost its port
    before binding it (Ray's processes take ephemeral ports while the model loads) is started
    again on another."""
    for attempt in range(PORT_ATTEMPTS):
        with _started(command, flags, env) as (base, proc):
            try:
                wait_healthy(proc, base, timeout)
            except RuntimeError:
                if "address already in use" in _log_of(proc) and attempt + 1 < PORT_ATTEMPTS:
                    continue
                raise
            yield base, proc
            return


@contextmanager
def _started(command: str, flags: tuple[str, ...], env: dict | None):
    port = free_port()
    with tempfile.NamedTemporaryFile("w", prefix=f"pagefleet-{command}-", suffix=".log") as log:
        proc = subprocess.Popen(
            [PAGEFLEET, command, "--host", "127.0.0.1", "--port", str(port), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )
        proc.log_path = log.name
        try:
            yield f"http://127.0.0.1:{port}", proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            output = Path(log.name).read_text(errors="replace")
            if "Traceback" in output:  # shown with the test's report if it fails
                print(f"--- {command} log with a traceback:\n{output[-6000:]}")


def running_server(model: str, *flags: str, timeout: float = 60.0, env: dict | None = None):
    defaults = (
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--num-gpu-blocks-override",
        "256",
    )
    return running("serve", model, *defaults, *flags, timeout=timeout, env=env)


def running_router(*flags: str, timeout: float = 60.0, env: dict | None = None):
    return running("router", *flags, timeout=timeout, env=env)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


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


def unread_stream(base: str) -> socket.socket:
    """The stall attack: a heavy streaming chat request (n=128, 20 top logprobs per token, 900
    tokens) sent over a raw socket with a 4 KiB receive buffer that is then never read. The
    caller closes the socket."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "n": 128,
        "logprobs": True,
        "top_logprobs": 20,
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    payload = json.dumps(body).encode()
    host, port = base.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return client
