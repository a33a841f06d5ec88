"""Bounded work on the router (issue 14, findings 5 and 10): 20 MB and 100 MB bodies, declared
or chunked, are refused with 413 before they are read, and neither stall /health nor grow the
router's memory; a lone surrogate is a 400 JSON error; routing keeps working."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from server_utils import rss_bytes, running_router, running_server

MiB = 1 << 20


@pytest.fixture(scope="module")
def routed(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with (
        running_server(path) as (engine, _),
        running_router("--endpoints", engine, "--tokenizer", path) as (router, proc),
    ):
        yield router, proc


def chat_body(size: int) -> bytes:
    head = b'{"model": "tiny", "messages": [{"role": "user", "content": "'
    return head + b"block " * (size // 6) + b'"}]}'


def raw_request(base: str, head: bytes, body: bytes) -> bytes:
    """Send a request's head and the first part of its body, then read what comes back until
    the server closes (without ever sending the rest)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(head + body)
        answer = b""
        with contextlib.suppress(ConnectionResetError):  # the answer came before the reset
            while chunk := conn.recv(65536):
                answer += chunk
    return answer


def test_oversized_bodies_get_413_before_they_are_read(routed):
    """Before: the router read any body whole (no limit) before even looking at it."""
    router, _ = routed
    declared = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 20971520\r\n\r\n"
    )
    answer = raw_request(router, declared, b'{"model": "tiny", "messages": [')
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    parts = [b"x" * MiB] * 4 + [b"x" * 1024]  # just over 4 MiB: all read, none left over
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts)
    answer = raw_request(router, chunked, chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 413


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
@pytest.mark.parametrize("size_mb", [20, 100])
def test_huge_bodies_neither_stall_nor_bloat_the_router(routed, size_mb, chunked):
    """Before: a 20 MB body stalled /health for 46 s; a 100 MB one grew the router to 13 GB
    until the kernel killed it."""
    router, proc = routed
    body = chat_body(size_mb * MiB)
    content = (body[i : i + MiB] for i in range(0, len(body), MiB)) if chunked else body
    baseline, outcome = rss_bytes(proc.pid), {}

    def attack() -> None:
        try:
            r = httpx.post(
                f"{router}/v1/chat/completions",
                content=content,
                headers={"content-type": "application/json"},
                timeout=300,
            )
            outcome["status"] = r.status_code
        except httpx.HTTPError as e:  # the router stopped reading and closed: refused too
            outcome["error"] = repr(e)

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    grown = 0
    while thread.is_alive():
        grown = max(grown, rss_bytes(proc.pid) - baseline)
        assert grown < 150 * MiB, f"the router grew by {grown / MiB:.0f} MiB"
        try:
            health = httpx.get(f"{router}/health", timeout=10)
        except httpx.TimeoutException:
            pytest.fail("/health stalled for 10 s during the attack")
        assert health.status_code == 200
        time.sleep(0.1)
    thread.join()
    assert outcome.get("status", 413) == 413, outcome
    r = httpx.post(
        f"{router}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_is_a_400_json_error(routed):
    """Before: the router's tokenizer raised on it and the client got a plain-text 500."""
    router, _ = routed
    for body in (
        {"model": "tiny", "messages": [{"role": "user", "content": "a\ud800"}]},
        {"model": "tiny", "prompt": "\udfffb"},
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(
            f"{router}{path}",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == 400
