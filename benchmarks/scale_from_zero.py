"""Scale from zero: what the first request at zero pods waits for, and what the router's flow
control costs the requests it does not hold.

1. Cold start, in the cluster lab (e2e/cluster: the API, controllers and kubelet of one node;
   the real `pagefleet operator` with its builtin autoscaler, the router and engine pods as
   processes in network namespaces; needs root). A ModelDeployment with `minReplicas: 0` sits
   at zero; one streaming request goes to the router, which holds it. Timestamps, polled every
   POLL_S from the API and read from the engine's log:
     autoscaler reaction   request sent -> the pool's Deployment set to 1 replica
     pod start             replicas set -> the engine process started (the kubelet)
     model load            process started -> the engine listening (its "serving" log line:
                           imports, weights, KV cache)
     readiness             engine listening -> pod Ready (the startup and readiness probes)
     release + 1st token   pod Ready -> the first token at the client (router discovery,
                           release of the held request, prefill)
   for simulated engines and the tiny real model (CPU), `--trials` times each (the pool goes
   back to zero between trials). Probe periods and the autoscale interval are the operator's
   own (time factor 1: a real kubelet's periods), so the reaction is uniform in
   0..--autoscale-interval and readiness is quantised by the startup probe's period.
2. Queueing overhead when not queueing: one `pagefleet serve --simulate` engine, one router
   with flow control (the default --queue-size) and one with `--queue-size 0`, and the engine
   direct; interleaved rounds of sequential one-token completions. Added latency = a router's
   percentile minus the engine's own; printed with the ratio queue / no queue.

    sudo .venv/bin/python benchmarks/scale_from_zero.py [--trials 2] [--engines sim,tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
sys.path.insert(0, str(Path(__file__).parent))
from cluster.fleet import (
    CPU_ENGINE_ARGS,
    md_pods,
    prepare_namespace,
    ready,
    router_url,
    simulated_deployment,
    start_operator,
)
from cluster.lab import Lab
from procs import process, wait_healthy

from pagefleet.engine.cache import demo_checkpoint
from pagefleet.engine.model.tiny import write_tiny_checkpoint
from pagefleet.fleet.up import free_port

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
NS, NAME = "bench", "cold"
DEPLOYMENT = f"{NAME}-colocated"
POLL_S = 0.05
PHASES = ("autoscaler reaction", "pod start", "model load", "readiness", "release + 1st token")
# The engine's line once uvicorn accepts requests (pagefleet.engine.server.serve._announce),
# after logging's default asctime: "2026-12-02 06:30:00,123 INFO ...: serving tiny on http://".
SERVING_MARK = "serving tiny on http://"
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"


# -- 1. cold start in the cluster lab


@dataclass
class ColdStart:
    """Wall-clock stamps (time.time()) of one request's trip from zero pods."""

    sent: float
    scaled: float | None = None
    started: float | None = None
    listening: float | None = None
    ready: float | None = None
    first_token: float | None = None

    def phases(self) -> list[float]:
        marks = [self.sent, self.scaled, self.started, self.listening, self.ready]
        return [b - a for a, b in itertools.pairwise([*marks, self.first_token])]

    @property
    def total(self) -> float:
        return self.first_token - self.sent


def deployment(kind: str, idle_s: int) -> dict:
    """The ModelDeployment at zero: simulated engines, or the tiny checkpoint on the CPU."""
    autoscaling = {
        "mode": "builtin",
        "minReplicas": 0,
        "maxReplicas": 1,
        "scaleToZeroIdleSeconds": idle_s,
        "scaleDownStabilizationSeconds": 0,
    }
    md = simulated_deployment(NAME, NS, {"replicas": 0, "autoscaling": autoscaling})
    if kind == "tiny":
        md["spec"]["engineArgs"] = dict(CPU_ENGINE_ARGS)
    return md


