"""A chaos soak in the cluster lab: Poisson chat and completion requests through the routers of a
disaggregated (prefill + decode) and a colocated ModelDeployment, and to the colocated one also
through a Gateway's Envoy asking its Endpoint Picker (the InferencePool the operator makes for
it), while a fault schedule
SIGKILLs engine, router and operator processes, cuts a prefill pod's link (link down in its
network namespace) while it holds blocks for a transfer, freezes a pod (SIGSTOP, then SIGCONT)
past its probes, and rolls an engine Deployment.

Every request is accounted for: succeeded (greedy text equal to the offline engine's), wrong
(a 200 with other text: a defect), failed with a retryable status and Retry-After, failed
otherwise (by reason), or lost (no answer before the client's timeout). At the end no engine
may hold a KV block. Each fault has a window (see `Window`) over its deployment's requests:
the success rate outside every window is the fleet's reliability under churn, and an engine
that dies, freezes or rolls must cost no more than the requests it was serving. TTFT (streamed
requests) is reported per phase (the last fault begun before the request).

`plan_short()` runs in `make test` (e2e/cluster/test_soak.py); benchmarks/soak.py runs the long
plan and writes the table docs/benchmarks.md records.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .fleet import (
    ENVOY_REPOSITORY,
    GATEWAY_PORT,
    INFERENCE_POOL_CRD,
    envoy_image,
    for_cpu,
    md_pods,
    metrics,
    pod_url,
    prepare_namespace,
    ready,
    router_url,
    start_gateway,
    start_operator,
    wait_serving,
)
from .lab import Lab, wait_for

NS = "soak"
PD, COLO = "soak-pd", "soak-colo"
GATEWAY = "gateway"  # the route through Envoy and the colocated deployment's picker
MODEL = "tiny"
MAX_TOKENS = 12
WINDOW_MARGIN_S = 3.0  # after a fault, the routers' scrapes and ejections settle
# Engines let blocks held for a decode pod go after this long (the default is 120 s): a
# decode that died mid-transfer must not leave them held past the soak's end.
HOLD_TIMEOUT_S = 10
LONG_PROMPT = " ".join(f"history{i % 29} of the chat so far" for i in range(40))
SHORT_PROMPTS = [
    "What is a KV cache?",
    "the router sends each request to",
    "Name three rivers.",
    "Count from one to ten:",
]


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str  # kill-engine | kill-router | kill-operator | cut-link | freeze | roll
    deployment: str
    role: str = ""  # the pool of a disaggregated deployment ("prefill", "decode"), or any
    hold_s: float = 0.0  # how long a cut link stays down, a frozen pod stays stopped


@dataclass(frozen=True)
class Plan:
    duration_s: float
    max_requests: int
    rate: float  # requests per second, Poisson, over both deployments
    faults: tuple[Fault, ...]
    seed: int = 0
    stream_share: float = 0.75
    client_timeout_s: float = 120.0


def plan_short() -> Plan:
    """One fault of each kind in under a minute of load (the CI soak). The roll comes as early
    as the killed engine is back: its two pods' starts are the longest recovery, and the soak
    ends only when every victim is back."""
    return Plan(
        duration_s=40,
        max_requests=300,
        rate=2.0,
        faults=(
            Fault(4, "kill-engine", COLO),
            Fault(8, "cut-link", PD, "prefill", hold_s=3),
            Fault(14, "kill-router", PD),
            Fault(21, "roll", COLO),
            Fault(25, "freeze", PD, "prefill", hold_s=6),  # past readiness only
            Fault(32, "kill-operator", ""),
        ),
    )


def plan_long(duration_s: float = 600, rate: float = 3.0) -> Plan:
    """Every kind of fault, again and again, for `duration_s` (benchmarks/soak.py)."""
    cycle = (
        Fault(0, "kill-engine", COLO),
        Fault(15, "cut-link", PD, "prefill", hold_s=6),
        Fault(30, "kill-router", COLO),
        Fault(45, "freeze", COLO, hold_s=40),  # past readiness and liveness: a restart
        Fault(100, "kill-engine", PD, "decode"),
        Fault(115, "kill-operator", ""),
        Fault(125, "roll", COLO),
        Fault(160, "kill-router", PD),
        Fault(175, "freeze", PD, "prefill", hold_s=8),  # past readiness only
    )
    period, faults, start = 200.0, [], 20.0
    while start < duration_s:  # the last cycle cut short: no fault in the last 30 s
        faults += [
            Fault(start + f.at_s, f.kind, f.deployment, f.role, f.hold_s)
            for f in cycle
            if start + f.at_s + f.hold_s < duration_s - 30
        ]
        start += period
    return Plan(duration_s, int(duration_s * rate * 2), rate, tuple(faults))


# --- the fleet -------------------------------------------------------------------------------


def deployments() -> list[dict]:
    """A disaggregated and a colocated deployment of the tiny checkpoint, sized for CPU."""
    engine_args = {"max-model-len": 1024, "kv-hold-timeout": HOLD_TIMEOUT_S}

    def md(name: str, pools: dict, **spec) -> dict:
        return for_cpu(
            {
                "apiVersion": "pagefleet.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {"name": name, "namespace": NS},
                "spec": {
                    "model": {"name": MODEL, "pvc": {"claimName": "models", "path": "tiny"}},
                    "engineArgs": dict(engine_args),
                    "pools": pools,
                    **spec,
                },
            }
        )

    pd = md(
        PD,
        {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        mode="disaggregated",
        router={"pdThresholdTokens": 64},
        kvTransfer={"connector": "nixl"},
    )
    # An Endpoint Picker for the colocated pool: a Gateway's Envoy sends it a share of the load.
    # No fallback endpoints: the lab's Gateway is the ORIGINAL_DST shape (Envoy Gateway's),
    # which connects to one `ip:port` and answers 503 to a list (fallbacks need override_host,
    # whose static endpoint list cannot follow pods that the faults replace).
    colo = md(COLO, {"colocated": {"replicas": 2}})
    colo["spec"]["inferencePool"] = {"enabled": True}
    return [pd, colo]


def lab_options(model_store: Path) -> dict:
    """What open_lab needs for the soak: the model claim, and Envoy's image for the Gateway."""
    return {"claims": {"models": str(model_store)}, "images": {ENVOY_REPOSITORY: envoy_image()}}


