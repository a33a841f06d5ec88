"""The lab's network: one network namespace for the whole lab (the "node", holding a bridge and
the API server), one more per pod joined to that bridge by a veth pair. Nothing connects to the
machine's own namespace, so no packet of the lab can leave it.

Threads enter the lab namespace with `enter_netns` (setns(2) moves only the calling thread);
child processes enter a pod's namespace themselves (see shim.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
SUBNET = ipaddress.IPv4Network("10.88.0.0/16")
BRIDGE = "lab0"


def ip(*args: str) -> None:
    """Run `ip ARGS`; a failure raises with ip's own message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def setns(path: Path | str, nstype: int = CLONE_NEWNET) -> None:
    """Move the calling thread into the namespace at `path`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, nstype) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def enter_netns(name: str) -> None:
    """Thread initializer: this thread's sockets live in network namespace `name`."""
    setns(NETNS_DIR / name)


@dataclass
class LabNetwork:
    """The lab namespace with its bridge (the node's address is the subnet's first host) and a
    namespace per pod; `close()` removes every namespace it made (veths go with them)."""

    prefix: str
    node_ip: str = str(SUBNET.network_address + 1)
    pod_netns: dict[str, str] = field(default_factory=dict)  # pod uid -> netns name
    _next_host: int = 2
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return f"{self.prefix}-node"

    def create(self) -> None:
        ip("netns", "add", self.name)
        ip("-n", self.name, "link", "set", "lo", "up")
        ip("-n", self.name, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", self.name, "addr", "add", f"{self.node_ip}/{SUBNET.prefixlen}", "dev", BRIDGE)
        ip("-n", self.name, "link", "set", BRIDGE, "up")

    def _allocate(self) -> tuple[int, str]:
        # Addresses are not reused within a lab: a replaced pod never inherits an old pod's IP.
        with self._lock:
            n = self._next_host
            self._next_host += 1
        if n >= SUBNET.num_addresses - 1:
            raise OSError("the lab's pod subnet is exhausted")
        return n, str(SUBNET.network_address + n)

    def add_pod(self, uid: str) -> tuple[str, str]:
        """A fresh namespace on the bridge for pod `uid`; returns (netns name, pod IP)."""
        n, address = self._allocate()
        netns = f"{self.prefix}-p{n}"
        veth = f"lv{os.getpid() % 10000}x{n}"[:15]
        ip("netns", "add", netns)
        with self._lock:
            self.pod_netns[uid] = netns
        ip("-n", netns, "link", "set", "lo", "up")
        ip(
            "-n",
            self.name,
            "link",
            "add",
            veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            netns,
        )
        ip("-n", self.name, "link", "set", veth, "master", BRIDGE, "up")
        ip("-n", netns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "route", "add", "default", "via", self.node_ip)
        return netns, address

    def remove_pod(self, uid: str) -> None:
        with self._lock:
            netns = self.pod_netns.pop(uid, None)
        if netns:
            ip("netns", "del", netns)  # its veth pair goes with it

    def close(self) -> None:
        for uid in list(self.pod_netns):
            with contextlib.suppress(OSError):
                self.remove_pod(uid)
        if (NETNS_DIR / self.name).exists():
            ip("netns", "del", self.name)

    def executor(self, workers: int = 32) -> ThreadPoolExecutor:
        """Threads whose sockets live in the lab namespace (test clients, probes)."""
        return ThreadPoolExecutor(
            workers, "lab-net", initializer=enter_netns, initargs=(self.name,)
        )


def kill_processes(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in network namespace `netns` and wait until they are gone: what
    removing a pod's cgroup does to processes that left their container's process group (Ray's
    workers, daemons)."""
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    pids = [int(pid) for pid in done.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(running(pid) for pid in pids):
        time.sleep(0.05)


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no resources; its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def leftover_namespaces(prefix: str) -> list[str]:
    """Named namespaces of a lab that are still there (tests check there are none)."""
    if not NETNS_DIR.exists():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(f"{prefix}-"))


def other_labs(prefix: str) -> list[str]:
    """Namespaces of other labs whose process still runs (names are pfl<pid>x<n>-...)."""
    if not NETNS_DIR.exists():
        return []
    others = []
    for path in NETNS_DIR.iterdir():
        m = re.match(r"pfl(\d+)x", path.name)
        if m and not path.name.startswith(f"{prefix}-") and Path(f"/proc/{m[1]}").exists():
            others.append(path.name)
    return sorted(others)