def first_token(url: str) -> float:
    """A streaming completion through the router; time.time() of its first token."""
    body = {"model": "tiny", "prompt": "wake up", "max_tokens": 4, "stream": True}
    with (
        httpx.Client(timeout=600) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        if r.status_code != 200:
            raise RuntimeError(f"the router answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.time()
    raise RuntimeError("the stream ended without a token")


def replicas(lab: Lab) -> int:
    found = lab.kube.get("apps/v1", "Deployment", NS, DEPLOYMENT)
    return found["spec"]["replicas"] if found else -1


def engine_started(pod: dict) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any("running" in (c.get("state") or {}) for c in statuses)


def listening_at(lab: Lab, pod: dict) -> float | None:
    """When the engine logged that it serves (its asctime is the machine's local time)."""
    for line in lab.pod_log(pod, "engine").splitlines():
        if SERVING_MARK in line:
            stamp = datetime.datetime.strptime(line[:23], LOG_TIME_FORMAT)
            return stamp.timestamp()
    return None


def observe(lab: Lab, trip: ColdStart, answer) -> None:
    """Poll the API and the engine's log until the request's first token arrives."""
    while not answer.done():
        now = time.time()
        if trip.scaled is None and replicas(lab) >= 1:
            trip.scaled = now
        pods = md_pods(lab, NS, NAME)
        if trip.started is None and any(engine_started(p) for p in pods):
            trip.started = now
        if trip.ready is None and ready(pods):
            trip.ready = now
        if trip.listening is None and pods:
            trip.listening = listening_at(lab, pods[0])
        time.sleep(POLL_S)
    trip.first_token = answer.result()
    if trip.listening is None:
        trip.listening = listening_at(lab, md_pods(lab, NS, NAME)[0])


def at_zero(lab: Lab) -> bool:
    return replicas(lab) == 0 and not md_pods(lab, NS, NAME)


def cold_starts(kind: str, store: Path, root: Path, args) -> list[ColdStart]:
    trips = []
    with Lab(root, claims={"models": str(store)}, time_factor=1.0) as lab:
        prepare_namespace(lab, NS)
        start_operator(lab, "--autoscale-interval", str(args.autoscale_interval))
        lab.kube.create(deployment(kind, args.idle_seconds))
        url = router_url(lab, NS, NAME)
        for _ in range(args.trials):
            lab.wait_for(lambda: at_zero(lab), 300, "the pool at zero")
            trip = ColdStart(time.time())
            try:
                observe(lab, trip, lab.submit(first_token, url))
            except Exception:
                print(lab.describe())  # the pods and their logs' ends, before the lab goes
                raise
            trips.append(trip)
    return trips


def model_store(root: Path) -> Path:
    """The `models` claim: the tiny checkpoint under the name the deployment uses."""
    store = root / "model-store"
    write_tiny_checkpoint(store / "tiny", "LlamaForCausalLM", max_position_embeddings=8192)
    for path in [store, *store.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return store


def print_cold_starts(kind: str, trips: list[ColdStart]) -> None:
    print(f"\ncold start, {kind} engine ({len(trips)} trials): seconds per phase")
    print("  " + " | ".join(f"{p:>19}" for p in (*PHASES, "total")))
    for trip in trips:
        print("  " + " | ".join(f"{v:19.2f}" for v in (*trip.phases(), trip.total)))


# -- 2. flow control's cost when nothing is held


def serve_cmd(port: int) -> list[str]:
    profile = {"step_overhead_s": 0.001, "prefill_s_per_token": 0.0, "decode_s_per_seq": 0.0}
    cmd = [PAGEFLEET, "serve", str(demo_checkpoint()), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--simulate", "--simulate-profile", json.dumps(profile)]
    return [*cmd, "--served-model-name", "sim", "--log-stats-interval", "0"]


def router_cmd(port: int, engine: str, queue_size: int | None) -> list[str]:
    cmd = [PAGEFLEET, "router", "--endpoints", engine, "--host", "127.0.0.1", "--port", str(port)]
    return cmd + ([] if queue_size is None else ["--queue-size", str(queue_size)])


def timed_requests(client: httpx.Client, url: str, count: int) -> list[float]:
    body = {"model": "sim", "prompt": "how long does routing take", "max_tokens": 1}
    out = []
    for _ in range(count):
        started = time.perf_counter()
        r = client.post(f"{url}/v1/completions", json=body)
        out.append(time.perf_counter() - started)
        r.raise_for_status()
    return out


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(int(p / 100 * len(values)), len(values) - 1)]


def queue_overhead(args) -> dict[str, list[float]]:
    """Latencies per path: the engine direct, the router with and without flow control."""
    ports = {"engine": free_port(), "queue": free_port(), "no queue": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(serve_cmd(ports["engine"])))
        wait_healthy(urls["engine"], 300)
        stack.enter_context(process(router_cmd(ports["queue"], urls["engine"], None)))
        stack.enter_context(process(router_cmd(ports["no queue"], urls["engine"], 0)))
        for url in urls.values():
            wait_healthy(url, 120)
        clients = {name: stack.enter_context(httpx.Client(timeout=60)) for name in urls}
        for name, url in urls.items():  # warm: connections, tokenizer, first scrapes
            timed_requests(clients[name], url, 20)
        latencies: dict[str, list[float]] = {name: [] for name in urls}
        order = list(urls)
        for _ in range(args.rounds):
            for name in order:
                latencies[name] += timed_requests(clients[name], urls[name], args.per_round)
            order = order[1:] + order[:1]  # each path goes first in turn
    return latencies


def print_overhead(latencies: dict[str, list[float]]) -> None:
    direct = latencies["engine"]
    n = len(direct)
    print(f"\nrouter overhead when nothing is held ({n} requests per path, interleaved)")
    p50, p99 = (pct(direct, p) * 1e3 for p in (50, 99))
    print(f"  engine direct: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    added = {}
    for name in ("queue", "no queue"):
        added[name] = [pct(latencies[name], p) - pct(direct, p) for p in (50, 99)]
        p50, p99 = (a * 1e3 for a in added[name])
        print(f"  router, {name:>8}: added p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    ratios = [q / b if b > 0 else float("nan") for q, b in zip(*added.values(), strict=True)]
    print(f"  ratio queue / no queue: p50 {ratios[0]:.2f}, p99 {ratios[1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="sim,tiny", help="sim, tiny or both (sim,tiny)")
    parser.add_argument("--trials", type=int, default=2, help="cold starts per engine kind")
    parser.add_argument(
        "--autoscale-interval", type=float, default=15.0, help="the operator's (its default)"
    )
    parser.add_argument("--idle-seconds", type=int, default=2, help="scaleToZeroIdleSeconds")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=40)
    parser.add_argument("--skip-cold-start", action="store_true")
    args = parser.parse_args()

    if not args.skip_cold_start:
        root = Path(tempfile.mkdtemp(prefix="scale-from-zero-"))
        try:
            store = model_store(root)
            for kind in args.engines.split(","):
                print_cold_starts(kind, cold_starts(kind, store, root / kind, args))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print_overhead(queue_overhead(args))


if __name__ == "__main__":
    main()
