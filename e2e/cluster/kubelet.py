"""The lab's kubelet: runs every pod of the API on this machine, from its spec.

Per pod: a network namespace with its own IP on the lab bridge (net.py) and the pod's safe
sysctls applied to it, its volumes (emptyDir,
Memory emptyDir as a tmpfs, configMap, secret, projected service-account token and CA, downward
API, persistentVolumeClaim and hostPath mapped to directories the test gives), /etc/hosts and,
for dnsPolicy ClusterFirst, an /etc/resolv.conf naming the lab's cluster DNS (dns.py), init
containers to completion, then each container as a real process through shim.py (own mount and
UTS namespace, the spec's user, read-only root where asked). Probes (startup, readiness,
liveness) from the node as the spec states them, restarts with back-off (restartCount), and on
deletion SIGTERM, then SIGKILL after the grace period (and to whatever is left in the pod's
network namespace, as removing its cgroup would). Pod status (phase, podIP, conditions,
container statuses with each ended container's termination message) is written back through the
status subresource.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import kmock

from .api import LabApi, Res
from .dns import hosts_file, pod_hostname, resolv_conf
from .net import LabNetwork, kill_processes
from .podspec import (
    ConfigError,
    Image,
    container_argv,
    container_env,
    field_value,
    process_env,
    secret_data,
    service_env,
)
from .probes import Thresholds, TimeScale, check, within

log = logging.getLogger("cluster.kubelet")

PODS = Res("v1/pods")
# The kubelet's default safe sysctls (namespaced to the pod's network namespace); any other is
# refused unless the kubelet allows it (--allowed-unsafe-sysctls), which the lab's does not.
SAFE_SYSCTLS = frozenset(
    {
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.ping_group_range",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SHIM = Path(__file__).with_name("shim.py")
BACKOFF_S, BACKOFF_MAX_S = 10.0, 300.0
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Mount points shims created on the machine's tree, by every lab on this machine.
CREATED_MOUNT_POINTS = Path("/run/pagefleet-lab/created-mount-points")
# The kubelet's limits on a termination message (pkg/kubelet/container): the file's last 4096
# bytes; with FallbackToLogsOnError and an empty file, the log's last 80 lines, 2048 bytes at most.
TERMINATION_MESSAGE_BYTES = 4096
TERMINATION_LOG_LINES, TERMINATION_LOG_BYTES = 80, 2048


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def repository(image: str) -> str:
    """`registry/name:tag@digest` -> `registry/name`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def termination_message(written: bytes, log_tail: str, policy: str | None, exit_code: int) -> str:
    """What `state.terminated.message` says, as the kubelet reads it: the termination-message
    file's end; when that is empty and the container failed under FallbackToLogsOnError, the
    end of this run's log."""
    if written:
        return written[-TERMINATION_MESSAGE_BYTES:].decode(errors="replace")
    if policy != "FallbackToLogsOnError" or exit_code == 0:
        return ""
    lines = log_tail.splitlines(keepends=True)[-TERMINATION_LOG_LINES:]
    return "".join(lines).encode()[-TERMINATION_LOG_BYTES:].decode(errors="replace")


def tmpfs_size(limit: str | None) -> str:
    """A Kubernetes quantity (2Gi, 64Mi) as a tmpfs size option."""
    if not limit:
        return "50%"
    for suffix, unit in (("Gi", "g"), ("Mi", "m"), ("Ki", "k"), ("G", "g"), ("M", "m")):
        if limit.endswith(suffix):
            return limit[: -len(suffix)] + unit
    return limit


@dataclass
class NodeConfig:
    """What the node offers its pods."""

    name: str
    node_ip: str
    api_port: int  # the API server's TLS port, as the `kubernetes` Service
    ca_pem: str
    images: dict[str, Image]  # by repository (no tag)
    claims: dict[str, str]  # PersistentVolumeClaim name -> host directory
    host_paths: dict[str, str]  # hostPath path -> host directory
    state_dir: Path
    time: TimeScale = field(default_factory=TimeScale)


@dataclass
class ContainerState:
    """A container's status fields, as containerStatuses reports them."""

    name: str
    image: str
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    container_id: str = ""

    def status(self) -> dict:
        out = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out