@dataclass
class Fleet:
    """The lab and what runs on its node: the operator is a process there, restarted when it
    exits (as its Deployment would restart it: a leader that missed its renew deadline exits
    on purpose)."""

    lab: Lab
    operator: subprocess.Popen
    urls: dict[str, str] = field(default_factory=dict)  # deployment -> its router's URL
    restarts: int = 0  # operator processes started after the first (names their logs)
    exits: int = 0  # operator processes that exited on their own
    lock: threading.Lock = field(default_factory=threading.Lock)

    def kill_operator(self) -> str:
        """SIGKILL the operator's process group (as a container's), start a new one; its
        name."""
        with self.lock:
            os.killpg(self.operator.pid, signal.SIGKILL)
            return self._replace_operator()

    def supervise(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            with self.lock:
                if self.operator.poll() is not None:
                    self.exits += 1
                    self._replace_operator()

    def _replace_operator(self) -> str:
        self.operator.wait()
        self.lab.processes.remove(self.operator)
        self.restarts += 1
        name = f"operator-{self.restarts}"
        self.operator = start_operator(self.lab, "--autoscale-interval", "1", name=name)
        return name


def start_fleet(lab: Lab) -> Fleet:
    """Both deployments serving through their routers, and the Gateway through the picker;
    `urls` by route: each deployment's name (its router), and GATEWAY."""
    prepare_namespace(lab, NS)
    lab.kube.create(INFERENCE_POOL_CRD)  # the Inference Extension's, installed beforehand
    operator = start_operator(lab, "--autoscale-interval", "1")
    for md in deployments():
        lab.kube.create(md)
    fleet = Fleet(lab, operator)
    for name, engines in ((PD, 2), (COLO, 2)):
        wait_serving(lab, NS, name, engines, timeout=300)
        fleet.urls[name] = router_url(lab, NS, name)
    picker = lab.wait_for(lambda: ready(md_pods(lab, NS, COLO, "epp")), 120, "the picker Ready")
    gateway = start_gateway(lab, NS, "soak-gateway", picker[0]["status"]["podIP"])
    fleet.urls[GATEWAY] = pod_url(gateway, GATEWAY_PORT)
    return fleet


# --- the load ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    deployment: str
    route: str  # the deployment's router, or GATEWAY
    kind: str  # completion | chat
    prompt: str
    stream: bool
    start: float  # seconds since the soak began
    end: float = 0.0
    status: int | None = None  # None: no HTTP answer at all
    retry_after: bool = False
    text: str | None = None  # the whole answer's text (streamed or not)
    ttft: float | None = None
    error: str | None = None  # why it failed (an SSE error event, a transport error)
    timed_out: bool = False  # the client gave up waiting: lost


def send(url: str, o: Outcome, timeout: float) -> None:
    """One request, accounted into `o` (never raises)."""
    started = time.monotonic()
    path = "/v1/chat/completions" if o.kind == "chat" else "/v1/completions"
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": o.stream}
    if o.kind == "chat":
        body["messages"] = [{"role": "user", "content": o.prompt}]
    else:
        body["prompt"] = o.prompt
    try:
        with (
            httpx.Client(timeout=timeout) as http,
            http.stream("POST", f"{url}{path}", json=body) as r,
        ):
            o.status = r.status_code
            o.retry_after = "retry-after" in r.headers
            if r.status_code != 200:
                o.error = f"HTTP {r.status_code}"
                r.read()
            elif not o.stream:
                choice = json.loads(r.read())["choices"][0]
                o.text = choice["message"]["content"] if o.kind == "chat" else choice["text"]
            else:
                o.text, o.ttft, o.error = _read_stream(r, o.kind, started)
    except httpx.TimeoutException as e:
        o.timed_out, o.error = True, f"timeout: {type(e).__name__}"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        o.error = f"{type(e).__name__}"
    o.end = o.start + (time.monotonic() - started)


def _read_stream(r: httpx.Response, kind: str, started: float):
    """(text, TTFT, error) of an SSE answer; error when it carried an error event or ended
    without [DONE]."""
    parts, ttft = [], None
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return "".join(parts), ttft, None
        chunk = json.loads(data)
        if "error" in chunk:
            return None, ttft, f"stream error: {chunk['error'].get('type')}"
        for choice in chunk.get("choices", []):
            piece = choice.get("delta", {}).get("content") if kind == "chat" else choice["text"]
            if piece:
                ttft = ttft if ttft is not None else time.monotonic() - started
                parts.append(piece)
    return None, ttft, "stream ended without [DONE]"


class LoadGenerator:
    """Poisson arrivals over both deployments, bounded by count and time, each request on a
    thread of its own in the lab's network namespace (an open loop: a slow answer delays no
    later request)."""

    def __init__(self, fleet: Fleet, plan: Plan, t0: float) -> None:
        self.fleet, self.plan, self.t0 = fleet, plan, t0
        self.rng = random.Random(plan.seed)
        self.outcomes: list[Outcome] = []
        self.futures: list = []
        self.clients = fleet.lab.network.executor(workers=256)

    def request(self, index: int, now: float) -> Outcome:
        rng = self.rng
        deployment = rng.choice([PD, COLO])
        kind = rng.choice(["completion", "chat"])
        if deployment == PD and rng.random() < 0.5:  # worth disaggregating, never cached
            prompt = f"request {index}: {LONG_PROMPT}"
        else:
            prompt = rng.choice(SHORT_PROMPTS)
        stream = rng.random() < self.plan.stream_share
        route = GATEWAY if deployment == COLO and rng.random() < 0.5 else deployment
        return Outcome(index, deployment, route, kind, prompt, stream, now)

    def run(self) -> None:
        plan = self.plan
        next_at = 0.0
        while len(self.outcomes) < plan.max_requests:
            next_at += self.rng.expovariate(plan.rate)
            if next_at >= plan.duration_s:
                break
            delay = self.t0 + next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            o = self.request(len(self.outcomes), time.monotonic() - self.t0)
            self.outcomes.append(o)
            url = self.fleet.urls[o.route]
            self.futures.append(self.clients.submit(send, url, o, plan.client_timeout_s))

    def wait(self) -> None:
        for future in self.futures:
            future.result()
        self.clients.shutdown()


# --- the faults --------------------------------------------------------------------------------


@dataclass
class Window:
    """A fault's seconds: the requests of its deployment (every deployment's, for the
    operator) that overlap [start, end] are "around" it. The window closes WINDOW_MARGIN_S
    after the fault itself ends (a kill, the link back up, the pod resumed, the roll begun);
    only a router kill keeps it open until the router is Ready again, since nothing else can
    answer its clients. `recovered` is when the lab showed the victim back (a pod restarted
    and Ready, the roll done), for the report."""

    fault: Fault
    start: float  # seconds since the soak began
    end: float = 0.0
    recovered: float | None = None
    detail: str = ""

    def covers(self, o: Outcome) -> bool:
        scoped = not self.fault.deployment or self.fault.deployment == o.deployment
        return scoped and o.start <= self.end and o.end >= self.start


def container_pid(pod: dict) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].split("//")[1])


