"""Run `pagefleet up` as a user would, read its state file, and check nothing outlives it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.up import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random checkpoint (made on the spot, never downloaded)."""
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("e2e") / "llama", "LlamaForCausalLM"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError, ValueError):  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return True


@contextlib.contextmanager
def fleet_up(tmp_path: Path, *flags: str, timeout: float = 240.0):
    """Yields {name: child} from the state file once every process is healthy; afterwards
    sends SIGTERM and checks that every child is gone."""
    state_file = tmp_path / f"fleet-{time.monotonic_ns()}.json"
    port = free_port()
    proc = subprocess.Popen(
        [PAGEFLEET, "up", "--port", str(port), "--state-file", str(state_file), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    children: dict = {}
    try:
        deadline = time.monotonic() + timeout
        while not state_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"pagefleet up exited {proc.returncode}: {proc.stdout.read()}")
            assert time.monotonic() < deadline, "pagefleet up did not come up"
            time.sleep(0.2)
        children = {c["name"]: c for c in json.loads(state_file.read_text())}
        yield children
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()
    pids = [c["pid"] for c in children.values()]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "children outlived pagefleet up"
    assert proc.returncode == 0


def pids_of(children: dict) -> dict[str, int]:
    """Current pids (children restarted by the supervisor get new ones): from /proc."""
    out = {}
    for name, child in children.items():
        port = child["url"].rsplit(":", 1)[1]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
                if b"--port" in cmd and cmd[cmd.index(b"--port") + 1] == port.encode():
                    out[name] = int(entry.name)
    return out


def events_endpoints(children: dict) -> dict[str, str]:
    """Each engine's KV-event endpoint, from its command line."""
    out = {}
    for name, child in children.items():
        argv = child["argv"]
        if "--kv-events-config" in argv:
            config = json.loads(argv[argv.index("--kv-events-config") + 1])
            out[name] = config["endpoint"]
    return out


def fleet_curve(children: dict):
    """The CurveZMQ keys of the fleet's KV-event channel, from the secret `pagefleet up` gave
    its children (engines publish only to holders of the secret, as the router is)."""
    from pagefleet.fleet_auth import curve_keys, load_fleet_secret

    argv = children["router"]["argv"]
    secret = load_fleet_secret(argv[argv.index("--fleet-secret-file") + 1])
    return curve_keys(secret)


def metrics(base: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(base: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
    return sum(
        v
        for (n, ls), v in metrics(base).items()
        if n == name and all(dict(ls).get(k) == val for k, val in labels.items())
    )


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def idle(base: str) -> bool:
    m = lambda n: metric(base, n)  # noqa: E731
    return (
        m("vllm:num_requests_running") == 0
        and m("vllm:num_requests_waiting") == 0
        and m("vllm:kv_cache_usage_perc") == 0
        and m("pagefleet:kv_transfer_held_blocks") == 0
    )
