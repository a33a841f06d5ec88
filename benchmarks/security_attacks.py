"""What issue 14's resource attacks cost a server (the figures behind docs/security.md).

Part `router`: 20 MB and 100 MB chat bodies, declared (Content-Length) or chunked, against a
router with the model's tokenizer in front of one engine: the answer, the router's peak RSS
growth and the worst /health latency while the attack runs (the attacker is killed at +2 GiB).
Part `stall`: a streaming client that never reads (n=128, top_logprobs=20, 900 tokens) against
one engine: the engine's peak RSS growth in 30 s, and whether the request still runs after.

    .venv/bin/python benchmarks/security_attacks.py [--part router|stall] [--stall-timeout S]

The tests (tests/test_security_*.py) assert bounds; this prints the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from pagefleet.engine.model.tiny import write_tiny_checkpoint
from server_utils import metric_value, rss_bytes, running_router, running_server, unread_stream

MiB = 1 << 20
RSS_CAP = 2048 * MiB  # the attack is stopped here: the machine is shared


def chat_body(size: int) -> bytes:
    head = b'{"model": "tiny", "messages": [{"role": "user", "content": "'
    return head + b"block " * (size // 6) + b'"}]}'


def post_in_thread(url: str, content, outcome: dict) -> threading.Thread:
    def attack() -> None:
        try:
            r = httpx.post(
                url, content=content, headers={"content-type": "application/json"}, timeout=600
            )
            outcome["answer"] = r.status_code
        except httpx.HTTPError as e:
            outcome["answer"] = type(e).__name__

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    return thread


def router_attack(model: str, size_mb: int, chunked: bool) -> str:
    with (
        running_server(model) as (engine, _),
        running_router("--endpoints", engine, "--tokenizer", model) as (router, proc),
    ):
        body = chat_body(size_mb * MiB)
        content = (body[i : i + MiB] for i in range(0, len(body), MiB)) if chunked else body
        baseline, peak, worst, outcome = rss_bytes(proc.pid), 0, 0.0, {}
        started = time.monotonic()
        thread = post_in_thread(f"{router}/v1/chat/completions", content, outcome)
        while thread.is_alive() and time.monotonic() - started < 300:
            peak = max(peak, rss_bytes(proc.pid) - baseline)
            if peak > RSS_CAP:
                proc.kill()
                outcome["answer"] = f"stopped at +{RSS_CAP // MiB} MiB"
                break
            asked = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{router}/health", timeout=120)
            worst = max(worst, time.monotonic() - asked)
            time.sleep(0.1)
        thread.join(5)
        return (
            f"| {size_mb} MB | {'chunked' if chunked else 'declared'} | {outcome.get('answer')} "
            f"| +{peak / MiB:,.0f} MiB | {worst:.2f} s | {time.monotonic() - started:.1f} s |"
        )


def never_reading_client(model: str, stall_timeout: float | None) -> str:
    flags = ["--max-model-len", "1024", "--num-gpu-blocks-override", "9000"]
    if stall_timeout is not None:
        flags += ["--client-stall-timeout", str(stall_timeout)]
    with running_server(model, *flags) as (base, proc):
        httpx.post(
            f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
        )
        baseline = rss_bytes(proc.pid)
        with contextlib.closing(unread_stream(base)):
            peak, started = 0, time.monotonic()
            while time.monotonic() - started < 30 and peak < RSS_CAP:
                peak = max(peak, rss_bytes(proc.pid) - baseline)
                time.sleep(0.2)
            running = metric_value(base, "vllm:num_requests_running")
            usage = metric_value(base, "vllm:kv_cache_usage_perc")
        return (
            f"| {stall_timeout if stall_timeout is not None else 'default'} "
            f"| +{peak / MiB:,.0f} MiB in {time.monotonic() - started:.0f} s "
            f"| {running:.0f} | {usage:.1%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["router", "stall", "all"], default="all")
    parser.add_argument("--stall-timeout", type=float, default=None)
    args = parser.parse_args()
    model = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "llama", "LlamaForCausalLM"))
    if args.part in ("router", "all"):
        print("| body | length | answer | router RSS | worst /health | attack lasted |")
        print("|---|---|---|---:|---:|---:|")
        for size_mb in (20, 100):
            for chunked in (False, True):
                print(router_attack(model, size_mb, chunked), flush=True)
    if args.part in ("stall", "all"):
        print("| --client-stall-timeout | engine RSS | running after | KV usage after |")
        print("|---|---:|---:|---:|")
        print(never_reading_client(model, args.stall_timeout), flush=True)


if __name__ == "__main__":
    main()