def pods_of(lab: Lab, fault: Fault, component: str = "engine") -> list[dict]:
    pods = ready(md_pods(lab, NS, fault.deployment, component))
    if fault.role:
        pods = [p for p in pods if p["metadata"]["labels"].get("pagefleet.io/role") == fault.role]
    return sorted(pods, key=lambda p: p["metadata"]["name"])


def restarted_and_ready(lab: Lab, pod: dict, restarts: int) -> bool:
    now = lab.kube.get("v1", "Pod", NS, pod["metadata"]["name"])
    if now is None:
        return True  # replaced: its Deployment's other pods carry on
    status = now["status"].get("containerStatuses") or [{}]
    return status[0].get("restartCount", 0) > restarts and bool(ready([now]))


def ready_again(lab: Lab, pod: dict) -> bool:
    now = lab.kube.get("v1", "Pod", NS, pod["metadata"]["name"])
    return now is None or bool(ready([now]))


class Chaos:
    """Runs a plan's faults at their times; each returns (whether its window waits for the
    recovery, the recovery's predicate), measured on a thread of its own."""

    def __init__(self, fleet: Fleet, t0: float) -> None:
        self.fleet, self.lab, self.t0 = fleet, fleet.lab, t0
        self.windows: list[Window] = []
        self.watchers: list[threading.Thread] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self, faults: tuple[Fault, ...]) -> None:
        for fault in sorted(faults, key=lambda f: f.at_s):
            delay = fault.at_s - self.now()
            if delay > 0:
                time.sleep(delay)
            window = Window(fault, self.now() - 1.0)
            self.windows.append(window)
            until_recovered, recovered = getattr(self, "_" + fault.kind.replace("-", "_"))(
                fault, window
            )
            window.end = self.now() + WINDOW_MARGIN_S
            watcher = threading.Thread(
                target=self._recovery, args=(window, recovered, until_recovered)
            )
            watcher.start()
            self.watchers.append(watcher)

    def wait(self) -> None:
        for watcher in self.watchers:
            watcher.join()

    def _recovery(self, window: Window, recovered, window_waits: bool) -> None:
        with contextlib.suppress(AssertionError):  # reported as never recovered
            wait_for(recovered, 300, f"{window.fault.kind} to recover")
            window.recovered = self.now()
            if window_waits:
                window.end = window.recovered + WINDOW_MARGIN_S

    def _kill(self, pod: dict, window: Window):
        restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        os.kill(container_pid(pod), signal.SIGKILL)
        window.detail = pod["metadata"]["name"]
        return lambda: restarted_and_ready(self.lab, pod, restarts)

    def _kill_engine(self, fault: Fault, window: Window):
        return False, self._kill(pods_of(self.lab, fault)[0], window)

    def _kill_router(self, fault: Fault, window: Window):
        return True, self._kill(pods_of(self.lab, fault, "router")[0], window)

    def _kill_operator(self, fault: Fault, window: Window):
        """SIGKILL, then a new operator process (as its Deployment's ReplicaSet would), back
        once it holds the leader Lease (the dead one's expires first)."""
        name = self.fleet.kill_operator()
        window.detail = name
        return False, lambda: "took the lease" in self.lab.log(name)

    def _cut_link(self, fault: Fault, window: Window):
        """The prefill pod's eth0 down for `hold_s`, cut once it is prefilling or holding
        blocks for a decode pod (the hand-off then fails or waits), then up with its route."""
        pod = pods_of(self.lab, fault)[0]
        netns = self.lab.network.pod_netns[pod["metadata"]["uid"]]
        state = self.lab.in_lab(in_flight, pod_url(pod))
        _ip("-n", netns, "link", "set", "eth0", "down")
        window.detail = f"{pod['metadata']['name']}, cut {state or 'while idle'}"
        time.sleep(fault.hold_s)
        _ip("-n", netns, "link", "set", "eth0", "up")
        with contextlib.suppress(subprocess.CalledProcessError):  # gone with the link or not
            _ip("-n", netns, "route", "add", "default", "via", self.lab.network.node_ip)
        return False, lambda: ready_again(self.lab, pod)

    def _freeze(self, fault: Fault, window: Window):
        pod = pods_of(self.lab, fault)[0]
        group = container_pid(pod)  # the container is a process group of its own
        os.killpg(group, signal.SIGSTOP)
        window.detail = pod["metadata"]["name"]
        try:
            time.sleep(fault.hold_s)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the kubelet may have killed it
                os.killpg(group, signal.SIGCONT)
        return False, lambda: ready_again(self.lab, pod)

    def _roll(self, fault: Fault, window: Window):
        """A new engine pod template (one engine arg changed): the pool's Deployment rolls,
        pod by pod, each old one draining on SIGTERM."""
        md = self.lab.kube.get("pagefleet.io/v1alpha1", "ModelDeployment", NS, fault.deployment)
        args = dict(md["spec"]["engineArgs"])
        args["max-num-seqs"] = 64 if args.get("max-num-seqs") != 64 else 32
        self.lab.kube.patch(md, {"spec": {"engineArgs": args}})
        window.detail = f"max-num-seqs {args['max-num-seqs']}"
        old = {p["metadata"]["name"] for p in md_pods(self.lab, NS, fault.deployment)}
        replicas = sum(pool.get("replicas", 1) for pool in md["spec"]["pools"].values())

        def rolled() -> bool:
            pods = md_pods(self.lab, NS, fault.deployment)
            names = {p["metadata"]["name"] for p in ready(pods)}
            return len(pods) == len(names) == replicas and not names & old

        return False, rolled


