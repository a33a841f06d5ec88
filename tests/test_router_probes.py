"""The router's probes as Kubernetes reads them: liveness says only that the process serves;
readiness says whether an engine can take a request (with --queue-size 0; a router that
holds requests is ready at zero engines, see test_router_flow_control.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

import httpx

from server_utils import PAGEFLEET, free_port


def test_liveness_holds_while_no_engine_is_healthy():
    """Catches a liveness probe on /health, which answers 503 while engines load, during an
    outage and at zero replicas: the kubelet would restart a router that works."""
    port, dead_engine = free_port(), free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [
                PAGEFLEET,
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--endpoints",
                f"http://127.0.0.1:{dead_engine}",
                "--api-key",
                "secret",
                "--queue-size",
                "0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, "the router exited"
                try:
                    live = httpx.get(f"{base}/livez", timeout=2)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the router never listened"
                    time.sleep(0.1)
            # Probes carry no credentials: /livez needs none, and says the process serves.
            assert live.status_code == 200
            # Readiness stays meaningful: once its scrapes find no engine, it is not ready...
            while httpx.get(f"{base}/health", timeout=2).status_code != 503:
                assert time.monotonic() < deadline, "/health never reported the dead engine"
                time.sleep(0.1)
            # ...and it is still alive.
            assert httpx.get(f"{base}/livez", timeout=2).status_code == 200
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
