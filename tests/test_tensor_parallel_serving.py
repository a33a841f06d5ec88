"""`pagefleet serve --tensor-parallel-size 2` as users run it: ranks as Ray actors (a private
local cluster, and a cluster of two Ray nodes where rank 1 runs on the other node), and a rank
that dies fails the server loudly instead of hanging it."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pagefleet.engine import LLM, SamplingParams
from ray_nodes import RAY_ENV, ray_cluster_of_two_nodes
from server_utils import running_server, wait_until

# Ray joins any Ray cluster it finds on the machine: these run beside no other Ray test.
pytestmark = pytest.mark.machine_wide

PROMPT = "Tell me about the river and the mountain."


def tp1_text(path: str) -> str:
    llm = LLM(path, num_gpu_blocks_override=256, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=16)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def complete(base: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    return got.choices[0].text


def test_tp2_on_a_private_ray_cluster_equals_tp1(tiny_checkpoints):
    """--distributed-executor-backend ray without RAY_ADDRESS: the engine starts its own local
    Ray cluster, rank 1 is an actor, the text equals TP=1's; stopping the server leaves no Ray
    process of that cluster behind."""
    path = tiny_checkpoints["llama"]
    want = tp1_text(path)
    flags = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    before = set(Path("/tmp").glob("pf-ray-*"))
    with running_server(path, *flags, timeout=240, env=RAY_ENV) as (base, proc):
        assert complete(base) == want
        log = Path(proc.log_path).read_text()
        assert "tensor-parallel rank 1 runs on Ray node" in log
        # The cluster the server started (other tests' clusters may come and go meanwhile).
        started = [d for d in set(Path("/tmp").glob("pf-ray-*")) - before if _holding(str(d))]
        assert started, "no private Ray cluster found"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    for cluster_dir in started:
        wait_until(lambda d=cluster_dir: not _holding(str(d)), 60, "the Ray cluster to stop")


def _holding(directory: str) -> list[int]:
    pids = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if directory.encode() in (proc_dir / "cmdline").read_bytes():
                pids.append(int(proc_dir.name))
        except OSError:
            continue
    return pids


_HEAD_NODE = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
nodes = [n for n in ray.nodes() if n["Alive"]]
print(json.dumps({"head": [n["NodeID"] for n in nodes
                            if "node:__internal_head__" in n["Resources"]],
                  "all": [n["NodeID"] for n in nodes]}))
"""


def test_one_engine_spans_two_ray_nodes(tiny_checkpoints):
    """A Ray head and a Ray worker node (one CPU each, two process trees): `pagefleet serve`
    joins them through RAY_ADDRESS, rank 1's actor runs on the worker node, and the OpenAI API
    answers TP=1's greedy text."""
    path = tiny_checkpoints["qwen3"]
    want = tp1_text(path)
    with ray_cluster_of_two_nodes() as address:
        env = {**RAY_ENV, "RAY_ADDRESS": address}
        flags = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
        with running_server(path, *flags, timeout=240, env=env) as (base, proc):
            assert complete(base) == want
            assert httpx.get(f"{base}/health").status_code == 200
            log = Path(proc.log_path).read_text()
            (rank1_node,) = re.findall(r"tensor-parallel rank 1 runs on Ray node (\w+)", log)
        nodes = json.loads(
            subprocess.run(
                [sys.executable, "-c", _HEAD_NODE, address],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, **RAY_ENV},
                check=True,
            ).stdout.splitlines()[-1]
        )
        assert len(nodes["all"]) == 2
        (head,) = nodes["head"]
        assert rank1_node in nodes["all"] and rank1_node != head


def _children(task: Path) -> list[str]:
    try:
        return (task / "children").read_text().split()
    except OSError:  # the thread has ended
        return []


def _worker_pids(pid: int) -> list[int]:
    # Any of the process's threads may have started them (the engine's own thread does).
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in _children(task)]
    return [
        int(c)
        for c in children
        if b"multiprocessing" in Path(f"/proc/{c}/cmdline").read_bytes()
        and b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


@pytest.mark.parametrize("signal_", [signal.SIGKILL])
def test_a_dead_rank_fails_the_server_instead_of_hanging_it(tiny_checkpoints, signal_):
    """Rank 1 (an mp worker) is killed: /health answers 503 (or the server is already gone)
    and the server exits non-zero within seconds, even with a request in flight."""
    path = tiny_checkpoints["llama"]
    flags = ("--tensor-parallel-size", "2")
    with running_server(path, *flags, timeout=180) as (base, proc):
        (worker,) = _worker_pids(proc.pid)
        os.kill(worker, signal_)
        codes: list[int] = []

        def failed() -> bool:
            if proc.poll() is not None:
                return True
            with contextlib.suppress(httpx.HTTPError):
                codes.append(httpx.get(f"{base}/health", timeout=1).status_code)
            return False

        wait_until(failed, 60, "the server to fail")
        assert proc.returncode not in (0, None)
        assert 503 in codes and set(codes) <= {200, 503}
        log = Path(proc.log_path).read_text()
        assert "tensor-parallel rank 1" in log and "SIGKILL" in log


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].rsplit(":", 1)
                found.append((_ip(address), int(port, 16)))
    return found


def _ip(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def test_tensor_parallel_ranks_of_one_node_open_no_port_beyond_loopback(tiny_checkpoints):
    """Attack: torch.distributed's TCP store and gloo's pairs take no credentials, and a
    TCPStore listens on every interface whatever host it is given: anyone who can reach the
    machine could join or stall the ranks' rendezvous. Ranks on one node (mp) must talk over
    loopback only: the server's processes listen on nothing but the HTTP port elsewhere."""
    path = tiny_checkpoints["llama"]
    with running_server(path, "--tensor-parallel-size", "2", timeout=180) as (base, proc):
        http_port = int(base.rsplit(":", 1)[1])
        pids = {proc.pid, *_worker_pids(proc.pid)}
        assert len(pids) == 2
        exposed = [
            (address, port)
            for address, port in _listening(pids)
            if port != http_port and not address.is_loopback
        ]
        assert not exposed, exposed