def in_flight(url: str, within_s: float = 8.0) -> str:
    """Poll a prefill pod's gauges every 20 ms until it is prefilling or holding blocks for a
    decode pod (the moment to cut its link); what it was doing, or "" if neither came."""
    deadline = time.monotonic() + within_s
    with httpx.Client(timeout=2) as http:
        while time.monotonic() < deadline:
            text = http.get(f"{url}/metrics").text
            held = gauge(text, "pagefleet:kv_transfer_held_blocks")
            if held:
                return f"{held:.0f} blocks held"
            if gauge(text, "vllm:num_requests_running"):
                return "prefilling"
            time.sleep(0.02)
    return ""


def gauge(text: str, name: str) -> float:
    """A metric's value in Prometheus text, summed over its label sets."""
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


# --- the run and its report ----------------------------------------------------------------


@dataclass
class Report:
    plan: Plan
    outcomes: list[Outcome]
    windows: list[Window]
    expected: dict[tuple[str, str], str]  # (kind, prompt) -> the offline engine's text
    held_blocks: float
    busy_engines: list[str]  # engines still running or holding requests at the end
    seconds: float
    transfers: dict[str, float] = field(default_factory=dict)  # decode pods' KV pulls
    operator_exits: int = 0  # operator processes that exited on their own (restarted)

    def verdict(self, o: Outcome) -> str:
        if o.timed_out:
            return "lost"
        if o.status == 200 and o.text is not None and o.error is None:
            return "ok" if o.text == self.expected[(o.kind, o.prompt)] else "wrong"
        if o.status in (429, 503) and o.retry_after:
            return "retryable"
        return "failed: " + (o.error or f"HTTP {o.status}")

    def around_a_fault(self, o: Outcome) -> bool:
        return any(w.covers(o) for w in self.windows)

    def counts(self) -> Counter:
        return Counter(self.verdict(o) for o in self.outcomes)

    def success_outside_faults(self) -> tuple[int, int]:
        """(succeeded, all) over the requests that overlap no fault window."""
        calm = [o for o in self.outcomes if not self.around_a_fault(o)]
        return sum(self.verdict(o) == "ok" for o in calm), len(calm)

    def phases(self) -> list[tuple[str, list[Outcome]]]:
        starts = [w.start + 1.0 for w in self.windows]
        names = ["steady"] + [f"{w.fault.kind} {w.fault.deployment}".strip() for w in self.windows]
        by_phase: dict[int, list[Outcome]] = {}
        for o in self.outcomes:
            by_phase.setdefault(bisect.bisect_right(starts, o.start), []).append(o)
        return [(names[i], by_phase.get(i, [])) for i in range(len(names))]

    def table(self) -> str:
        counts, (calm_ok, calm) = self.counts(), self.success_outside_faults()
        lines = [
            f"{len(self.outcomes)} requests in {self.seconds:.0f} s "
            f"(rate {self.plan.rate}/s, {len(self.windows)} faults)",
            "",
            "| outcome | requests |",
            "|---|---|",
            *(f"| {name} | {n} |" for name, n in sorted(counts.items())),
            "",
            "requests that succeeded, per route: "
            + ", ".join(
                f"{route} {sum(self.verdict(o) == 'ok' for o in mine)}/{len(mine)}"
                for route in sorted({o.route for o in self.outcomes})
                for mine in [[o for o in self.outcomes if o.route == route]]
            ),
            "",
            f"success outside the fault windows: {calm_ok}/{calm}"
            f" ({100 * calm_ok / max(calm, 1):.1f}%); KV blocks held at the end:"
            f" {self.held_blocks:.0f}; decode pods' KV pulls (since their last start):"
            f" {self.transfers}; operator exits on its own: {self.operator_exits}",
            *(
                f"- outside every window: request {o.index} via {o.route} at {o.start:.1f}-"
                f"{o.end:.1f} s: {self.verdict(o)}"
                for o in self.outcomes
                if self.verdict(o) != "ok" and not self.around_a_fault(o)
            ),
            "",
            "| phase | fault at (s) | window to (s) | back at (s) | requests | ok |"
            " TTFT p50 (ms) | p99 (ms) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (name, outcomes), window in zip(self.phases(), [None, *self.windows], strict=True):
            ttfts = sorted(o.ttft for o in outcomes if o.ttft is not None)
            at = f"{window.start + 1:.0f}" if window else "-"
            until = f"{window.end:.0f}" if window else "-"
            back = (
                "-"
                if window is None
                else "never"
                if window.recovered is None
                else (f"{window.recovered:.0f}")
            )
            detail = f" ({window.detail})" if window and window.detail else ""
            ok = sum(self.verdict(o) == "ok" for o in outcomes)
            lines.append(
                f"| {name}{detail} | {at} | {until} | {back} | {len(outcomes)} | {ok} |"
                f" {_ms(ttfts, 0.5)} | {_ms(ttfts, 0.99)} |"
            )
        return "\n".join(lines)


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{1e3 * values[0]:.0f}"
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return f"{1e3 * cuts[round(q * 100) - 1]:.0f}"


def quiesced(lab: Lab) -> tuple[float, list[str]]:
    """KV blocks still held for decode pods across every engine, and the engines with
    requests still running or waiting."""
    held, busy = 0.0, []
    for name in (PD, COLO):
        for pod in ready(md_pods(lab, NS, name)):
            m = metrics(lab, pod)
            held += m.get("pagefleet:kv_transfer_held_blocks", 0.0)
            if m.get("vllm:num_requests_running", 0) or m.get("vllm:num_requests_waiting", 0):
                busy.append(pod["metadata"]["name"])
    return held, busy


def offline_answers(offline, keys: set[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The offline engine's greedy text for each (kind, prompt), in one batch: the answer a
    request must get whichever pods served it."""
    from pagefleet.engine.sampling_params import SamplingParams

    keys = sorted(keys)
    prompts = []
    for kind, prompt in keys:
        if kind == "chat":
            messages = [{"role": "user", "content": prompt}]
            ids = offline.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True
            )
            prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
        else:
            prompts.append(prompt)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = offline.llm.generate(prompts, params, use_tqdm=False)
    return {key: out.outputs[0].text for key, out in zip(keys, outputs, strict=True)}


def run_soak(fleet: Fleet, plan: Plan, offline) -> Report:
    """Load and faults at once, every answer in, then the engines' end state."""
    t0 = time.monotonic()
    load, chaos = LoadGenerator(fleet, plan, t0), Chaos(fleet, t0)
    faults = threading.Thread(target=chaos.run, args=(plan.faults,), name="chaos")
    stop = threading.Event()
    supervisor = threading.Thread(target=fleet.supervise, args=(stop,), name="supervisor")
    faults.start()
    supervisor.start()
    load.run()
    faults.join()
    load.wait()
    seconds = time.monotonic() - t0
    lab = fleet.lab
    chaos.wait()  # every victim back (or given up on): the end state counts every engine
    stop.set()
    supervisor.join()
    # Blocks a dead decode pod never read go at the hold timeout; requests end on their own.
    with contextlib.suppress(AssertionError):  # what is left is reported
        wait_for(lambda: quiesced(lab) == (0.0, []), HOLD_TIMEOUT_S * 3, "engines idle")
    held, busy = quiesced(lab)
    transfers: Counter = Counter()
    for pod in ready(md_pods(lab, NS, PD)):
        if pod["metadata"]["labels"].get("pagefleet.io/role") == "decode":
            m = metrics(lab, pod)
            for what in ("transfers", "failures", "fallbacks"):
                transfers[what] += m.get(f"pagefleet:kv_transfer_{what}_total", 0.0)
    expected = offline_answers(offline, {(o.kind, o.prompt) for o in load.outcomes})
    return Report(
        plan,
        load.outcomes,
        chaos.windows,
        expected,
        held,
        busy,
        seconds,
        dict(transfers),
        fleet.exits,
    )
