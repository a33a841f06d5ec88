"""`pagefleet up`: the roles of a cluster as local processes on 127.0.0.1, supervised.

`plan_fleet` (pure) turns the options into child specs: engines (one prefill + one decode +
one colocated by default, each publishing KV events) and a router in front of them with the
precise prefix index. `Supervisor` starts them, waits until every one is healthy, restarts a
child that dies, and stops them all on Ctrl-C or SIGTERM; children also get SIGTERM if this
process itself dies (Linux parent-death signal), so nothing is left behind.

Each run makes a fresh fleet secret (a file only this user can read, removed at the end) and
hands its path to every child: the router signs kv_transfer_params with it, the engines
authenticate KV transfers and encrypt their KV events with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pagefleet.common.serve_command import (
    KV_ROLES,
    ServeCommand,
    kv_events_config,
    kv_transfer_config,
    serve_argv,
)

BANNER = """pagefleet is up: {summary}
Router (OpenAI API): {router}

Stream a chat completion:

  curl -N {router}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "stream": true, "max_tokens": 32,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

Metrics: {router}/metrics (router)
{engine_metrics}
Stop: Ctrl-C
"""


@dataclass
class ChildSpec:
    name: str
    role: str  # router | prefill | decode | both
    argv: list[str]
    url: str  # base URL; /health says when it is ready
    log: str = ""
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment


@dataclass
class FleetOptions:
    model: str
    served_model_name: str = "demo"
    host: str = "127.0.0.1"
    port: int = 8000
    engines: int = 1  # colocated engines
    disaggregated: bool = True  # add one prefill and one decode engine
    simulate: bool = False
    connector: str = "nixl"
    engine_args: list[str] = field(default_factory=list)
    fleet_secret_file: str | None = None  # given to every child
    # torch threads of each engine (None: torch's default, every core). The engines of a
    # local fleet share the machine; each taking every core makes its OpenMP threads wait for
    # siblings the others descheduled (measured on 2 busy cores: a decode step ~13x the CPU).
    threads_per_engine: int | None = None


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Above Ray's worker ports (10002-19999 by default): a TP engine's Ray node binds those.
LOWEST_PICKED = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (tests, benchmarks and `pagefleet up` pick ports so),
    below the kernel's ephemeral range where it has room there: a port picked now is bound
    later by another process, and one in the ephemeral range may meanwhile be handed to any
    socket bound to port 0 (UCX's listeners, say: a fleet's router lost its port so)."""
    low = _ephemeral_low()
    if low is not None and low - LOWEST_PICKED >= 1000:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(LOWEST_PICKED, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int | None:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port whose next port is free too (KV events + their replay socket)."""
    for _ in range(100):
        port = free_port(host)
        with socket.socket() as s:
            try:
                s.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise OSError("no free pair of ports")


def plan_fleet(
    opts: FleetOptions, pagefleet: str, free_pair: Callable[[], int] | None = None
) -> list[ChildSpec]:
    """The processes of a local fleet: engines first, the router last."""
    if opts.simulate and opts.disaggregated:
        raise ValueError("--simulate has no KV to transfer: use --no-disaggregated with it")
    if opts.engines < 0 or (opts.engines == 0 and not opts.disaggregated):
        raise ValueError("--engines must be >= 1 (or >= 0 with --disaggregated)")
    pick = _apart(free_pair or (lambda: free_port_pair(opts.host)), {opts.port})
    roles = ["both"] * opts.engines + (["prefill", "decode"] if opts.disaggregated else [])
    engines, events = [], []
    for i, role in enumerate(roles):
        engine, events_endpoint = _engine_child(opts, pagefleet, i, role, pick)
        engines.append(engine)
        events.append(events_endpoint)
    endpoints = ",".join(e.url + ("" if e.role == "both" else f"@{e.role}") for e in engines)
    router = [pagefleet, "router", "--host", opts.host, "--port", str(opts.port)]
    router += ["--endpoints", endpoints, "--model", opts.served_model_name]
    router += ["--prefix-index", "precise", "--kv-events-endpoints", ",".join(events)]
    router += ["--tokenizer", opts.model]
    if opts.fleet_secret_file:
        router += ["--fleet-secret-file", opts.fleet_secret_file]
    return [*engines, ChildSpec("router", "router", router, f"http://{opts.host}:{opts.port}")]


def _apart(free_pair: Callable[[], int], taken: set[int]) -> Callable[[], int]:
    """`free_pair` kept off the ports in `taken` and off the pairs it gave before: every
    child binds its ports only once it runs, so a pick is free of the others' only if the
    plan says so (a fleet's router once lost its port to an engine's pick)."""

    def pick() -> int:
        for _ in range(100):
            port = free_pair()
            if port not in taken and port + 1 not in taken:
                taken.update((port, port + 1))
                return port
        raise OSError("no free pair of ports apart from the fleet's others")

    return pick


def _engine_child(
    opts: FleetOptions, pagefleet: str, index: int, role: str, free_pair: Callable[[], int]
) -> tuple[ChildSpec, str]:
    """One engine process and the endpoint of its KV events."""
    port, events_port = free_pair(), free_pair()
    json_args = {"kv-events-config": kv_events_config(opts.host, events_port)}
    if role in KV_ROLES:
        kv = kv_transfer_config(opts.connector, role, opts.host, free_pair())
        json_args["kv-transfer-config"] = kv
    command = ServeCommand(
        program=pagefleet,
        model=opts.model,
        host=opts.host,
        port=port,
        served_model_name=opts.served_model_name,
        # Said explicitly, as the operator's pods say theirs: here each engine takes the
        # machine's GPU when it has one.
        device="auto",
        fleet_secret_file=opts.fleet_secret_file,
        json_args=json_args,
        simulate=opts.simulate,
        user_flags=opts.engine_args,
    )
    name = f"engine-{index}" if role == "both" else role
    threads = opts.threads_per_engine
    env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    child = ChildSpec(name, role, serve_argv(command), f"http://{opts.host}:{port}", env=env)
    return child, json_args["kv-events-config"]["endpoint"]


def threads_per_engine(engines: int, cores: int | None) -> int | None:
    """The machine's cores shared out among the fleet's engines, unless the user set
    OMP_NUM_THREADS (then every engine keeps it)."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (cores or 1) // max(engines, 1))


def write_fleet_secret(directory: Path) -> Path:
    """A fresh fleet secret in a file only this user may read."""
    from pagefleet.common.fleet_auth import generate_fleet_secret

    path = directory / "fleet-secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(generate_fleet_secret())
    return path


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the supervisor dies (no orphans even after SIGKILL)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    def __init__(self, specs: list[ChildSpec], log_dir: Path, out=sys.stdout) -> None:
        self.specs, self.log_dir, self.out = specs, log_dir, out
        self.procs: dict[str, subprocess.Popen] = {}
        self._stopping = False

    def start(self, spec: ChildSpec) -> None:
        spec.log = str(self.log_dir / f"{spec.name}.log")
        log = open(spec.log, "ab")  # noqa: SIM115 - the child owns it from here
        self.procs[spec.name] = subprocess.Popen(
            spec.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **spec.env},
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        log.close()

    def wait_healthy(self, specs: list[ChildSpec], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(specs)
        while pending:
            for spec in list(pending):
                proc = self.procs[spec.name]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{spec.name} exited with status {proc.returncode}; see {spec.log}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{spec.url}/health", timeout=1).status_code == 200:
                        pending.remove(spec)
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise TimeoutError(f"not healthy after {timeout:.0f} s: {names}")
            if pending:
                time.sleep(0.2)

    def up(self, timeout: float = 300.0) -> None:
        engines = [s for s in self.specs if s.role != "router"]
        for spec in engines:
            self.start(spec)
        self.wait_healthy(engines, timeout)
        router = [s for s in self.specs if s.role == "router"]
        for spec in router:
            self.start(spec)
        self.wait_healthy(router, timeout)

    def watch_once(self) -> list[str]:
        """Restart children that died (not while stopping); returns their names."""
        restarted = []
        for spec in self.specs:
            proc = self.procs.get(spec.name)
            if self._stopping or proc is None or proc.poll() is None:
                continue
            print(
                f"pagefleet up: {spec.name} exited with status {proc.returncode} "
                f"(see {spec.log}); restarting",
                file=self.out,
                flush=True,
            )
            self.start(spec)
            restarted.append(spec.name)
        return restarted

    def stop(self, timeout: float = 15.0) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def banner(opts: FleetOptions, specs: list[ChildSpec]) -> str:
    engines = [s for s in specs if s.role != "router"]
    router = next(s for s in specs if s.role == "router")
    counts = {}
    for s in engines:
        counts[s.role] = counts.get(s.role, 0) + 1
    words = {"both": "colocated", "prefill": "prefill", "decode": "decode"}
    summary = ", ".join(f"{n} {words[r]}" for r, n in counts.items())
    summary += " engine(s)" + (" (simulated)" if opts.simulate else "")
    return BANNER.format(
        summary=summary,
        router=router.url,
        model=opts.served_model_name,
        engine_metrics="\n".join(f"  {s.name:<9} {s.url}/metrics" for s in engines),
    )


def add_up_parser(sub) -> None:
    p = sub.add_parser(
        "up",
        help="run a local fleet (engines + router) on 127.0.0.1 with the demo model",
        description=__doc__,
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint dir or GGUF file (default: SmolLM2-135M-Instruct, fetched once)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="the tiny random checkpoint instead (no download)"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: SmolLM2-135M-Instruct for the demo model, "
        "else demo)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address for every process (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port (8000)")
    p.add_argument("--engines", type=int, default=1, help="colocated engines (1)")
    p.add_argument(
        "--disaggregated",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add a prefill and a decode engine (default: on, off with --simulate)",
    )
    p.add_argument("--simulate", action="store_true", help="simulated engines (no weights)")
    p.add_argument("--kv-connector", default="nixl", choices=["nixl", "tcp"])
    p.add_argument(
        "--state-file", default=None, help="write the children (name, role, url, pid) as JSON"
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra `pagefleet serve` argument for every engine (repeat it)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to become healthy")
    p.set_defaults(func=run_up)


def run_up(args: argparse.Namespace) -> int:
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pagefleet.engine.cache import model_to_serve

    model, served_name = model_to_serve(args.model, args.tiny, args.served_model_name)
    disaggregated = args.disaggregated if args.disaggregated is not None else not args.simulate
    secrets_dir = tempfile.TemporaryDirectory(prefix="pagefleet-secret-")
    opts = FleetOptions(
        model=model,
        served_model_name=served_name,
        host=args.host,
        port=args.port,
        engines=args.engines,
        disaggregated=disaggregated,
        simulate=args.simulate,
        connector=args.kv_connector,
        engine_args=["--max-model-len", "1024", "--kv-cache-memory", "0.25", *args.engine_arg],
        fleet_secret_file=str(write_fleet_secret(Path(secrets_dir.name))),
        threads_per_engine=threads_per_engine(
            args.engines + (2 if disaggregated else 0), os.cpu_count()
        ),
    )
    pagefleet = str(Path(sys.executable).parent / "pagefleet")
    if not Path(pagefleet).exists():
        pagefleet = "pagefleet"
    specs = plan_fleet(opts, pagefleet)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with tempfile.TemporaryDirectory(prefix="pagefleet-up-") as logs:
        sup = Supervisor(specs, Path(logs))
        try:
            print(f"pagefleet up: starting {len(specs)} processes (logs in {logs})", flush=True)
            sup.up(args.timeout)
            if args.state_file:
                state = [{**asdict(s), "pid": sup.procs[s.name].pid} for s in specs]
                # Whole or absent: a reader polling for the file never sees half of it.
                partial = Path(f"{args.state_file}.partial")
                partial.write_text(json.dumps(state, indent=2))
                partial.replace(args.state_file)
            print(banner(opts, specs), flush=True)
            while stop["signal"] is None:
                sup.watch_once()
                time.sleep(0.5)
        except (RuntimeError, TimeoutError) as e:
            print(f"pagefleet up: {e}", file=sys.stderr)
            _print_log_tails(specs)
            return 1
        finally:
            sup.stop()
            secrets_dir.cleanup()
            print("pagefleet up: stopped every process", flush=True)
    return 0


def _print_log_tails(specs: list[ChildSpec]) -> None:
    for spec in specs:
        if spec.log and Path(spec.log).exists():
            tail = Path(spec.log).read_text(errors="replace").splitlines()[-5:]
            print(f"--- {spec.name} ({spec.log}):", *tail, sep="\n", file=sys.stderr)
