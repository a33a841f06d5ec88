"""A two-node Ray cluster on this machine for tests: `ray start --head` and `ray start
--address` as two separate process trees (one CPU each), stopped by killing their sessions."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pagefleet.fleet.up import free_port

RAY_BIN = Path(sys.executable).parent / "ray"
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
DEADLINE_S = 60.0


def wait_until(condition, what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def session_pids(session_id: int) -> list[int]:
    """Live processes of a session (`ray start` runs in its own; Ray's workers keep it)."""
    pids = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # After the command name: state, ppid, pgrp, session.
        if int(fields[3]) == session_id and fields[0] != "Z":
            pids.append(int(stat_path.parent.name))
    return pids


def start_ray_node(args: list[str], temp_dir: str, sessions: list[int]) -> None:
    command = [
        str(RAY_BIN),
        "start",
        "--num-cpus=1",
        f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={free_port('')}",
        "--disable-usage-stats",
        *args,
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **RAY_ENV},
    )
    sessions.append(proc.pid)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out


@contextmanager
def ray_cluster_of_two_nodes() -> Iterator[str]:
    """A Ray head and a Ray worker node (1 CPU each), started by `ray start` as two separate
    process trees on this machine; yields the head's address. Stopped by killing their sessions
    (`ray stop` would stop every Ray process on the machine, not only these)."""
    import ray

    sessions: list[int] = []
    temp_dirs = [tempfile.mkdtemp(prefix=f"pf-ray-{n}-", dir="/tmp") for n in "hw"]
    address = f"{ray.util.get_node_ip_address()}:{free_port('')}"
    try:
        start_ray_node(
            [
                "--head",
                f"--port={address.rsplit(':', 1)[1]}",
                f"--ray-client-server-port={free_port('')}",
                f"--dashboard-port={free_port('')}",
                "--include-dashboard=false",
            ],
            temp_dirs[0],
            sessions,
        )
        start_ray_node([f"--address={address}"], temp_dirs[1], sessions)
        yield address
    finally:
        for session in sessions:
            for pid in session_pids(session):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for temp_dir in temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)
        wait_until(
            lambda: not any(session_pids(session) for session in sessions),
            "the Ray nodes to stop",
        )
