"""The cluster lab: the API server (api.py), the controller-manager (controllers.py) and the
kubelet (kubelet.py) on one event loop in a thread inside the lab's network namespace (net.py),
plus what tests use to drive it: a kubectl-like client, threads whose sockets live in the lab
namespace, processes started there (the operator), and a clean-up that leaves nothing behind.

    with Lab(tmp_path, claims={"models": ckpt_dir}) as lab:
        lab.kube.create_namespace("serving")
        lab.kube.apply(manifest)
        lab.wait_for(lambda: lab.kube.ready_pods("serving", "app=x"), 60, "pods")
        lab.in_lab(httpx.get, f"http://{ip}:8000/health")

Cluster DNS (dns.py) answers on the node's address, port 53. The API listens on the node's
address: TLS with bearer tokens on API_TLS_PORT (what pods use,
through KUBERNETES_SERVICE_HOST and their projected service-account token), plain HTTP on
API_PORT (what the test and an operator run with `--kubernetes-api` use).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from .api import LabApi, Res, serve
from .controllers import ControllerManager, is_ready
from .dns import DnsServer, records
from .images import project_images
from .kubelet import CREATED_MOUNT_POINTS, SHIM, Kubelet, NodeConfig
from .labels import parse_selector
from .lws import LeaderWorkerSetController
from .net import LabNetwork, enter_netns, leftover_namespaces, other_labs
from .podspec import Image
from .probes import TimeScale

API_PORT = 8080
API_TLS_PORT = 6443
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll until `predicate()` is truthy; its value, or AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def make_certificate(directory: Path, ip: str) -> tuple[Path, Path]:
    """A self-signed certificate for the API server's address (its own CA)."""
    directory.mkdir(parents=True, exist_ok=True)
    key, cert = directory / "apiserver.key", directory / "apiserver.crt"
    san = f"subjectAltName=IP:{ip},DNS:kubernetes.default.svc"
    subprocess.run(
        [
            *(
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
            ),
            *("-nodes", "-days", "2", "-subj", "/CN=kube-apiserver"),
            *("-keyout", str(key), "-out", str(cert), "-addext", san),
            *("-addext", "basicConstraints=critical,CA:TRUE"),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


class Kube:
    """kubectl for tests: thread-safe calls into the API on its own loop."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab

    @property
    def api(self) -> LabApi:
        return self.lab.api

    def res(self, api_version: str, kind: str) -> Res:
        return self.lab.call(self.api.resource_of, api_version, kind)

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        return self.lab.call(self.api.get, self.res(api_version, kind), namespace, name)

    def list(
        self, api_version: str, kind: str, namespace: str | None = None, selector: str = ""
    ) -> list[dict]:
        res = self.res(api_version, kind)
        return self.lab.call(self.api.list, res, namespace, parse_selector(selector))

    def create(self, obj: dict) -> dict:
        res = self.res(obj["apiVersion"], obj["kind"])
        return self.lab.run(self.api.create(res, obj["metadata"].get("namespace"), obj))

    def apply(self, obj: dict) -> dict:
        """Create, or merge-patch what is there (client-side apply without the annotation)."""
        meta = obj["metadata"]
        if self.get(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]) is None:
            return self.create(obj)
        return self.patch(obj, obj)

    def patch(self, obj: dict, patch: dict, subresource: str | None = None) -> dict:
        res = self.res(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        return self.lab.run(
            self.api.patch(res, meta.get("namespace"), meta["name"], patch, subresource)
        )

    def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        propagation: str | None = None,
        grace_s: int | None = None,
    ) -> dict:
        res = self.res(api_version, kind)
        return self.lab.run(self.api.delete(res, namespace, name, propagation, grace_s))

    def history(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> list[dict | None]:
        return self.lab.call(self.api.history, self.res(api_version, kind), namespace, name)

    def create_namespace(self, name: str) -> None:
        if self.get("v1", "Namespace", None, name) is None:
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        self.lab.wait_for(
            lambda: self.get("v1", "ServiceAccount", name, "default"), 10, "default SA"
        )

    def pods(self, namespace: str, selector: str = "") -> list[dict]:
        return self.list("v1", "Pod", namespace, selector)

    def ready_pods(self, namespace: str, selector: str = "") -> list[dict]:
        return [
            p
            for p in self.pods(namespace, selector)
            if is_ready(p) and not p["metadata"].get("deletionTimestamp")
        ]

    def endpoints(self, namespace: str, service: str, port: str | None = None) -> list[str]:
        """`ip:port` of the Service's ready endpoints (port by name; the first if None)."""
        found = self.get("v1", "Endpoints", namespace, service) or {}
        out = []
        for subset in found.get("subsets", []):
            ports = [p for p in subset["ports"] if port is None or p.get("name") == port]
            for address in subset.get("addresses", []):
                out.extend(f"{address['ip']}:{p['port']}" for p in ports[:1])
        return out


class Lab:
    """One node, its API and controllers, inside a network namespace this object creates."""

    def __init__(
        self,
        root: Path,
        *,
        claims: dict[str, str] | None = None,
        host_paths: dict[str, str] | None = None,
        images: dict[str, Image] | None = None,
        time_factor: float = 0.2,
    ) -> None:
        self.root = Path(root)
        self.claims = claims or {}
        self.host_paths = host_paths or {}
        self.images = {**project_images(), **(images or {})}
        self.time = TimeScale(time_factor)
        self.network = LabNetwork(f"pfl{os.getpid()}x{id(self) % 10000}")
        self.kube = Kube(self)
        self.processes: list[subprocess.Popen] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Task] = []
        self._runners: list = []
        self._dns: asyncio.DatagramTransport | None = None
        self._executor = None
        # Set when the lab stops: loops a test left running end with it (the interpreter joins
        # the executor's threads at exit, so one that never ends keeps the test run alive).
        self.closing = threading.Event()
        self.api: LabApi | None = None
        self.kubelet: Kubelet | None = None

    # -- addresses

    @property
    def node_ip(self) -> str:
        return self.network.node_ip

    @property
    def api_url(self) -> str:
        return f"http://{self.node_ip}:{API_PORT}"

    @property
    def ca_file(self) -> Path:
        return self.root / "pki" / "apiserver.crt"

    # -- life cycle

    def __enter__(self) -> Lab:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.network.create()
        key, cert = make_certificate(self.root / "pki", self.node_ip)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve_loop, name="lab-node", daemon=True)
        self._thread.start()
        self.run(self._boot(key, cert))
        self._executor = self.network.executor()

    def _serve_loop(self) -> None:
        enter_netns(self.network.name)  # the API and the kubelet's probes live in the lab
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _boot(self, key: Path, cert: Path) -> None:
        self.api = LabApi()
        await self.api.__aenter__()
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(cert, key)
        self._runners = [
            await serve(self.api, self.node_ip, API_PORT),
            await serve(self.api, self.node_ip, API_TLS_PORT, tls),
        ]
        self._dns, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: DnsServer(self._resolve), local_addr=(self.node_ip, 53)
        )
        for name in ("default", "kube-system"):
            await self.api.create(Res("v1/namespaces"), None, {"metadata": {"name": name}})
        config = NodeConfig(
            name="lab-node",
            node_ip=self.node_ip,
            api_port=API_TLS_PORT,
            ca_pem=cert.read_text(),
            images=self.images,
            claims=self.claims,
            host_paths=self.host_paths,
            state_dir=self.root,
            time=self.time,
        )
        self.kubelet = Kubelet(self.api, self.network, config)
        # LeaderWorkerSet's controller and webhook run as if installed; they act once a test
        # installs its CRD (lws.CRD), as on a cluster where the LWS release is applied.
        leader_worker_sets = LeaderWorkerSetController(self.api)
        self.api.pod_webhooks.append(leader_worker_sets.webhook)
        manager = ControllerManager(
            self.api, config.ca_pem, self.claims, add_ons=[leader_worker_sets.sync]
        )
        self._tasks = [
            asyncio.create_task(manager.run(), name="controller-manager"),
            asyncio.create_task(self.kubelet.run(), name="kubelet"),
        ]

    def _resolve(self, name: str) -> list[str] | None:
        """Cluster DNS: the names of headless Services and their pods."""
        headless = {
            (s["metadata"]["namespace"], s["metadata"]["name"])
            for s in self.api.list(Res("v1/services"))
            if s["spec"].get("clusterIP") == "None"
        }
        return records(self.api.list(Res("v1/endpoints")), headless).get(name)

    async def _shut_down(self) -> None:
        if self._tasks:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kubelet is not None:
            await self.kubelet.shutdown(grace_s=2.0)
        for runner in self._runners:
            await runner.cleanup()
        if self._dns is not None:
            self._dns.close()
        if self.api is not None:
            await self.api.__aexit__(None, None, None)
        # Watches and probes still open end here, before their loop closes.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def stop(self) -> None:
        """Stop every process, namespace, mount and thread the lab made, even after a failure."""
        self.closing.set()
        for proc in self.processes:
            self._kill_process(proc)
        if self.loop is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.run(self._shut_down(), timeout=120)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
            self.loop.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self.network.close()
        self._remove_mount_points()

    def _remove_mount_points(self) -> None:
        """Mount points the labs created on the machine's tree go when the last lab stops: a
        directory removed here would vanish from under another lab's running containers."""
        if other_labs(self.network.prefix) or not CREATED_MOUNT_POINTS.exists():
            return
        paths = {line for line in CREATED_MOUNT_POINTS.read_text().splitlines() if line}
        for path in sorted(paths, key=lambda p: p.count("/"), reverse=True):
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
        kept = sorted(p for p in paths if os.path.lexists(p))  # still busy: the next lab tries
        CREATED_MOUNT_POINTS.write_text("".join(f"{p}\n" for p in kept))

    def leftovers(self) -> list[str]:
        """What the lab should have removed and did not (namespaces; mount points, unless
        another lab still runs)."""
        left = leftover_namespaces(self.network.prefix)
        if CREATED_MOUNT_POINTS.exists() and not other_labs(self.network.prefix):
            paths = CREATED_MOUNT_POINTS.read_text().splitlines()
            left += [p for p in paths if p and os.path.lexists(p)]
        return left

    # -- running things

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run a coroutine on the lab's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn` on the lab's loop thread (the API's state is only touched there)."""

        async def call() -> T:
            return fn(*args)

        return self.run(call())

    def in_lab(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` in a thread inside the lab's network namespace (test clients)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any):
        """As in_lab, without waiting: a Future."""
        return self._executor.submit(fn, *args, **kwargs)

    def wait_for(self, predicate: Callable[[], T], timeout: float, what: str) -> T:
        try:
            return wait_for(predicate, timeout, what)
        except AssertionError:
            print(self.describe())
            raise

    def start_process(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """A process on the node (in the lab's network namespace, as root), e.g. the operator
        run with `--kubernetes-api lab.api_url`. Its output goes to logs/NAME.log.

        Started from the lab's own thread, whichever thread asks: the shim ties a process' life
        to the thread that spawned it (PR_SET_PDEATHSIG), and a caller's thread may end long
        before the lab (the soak's fault thread ends after restarting the operator it killed)."""
        spec = {
            "netns": f"/run/netns/{self.network.name}",
            "hostname": "lab-node",
            "argv": argv,
            "env": {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            "workdir": str(self.root),
            "mounts": [],
        }
        spec_path = self.root / f"{name}.process.json"
        spec_path.write_text(json.dumps(spec))
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)

        def spawn() -> subprocess.Popen:
            with open(log, "ab") as out:
                return subprocess.Popen(
                    [sys.executable, str(SHIM), str(spec_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )

        proc = self.call(spawn)
        self.processes.append(proc)
        return proc

    @staticmethod
    def _stop_process(proc: subprocess.Popen, grace_s: float = 10) -> int:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        return proc.returncode

    @staticmethod
    def _kill_process(proc: subprocess.Popen) -> None:
        """SIGKILL a node process' whole group at the lab's end. A test that means to see a
        process stop gracefully says so with stop_process (SIGTERM first); here nothing is
        asserted any more, and the operator's graceful exit alone took ~5 s per test."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the shim made it a group (setsid)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # not yet in a group of its own: the shim itself
        proc.wait()

    def stop_process(self, proc: subprocess.Popen, grace_s: float = 10) -> int:
        code = self._stop_process(proc, grace_s)
        self.processes.remove(proc)
        return code

    def exec(
        self, pod: dict, argv: list[str], container: str | None = None, timeout: float = 60
    ) -> tuple[int, str]:
        """`kubectl exec POD -- ARGV`: (exit code, output)."""
        worker = self.kubelet.workers[pod["metadata"]["uid"]]
        name = container or pod["spec"]["containers"][0]["name"]
        return self.run(worker.exec(name, argv, timeout), timeout + 10)

    # -- looking

    def log(self, name: str) -> str:
        """A container's log (`namespace_pod_container`) or a process' (`name`)."""
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def pod_log(self, pod: dict, container: str | None = None) -> str:
        meta = pod["metadata"]
        container = container or pod["spec"]["containers"][0]["name"]
        return self.log(f"{meta['namespace']}_{meta['name']}_{container}")

    def describe(self, tail: int = 15) -> str:
        """Pods, their states and the ends of their logs (printed when a wait times out)."""
        lines = []
        for pod in self.call(self.api.list, Res("v1/pods")):
            meta, status = pod["metadata"], pod.get("status") or {}
            states = [
                f"{c['name']}: {json.dumps(c['state'])[:200]} restarts={c['restartCount']}"
                f" ready={c['ready']}"
                for c in status.get("containerStatuses", [])
            ]
            lines.append(f"pod {meta['namespace']}/{meta['name']} {status.get('podIP')} {states}")
            for container in pod["spec"].get("containers", []):
                text = self.pod_log(pod, container["name"]).splitlines()[-tail:]
                lines.extend(f"    | {line}" for line in text)
        for path in sorted((self.root / "logs").glob("*.log")):
            if ".process" in path.name or not path.name.count("_"):
                lines.append(f"process {path.stem}:")
                lines.extend(
                    f"    | {line}"
                    for line in path.read_text(errors="replace").splitlines()[-tail:]
                )
        return "\n".join(lines)
