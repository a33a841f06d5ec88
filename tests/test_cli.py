"""The `pagefleet` command: version, help, the demo main job, and errors for bad flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagefleet.common import __version__

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PAGEFLEET, *args], capture_output=True, text=True, timeout=300, env=env)


def test_version_and_help():
    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"pagefleet {__version__}"
    out = _run("--help")
    assert out.returncode == 0 and "demo" in out.stdout


def test_demo_serves_the_demo_model_and_the_printed_curl_streams(tmp_path):
    import json
    import shlex
    import signal

    import httpx

    from server_utils import free_port

    port = free_port()
    env = {**os.environ, "PAGEFLEET_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [PAGEFLEET, "demo", "--tiny", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        banner = ""
        while "Stop: Ctrl-C" not in banner:
            line = proc.stdout.readline()
            assert line, f"demo exited early: {proc.poll()}"
            banner += line
        # Run the printed curl's request (its URL and JSON body) with httpx.
        command = banner[banner.index("curl") : banner.index("Metrics")].replace("\\\n", " ")
        words = shlex.split(command)
        url, body = words[2], json.loads(words[words.index("-d") + 1])
        assert url == f"http://127.0.0.1:{port}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) > 3
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_offline_demo_generates_with_a_fresh_demo_checkpoint(tmp_path):
    env = {**os.environ, "PAGEFLEET_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = _run("demo", "--offline", "--tiny", env=env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "demo-llama" / "config.json").is_file()
    assert out.stdout.count("model (24 tokens, length)") == 4
    hits = out.stdout.split("prefix-cache hits ")[1].split()[0]
    assert int(hits.split("/")[0]) > 0, "the shared system prompt was not reused"


def test_stand_in_demo_runs_every_request_to_completion_with_prefix_hits():
    out = _run("demo", "--stand-in", "--num-requests", "24")
    assert out.returncode == 0, out.stderr
    assert "requests finished      24 " in out.stdout
    rate = next(line for line in out.stdout.splitlines() if "hit rate" in line)
    assert float(rate.split()[3].rstrip("%")) > 30.0


def test_bad_flag_and_bad_value_exit_non_zero_with_a_message():
    out = _run("demo", "--no-such-flag")
    assert out.returncode != 0 and "unrecognized arguments" in out.stderr
    out = _run("demo", "--stand-in", "--num-gpu-blocks", "2")
    assert out.returncode == 2 and "--num-gpu-blocks-override" in out.stderr