class Kubelet:
    def __init__(self, api: LabApi, network: LabNetwork, config: NodeConfig) -> None:
        self.api, self.network, self.config = api, network, config
        self.workers: dict[str, PodWorker] = {}
        self.tmpfs_mounts: set[Path] = set()

    async def run(self) -> None:
        listener = self.api.listen()
        while True:
            listener.clear()
            self.sync()
            with contextlib.suppress(TimeoutError):
                await within(listener.wait(), 1.0)

    def sync(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.api.list(PODS)}
        for uid, pod in pods.items():
            worker = self.workers.get(uid)
            if worker is None:
                worker = self.workers[uid] = PodWorker(self, pod)
                worker.start()
            worker.observe(pod)
        for uid, worker in list(self.workers.items()):
            if uid not in pods:
                worker.terminate(0)  # deleted from the API by force

    async def shutdown(self, grace_s: float) -> None:
        for worker in list(self.workers.values()):
            worker.terminate(grace_s)
        tasks = [w.task for w in self.workers.values() if w.task]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s + 30)


class PodWorker:
    """One pod's life on the node."""

    def __init__(self, kubelet: Kubelet, pod: dict) -> None:
        self.kubelet, self.api, self.config = kubelet, kubelet.api, kubelet.config
        self.pod = pod
        meta = pod["metadata"]
        self.uid, self.ns, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.dir = self.config.state_dir / "pods" / f"{self.ns}_{self.name}"
        self.ip: str | None = None
        self.netns: str | None = None
        self.stopping = asyncio.Event()
        self.grace_s = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        spec = pod["spec"]
        self.init_states = [
            ContainerState(c["name"], c["image"]) for c in spec.get("initContainers", [])
        ]
        self.states = [ContainerState(c["name"], c["image"]) for c in spec["containers"]]
        self.initialized = not self.init_states
        self.exited = False
        self.transitions: dict[str, tuple[str, str]] = {}
        self.task: asyncio.Task | None = None
        self._publishing: asyncio.Task | None = None
        self._dirty = False
        self.volumes: dict[str, tuple[str, bool]] | None = None  # once mounted

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run(), name=f"pod {self.name}")

    def observe(self, pod: dict) -> None:
        self.pod = pod
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            self.terminate(float(meta.get("deletionGracePeriodSeconds", self.grace_s)))

    def terminate(self, grace_s: float) -> None:
        self.grace_s = min(self.grace_s, grace_s) if self.stopping.is_set() else grace_s
        self.stopping.set()

    # -- life cycle

    async def run(self) -> None:
        runners: list[ContainerRunner] = []
        try:
            await self._bind()
            self.netns, self.ip = await asyncio.to_thread(self.kubelet.network.add_pod, self.uid)
            self.changed()
            if not await self._apply_sysctls():
                return
            volumes = self.volumes = await self._mount_volumes()
            if volumes is None:
                return
            spec = self.pod["spec"]
            for i, container in enumerate(spec.get("initContainers", [])):
                runner = ContainerRunner(self, container, self.init_states[i], volumes, init=True)
                if not await runner.run_to_completion():
                    return
            self.initialized = True
            self.changed()
            runners = [
                ContainerRunner(self, c, self.states[i], volumes)
                for i, c in enumerate(spec["containers"])
            ]
            tasks = [asyncio.create_task(r.run()) for r in runners]
            stop = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait([stop, asyncio.gather(*tasks)], return_when=asyncio.FIRST_COMPLETED)
            if not stop.done():  # every container ended for good: the pod stays until deleted
                self.exited = True
                self.changed()
                await stop
            await asyncio.gather(*tasks, return_exceptions=True)
        except Exception:
            log.exception("pod %s/%s failed in the kubelet", self.ns, self.name)
            raise
        finally:
            await self._tear_down()

    async def _apply_sysctls(self) -> bool:
        """The pod's sysctls in its network namespace; False (the pod waits to be deleted, as
        SysctlForbidden leaves it) when one is not safe."""
        sysctls = (self.pod["spec"].get("securityContext") or {}).get("sysctls") or []
        forbidden = sorted(s["name"] for s in sysctls if s["name"] not in SAFE_SYSCTLS)
        if forbidden:
            self._waiting_all("SysctlForbidden", f"forbidden sysctl: {', '.join(forbidden)}")
            await self.stopping.wait()
            return False
        for sysctl in sysctls:
            await asyncio.to_thread(
                subprocess.run,
                [
                    "ip",
                    "netns",
                    "exec",
                    self.netns,
                    "sysctl",
                    "-qw",
                    f"{sysctl['name']}={sysctl['value']}",
                ],
                check=True,
                capture_output=True,
            )
        return True

    def name_files(self) -> list[dict]:
        """The mounts of /etc/hosts and, under dnsPolicy ClusterFirst, /etc/resolv.conf."""
        self.dir.mkdir(parents=True, exist_ok=True)
        hosts = self.dir / "etc-hosts"
        hosts.write_text(hosts_file(self.pod, self.ip))
        mounts = [{"source": str(hosts), "target": "/etc/hosts", "read_only": False}]
        if self.pod["spec"].get("dnsPolicy", "ClusterFirst") in {
            "ClusterFirst",
            "ClusterFirstWithHostNet",
        }:
            resolv = self.dir / "etc-resolv.conf"
            resolv.write_text(resolv_conf(self.ns, self.config.node_ip))
            mounts.append({"source": str(resolv), "target": "/etc/resolv.conf", "read_only": True})
        return mounts

    async def _bind(self) -> None:
        """The scheduler's job in the lab: every pod goes to the one node."""

        def bind(old: dict) -> dict:
            old["spec"]["nodeName"] = self.config.name
            return old

        self.pod = await self.api.update(PODS, self.ns, self.name, bind)

    async def _tear_down(self) -> None:
        # The containers' last states are written before the pod goes (tests read them).
        if self._publishing is not None:
            await asyncio.gather(self._publishing, return_exceptions=True)
        if self._dirty:
            await self._publish()
        if self.netns is not None:
            await asyncio.to_thread(kill_processes, self.netns)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.kubelet.network.remove_pod, self.uid)
        for mount in sorted(self.kubelet.tmpfs_mounts):
            if mount.is_relative_to(self.dir):
                await asyncio.to_thread(subprocess.run, ["umount", "-l", str(mount)], check=False)
                self.kubelet.tmpfs_mounts.discard(mount)
        with contextlib.suppress(kmock.KubernetesError):
            await self.api.delete(PODS, self.ns, self.name, grace_s=0)
        self.kubelet.workers.pop(self.uid, None)

    # -- volumes

    async def _mount_volumes(self) -> dict[str, tuple[str, bool]] | None:
        """Each volume's host directory (and whether it is read-only by nature); retried
        while something it needs is missing, as FailedMount is on a cluster."""
        delay = self.config.time.s(2)
        while not self.stopping.is_set():
            try:
                return {
                    v["name"]: await self._volume(v) for v in self.pod["spec"].get("volumes", [])
                }
            except ConfigError as e:
                self._waiting_all("ContainerCreating", f"FailedMount: {e}")
                with contextlib.suppress(TimeoutError):
                    await within(self.stopping.wait(), delay)
        return None

    async def _volume(self, volume: dict) -> tuple[str, bool]:
        name = volume["name"]
        path = self.dir / "volumes" / name
        if "emptyDir" in volume:
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
            fs_group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
            if fs_group is not None:  # SetVolumeOwnership: root-owned, the group's, setgid
                os.chown(path, -1, fs_group)
                path.chmod(0o2777)
            if (
                volume["emptyDir"].get("medium") == "Memory"
                and path not in self.kubelet.tmpfs_mounts
            ):
                size = tmpfs_size(volume["emptyDir"].get("sizeLimit"))
                await asyncio.to_thread(
                    subprocess.run,
                    ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)],
                    check=True,
                )
                self.kubelet.tmpfs_mounts.add(path)
            return str(path), False
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            found = self.api.get(Res("v1/persistentvolumeclaims"), self.ns, claim)
            if found is None or claim not in self.config.claims:
                raise ConfigError(f'persistentvolumeclaim "{claim}" not found or not bound')
            return self.config.claims[claim], bool(volume["persistentVolumeClaim"].get("readOnly"))
        if "hostPath" in volume:
            wanted = volume["hostPath"]["path"]
            if wanted not in self.config.host_paths:
                raise ConfigError(f"hostPath {wanted} is not a directory the lab offers")
            return self.config.host_paths[wanted], False
        files = self._files(volume)
        if files is None:
            raise ConfigError(f"the sources of volume {name!r} are missing")
        path.mkdir(parents=True, exist_ok=True)
        fs_group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        for rel, (content, mode) in files.items():
            target = path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            if fs_group is not None:  # SetVolumeOwnership: the group's, group-readable
                os.chown(target, -1, fs_group)
                mode |= 0o440
            target.chmod(mode)
        return str(path), True

    def _lookup(self, kind: str, name: str) -> dict[str, str] | None:
        res = Res("v1/configmaps") if kind == "ConfigMap" else Res("v1/secrets")
        found = self.api.get(res, self.ns, name)
        if found is None:
            return None
        return found.get("data") or {} if kind == "ConfigMap" else secret_data(found)

    def _files(self, volume: dict) -> dict[str, tuple[str, int]] | None:
        """configMap, secret, downwardAPI and projected volumes: relative path -> content."""
        sources = (volume.get("projected") or {}).get("sources") or [volume]
        mode = (
            volume.get("projected") or volume.get("configMap") or volume.get("secret") or {}
        ).get("defaultMode", 0o644)
        files: dict[str, tuple[str, int]] = {}
        for source in sources:
            if "serviceAccountToken" in source:
                account = self.pod["spec"].get("serviceAccountName", "default")
                token = f"lab-token.{self.ns}.{account}.{self.uid}"
                files[source["serviceAccountToken"].get("path", "token")] = (token, mode)
            elif "downwardAPI" in source:
                for item in source["downwardAPI"].get("items", []):
                    value = field_value(self.pod, item["fieldRef"]["fieldPath"])
                    files[item["path"]] = (value, item.get("mode", mode))
            else:
                kind, ref = (
                    ("ConfigMap", source["configMap"])
                    if "configMap" in source
                    else ("Secret", source["secret"])
                )
                data = self._lookup(kind, ref.get("name") or ref.get("secretName"))
                if data is None:
                    if ref.get("optional"):
                        continue
                    return None
                items = ref.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    if item["key"] in data:
                        files[item["path"]] = (data[item["key"]], item.get("mode", mode))
        return files

    async def exec(self, container: str, argv: list[str], timeout: float) -> tuple[int, str]:
        """`kubectl exec`: `argv` in the container's namespaces, mounts, user and environment;
        (exit code, output). Killed at the timeout."""
        if self.volumes is None:
            raise ConfigError(f"pod {self.name} has no running containers yet")
        found = next(c for c in self.pod["spec"]["containers"] if c["name"] == container)
        spec = {**self.launch(found, self.volumes), "argv": argv}
        spec_path = self.dir / f"{container}.exec.json"
        spec_path.write_text(json.dumps(spec))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SHIM),
            str(spec_path),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            out, _ = await within(proc.communicate(), timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the shim made it a group of its own
            await proc.wait()
        return proc.returncode, out.decode(errors="replace")

    # -- status

    def changed(self) -> None:
        """Something in the pod's status moved: write it soon (coalesced)."""
        self._dirty = True
        if self._publishing is None or self._publishing.done():
            self._publishing = asyncio.get_running_loop().create_task(self._publish())

    async def _publish(self) -> None:
        while self._dirty:
            self._dirty = False
            status = self.status()

            def write(old: dict, status: dict = status) -> dict:
                return {**old, "status": status}

            with contextlib.suppress(kmock.KubernetesError):
                await self.api.update(PODS, self.ns, self.name, write, "status")

    def _condition(self, kind: str, true: bool) -> dict:
        value = "True" if true else "False"
        if self.transitions.get(kind, ("", ""))[0] != value:
            self.transitions[kind] = (value, now_iso())
        return {"type": kind, "status": value, "lastTransitionTime": self.transitions[kind][1]}

    def phase(self) -> str:
        """Running once a container runs; Succeeded / Failed when every container has ended
        for good (restartPolicy Never or OnFailure); Pending before."""
        if any("running" in s.state for s in self.states):
            return "Running"
        if self.exited and all("terminated" in s.state for s in self.states):
            codes = [s.state["terminated"]["exitCode"] for s in self.states]
            return "Succeeded" if not any(codes) else "Failed"
        return "Pending"

    def status(self) -> dict:
        containers_ready = all(s.ready for s in self.states)
        status = {
            "phase": self.phase(),
            "hostIP": self.config.node_ip,
            "hostIPs": [{"ip": self.config.node_ip}],
            "qosClass": "BestEffort",
            "conditions": [
                self._condition("PodScheduled", True),
                self._condition("PodReadyToStartContainers", self.ip is not None),
                self._condition("Initialized", self.initialized),
                self._condition("ContainersReady", containers_ready),
                self._condition("Ready", containers_ready),
            ],
            "containerStatuses": [s.status() for s in self.states],
        }
        if self.init_states:
            status["initContainerStatuses"] = [s.status() for s in self.init_states]
        if self.ip:
            status.update(
                podIP=self.ip,
                podIPs=[{"ip": self.ip}],
                startTime=self.transitions.get("PodScheduled", ("", now_iso()))[1],
            )
        return status

    def _waiting_all(self, reason: str, message: str) -> None:
        for s in [*self.init_states, *self.states]:
            s.state = {"waiting": {"reason": reason, "message": message}}
        self.changed()

    # -- what a container runs

    def launch(
        self,
        container: dict,
        volumes: dict[str, tuple[str, bool]],
        termination_file: Path | None = None,
    ) -> dict:
        """The shim's spec for `container`; ConfigError when it cannot be created yet.
        `termination_file` (this run's, on the node) is mounted at terminationMessagePath."""
        image = self.config.images.get(repository(container["image"]))
        if image is None:
            raise ConfigError(f"ErrImagePull: the lab has no image {container['image']!r}")
        pod_spec = self.pod["spec"]
        # The kubelet knows its pod's address before the API does.
        addresses = {"podIP": self.ip, "podIPs": [{"ip": self.ip}], "hostIP": self.config.node_ip}
        pod = {**self.pod, "status": {**(self.pod.get("status") or {}), **addresses}}
        env = container_env(
            pod,
            container,
            service_env(self.config.node_ip, self.config.api_port),
            self._lookup,
        )
        argv = container_argv(container, image, env)
        pod_ctx = pod_spec.get("securityContext") or {}
        ctx = {**pod_ctx, **(container.get("securityContext") or {})}
        uid = ctx.get("runAsUser", image.user[0])
        gid = ctx.get("runAsGroup", image.user[1] if "runAsUser" not in ctx else 0)
        if ctx.get("runAsNonRoot") and uid == 0:
            raise ConfigError("container has runAsNonRoot and image will run as root")
        groups = sorted(
            {
                gid,
                *pod_ctx.get("supplementalGroups", []),
                *([pod_ctx["fsGroup"]] if "fsGroup" in pod_ctx else []),
            }
        )
        mounts = [
            {"source": host, "target": path, "read_only": True}
            for path, host in image.files.items()
        ]
        for m in container.get("volumeMounts", []):
            host, read_only = volumes[m["name"]]
            source = Path(host) / m["subPath"] if m.get("subPath") else Path(host)
            mounts.append(
                {
                    "source": str(source),
                    "target": m["mountPath"],
                    "read_only": read_only or bool(m.get("readOnly")),
                }
            )
        target = container.get("terminationMessagePath")
        if termination_file is not None and target:
            mounts.append({"source": str(termination_file), "target": target, "read_only": False})
        mounts.extend(self.name_files())
        return {
            "netns": f"/run/netns/{self.netns}",
            "hostname": pod_hostname(self.pod),
            "argv": argv,
            "env": process_env(image, env),
            "workdir": container.get("workingDir") or image.workdir,
            "uid": uid,
            "gid": gid,
            "groups": groups,
            "read_only_root": bool(ctx.get("readOnlyRootFilesystem")),
            "mounts": mounts,
            "expose": list(image.expose),
            "created_log": str(CREATED_MOUNT_POINTS),
        }


class ContainerRunner:
    """One container: start, probe, restart with back-off, stop."""

    def __init__(
        self,
        worker: PodWorker,
        container: dict,
        state: ContainerState,
        volumes: dict[str, tuple[str, bool]],
        init: bool = False,
    ) -> None:
        self.worker, self.container, self.state = worker, container, state
        self.volumes, self.init = volumes, init
        self.time = worker.config.time
        self.proc: asyncio.subprocess.Process | None = None
        name = f"{worker.ns}_{worker.name}_{container['name']}"
        self.log_path = worker.config.state_dir / "logs" / f"{name}.log"
        self.log_offset = 0  # where this run's output starts in the log
        self.termination_file: Path | None = None

    async def _sleep_or_stop(self, seconds: float) -> bool:
        """Sleep; True if the pod is stopping meanwhile."""
        try:
            await within(self.worker.stopping.wait(), seconds)
            return True
        except TimeoutError:
            return False

    def _backoff(self) -> float:
        n = self.state.restart_count
        return 0.0 if n <= 1 else self.time.s(min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (n - 2)))

    async def _start(self) -> asyncio.subprocess.Process | None:
        """Start the process; None (with the waiting reason set) when it cannot be created."""
        try:
            termination_file = self._new_termination_file()
            spec = self.worker.launch(self.container, self.volumes, termination_file)
        except ConfigError as e:
            reason = "ErrImagePull" if "ErrImagePull" in str(e) else "CreateContainerConfigError"
            self.state.state = {"waiting": {"reason": reason, "message": str(e)}}
            self.worker.changed()
            return None
        CREATED_MOUNT_POINTS.parent.mkdir(parents=True, exist_ok=True)
        spec_path = self.worker.dir / f"{self.container['name']}.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"--- start {now_iso()} (restart {self.state.restart_count})\n".encode())
            out.flush()
            self.log_offset = out.tell()
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(SHIM),
                str(spec_path),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.termination_file = termination_file
        self.state.container_id = f"lab://{proc.pid}"
        self.state.state = {"running": {"startedAt": now_iso()}}
        self.worker.changed()
        return proc

    def _new_termination_file(self) -> Path:
        """A fresh, empty file per run (as the kubelet makes one per container instance),
        writable by any user the container runs as."""
        run = self.state.restart_count
        path = self.worker.dir / "termination" / f"{self.container['name']}.{run}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        path.chmod(0o666)
        return path

    def _message(self, code: int) -> str:
        written = b""
        if self.termination_file is not None:
            with contextlib.suppress(OSError):
                written = self.termination_file.read_bytes()
        log_tail = ""
        with contextlib.suppress(OSError), open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            log_tail = log.read().decode(errors="replace")
        policy = self.container.get("terminationMessagePolicy")
        return termination_message(written, log_tail, policy, code)

    def _exited(self, code: int, started: dict, reason: str | None = None) -> None:
        code = 128 - code if code < 0 else code
        terminated = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": (started.get("running") or {}).get("startedAt", now_iso()),
            "finishedAt": now_iso(),
            "containerID": self.state.container_id,
        }
        message = self._message(code)
        if message:
            terminated["message"] = message
        self.state.last_state = {"terminated": terminated}
        self.state.state = {"terminated": terminated}
        self.state.ready = False
        self.state.started = False
        self.worker.changed()

    async def kill(self, grace_s: float) -> int:
        """SIGTERM, then SIGKILL to the whole container after `grace_s` (already scaled)."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return proc.returncode if proc else 0
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await within(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the main process left behind
        return proc.returncode

    async def run_to_completion(self) -> bool:
        """An init container: run until it exits 0 (restarting on failure); False if the pod
        stops first."""
        while True:
            proc = await self._start()
            if proc is not None:
                self.proc = proc
                started = self.state.state
                stop = asyncio.create_task(self.worker.stopping.wait())
                done, _ = await asyncio.wait(
                    {asyncio.ensure_future(proc.wait()), stop}, return_when=asyncio.FIRST_COMPLETED
                )
                if stop in done:
                    await self.kill(self.time.s(self.worker.grace_s))
                    return False
                stop.cancel()
                self._exited(proc.returncode, started)
                if proc.returncode == 0:
                    return True
                self.state.restart_count += 1
            if await self._sleep_or_stop(self._backoff() or self.time.s(BACKOFF_S)):
                return False

    async def run(self) -> None:
        """A regular container, until the pod stops."""
        while not self.worker.stopping.is_set():
            proc = await self._start()
            if proc is not None:
                self.proc = proc
                started = self.state.state
                outcome = await self._supervise(proc)
                if outcome == "stopped":
                    code = await self.kill(self.time.s(self.worker.grace_s))
                    self._exited(code, started)
                    return
                if outcome in {"liveness", "startup"}:
                    probe = self.container.get(f"{outcome}Probe") or {}
                    grace = probe.get("terminationGracePeriodSeconds", self.worker.grace_s)
                    code = await self.kill(self.time.s(grace))
                else:
                    code = proc.returncode
                self._exited(code, started)
                policy = self.worker.pod["spec"].get("restartPolicy", "Always")
                if policy == "Never" or (policy == "OnFailure" and code == 0):
                    self.worker.changed()
                    return
                self.state.restart_count += 1
                self.worker.changed()
            if await self._sleep_or_stop(
                self._backoff() if proc is not None else self.time.s(BACKOFF_S)
            ):
                return

    async def _supervise(self, proc: asyncio.subprocess.Process) -> str:
        """Probe the running container; returns why it ends: exited, liveness, startup,
        stopped."""
        exited = asyncio.ensure_future(proc.wait())
        stop = asyncio.ensure_future(self.worker.stopping.wait())
        probing = asyncio.ensure_future(self._probe())
        try:
            done, _ = await asyncio.wait(
                {exited, stop, probing}, return_when=asyncio.FIRST_COMPLETED
            )
            if stop in done:
                return "stopped"
            if exited in done:
                return "exited"
            return probing.result()
        finally:
            for task in (exited, stop, probing):
                task.cancel()
            await asyncio.gather(exited, stop, probing, return_exceptions=True)
            self.state.ready = False

    async def _probe(self) -> str:
        """Startup probe first; then readiness and liveness together. Returns only when a probe
        says the container must be restarted ("startup" or "liveness")."""
        c = self.container
        if c.get("startupProbe") and not await self._probe_until("startup", c["startupProbe"]):
            return "startup"
        self.state.started = True
        self.worker.changed()
        readiness = asyncio.ensure_future(self._readiness(c.get("readinessProbe")))
        try:
            if c.get("livenessProbe"):
                await self._probe_until("liveness", c["livenessProbe"], stop_on_success=False)
                return "liveness"
            await asyncio.Future()  # no liveness probe: only the process' exit ends it
        finally:
            readiness.cancel()
            await asyncio.wait([readiness], timeout=1)
        return "liveness"

    async def _probe_until(self, kind: str, probe: dict, stop_on_success: bool = True) -> bool:
        """Probe every period; True at the first verdict of success (startup), False when the
        failure threshold is reached."""
        thresholds = Thresholds.of(probe)
        await asyncio.sleep(self.time.s(probe.get("initialDelaySeconds", 0)))
        while True:
            ok = await self._check(probe)
            verdict = thresholds.record(ok)
            if verdict is False:
                log.info("%s probe of %s/%s failed", kind, self.worker.name, self.container["name"])
                return False
            if verdict and stop_on_success:
                return True
            await asyncio.sleep(self.time.s(probe.get("periodSeconds", 10)))

    async def _readiness(self, probe: dict | None) -> None:
        if probe is None:
            self.state.ready = True
            self.worker.changed()
            return
        thresholds = Thresholds.of(probe)
        await asyncio.sleep(self.time.s(probe.get("initialDelaySeconds", 0)))
        while True:
            ready = bool(thresholds.record(await self._check(probe)))
            if ready != self.state.ready:
                self.state.ready = ready
                self.worker.changed()
            await asyncio.sleep(self.time.s(probe.get("periodSeconds", 10)))

    async def _check(self, probe: dict) -> bool:
        timeout = self.time.s(probe.get("timeoutSeconds", 1))
        return await check(probe, self.container, self.worker.ip, timeout)
