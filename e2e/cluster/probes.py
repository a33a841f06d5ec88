"""Probes as the kubelet runs them: one check (httpGet: a 2xx/3xx answer within timeoutSeconds;
tcpSocket: a connection within timeoutSeconds), and the thresholds that turn a series of
checks into a verdict (successThreshold / failureThreshold consecutive results)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .podspec import resolve_port


@dataclass(frozen=True)
class TimeScale:
    """One factor for every duration in a pod spec (periods, delays, timeouts, grace periods,
    back-off), so tests run the spec's logic faster without changing its shape."""

    factor: float = 1.0

    def s(self, seconds: float) -> float:
        return seconds * self.factor


async def within(awaitable, seconds: float | None):
    """Await with a deadline (TimeoutError after it; None waits forever). asyncio.timeout, not
    wait_for: in Python 3.11 wait_for can swallow the caller's cancellation."""
    async with asyncio.timeout(seconds):
        return await awaitable


async def check(probe: dict, container: dict, pod_ip: str, timeout: float) -> bool:
    """One probe check from the node, as the kubelet does it."""
    # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow the caller's cancellation.
    try:
        async with asyncio.timeout(timeout):
            if "httpGet" in probe:
                return await _http_get(probe["httpGet"], container, pod_ip)
            if "tcpSocket" in probe:
                sock = probe["tcpSocket"]
                port = resolve_port(sock["port"], container)
                _, writer = await asyncio.open_connection(sock.get("host") or pod_ip, port)
                writer.close()
                return True
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        return False
    raise NotImplementedError(f"the lab runs httpGet and tcpSocket probes, not {sorted(probe)}")


async def _http_get(get: dict, container: dict, pod_ip: str) -> bool:
    host = get.get("host") or pod_ip
    port = resolve_port(get["port"], container)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        headers = {"Host": f"{host}:{port}", "User-Agent": "kube-probe/1.30", "Accept": "*/*"}
        headers.update({h["name"]: h["value"] for h in get.get("httpHeaders", [])})
        lines = [f"GET {get.get('path', '/')} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join([*lines, "Connection: close", "", ""])).encode())
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.decode("latin-1").split()
        return len(parts) >= 2 and parts[1].isdigit() and 200 <= int(parts[1]) < 400
    finally:
        writer.close()


@dataclass
class Thresholds:
    """Consecutive results -> the probe's verdict: True (passing), False (failed), or the
    previous verdict while neither threshold is reached."""

    success_threshold: int
    failure_threshold: int
    verdict: bool | None = None
    successes: int = 0
    failures: int = 0

    @classmethod
    def of(cls, probe: dict) -> Thresholds:
        return cls(probe.get("successThreshold", 1), probe.get("failureThreshold", 3))

    def record(self, ok: bool) -> bool | None:
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.success_threshold:
                self.verdict = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.failure_threshold:
                self.verdict = False
        return self.verdict
