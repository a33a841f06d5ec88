"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it: a
pure decision (acquire, renew or wait) from the Lease as read, and a thin shell that reads and
writes the Lease through the operator's KubeClient (resourceVersion guards every replace) and
runs the operator only while this process holds the Lease."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import logging
import os
import random
import signal
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp.web

from pagefleet.operator.handlers import ApiError, KubeClient

log = logging.getLogger("pagefleet.operator.leader")
T = TypeVar("T")

LEASE_API = "coordination.k8s.io/v1"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
JITTER = 1.2  # client-go's JitterFactor: followers' retries spread out, never in step


@dataclass(frozen=True)
class Timing:
    """client-go's defaults (as kube-controller-manager runs them): a follower takes over a
    Lease nobody renewed for `lease_duration`; a leader that could not renew for
    `renew_deadline` stops, before any follower can take over; everyone retries every
    `retry_period`."""

    lease_duration: int = 15  # whole seconds: the Lease stores leaseDurationSeconds
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.lease_duration > self.renew_deadline > JITTER * self.retry_period > 0:
            raise ValueError(
                "leader election needs lease duration > renew deadline > "
                f"{JITTER} x retry period > 0 (got {self.lease_duration}, "
                f"{self.renew_deadline}, {self.retry_period})"
            )


@dataclass(frozen=True)
class Record:
    """What the election reads and writes in a Lease's spec (client-go's LeaderElectionRecord).
    An empty holder is a released Lease."""

    holder: str
    lease_duration: int
    acquire_time: str | None
    renew_time: str | None
    transitions: int

    @classmethod
    def from_lease(cls, lease: dict) -> Record:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            lease_duration=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def spec(self) -> dict:
        return {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.lease_duration,
            "acquireTime": self.acquire_time,
            "renewTime": self.renew_time,
            "leaseTransitions": self.transitions,
        }


@dataclass(frozen=True)
class Observed:
    """A record and when this process first saw it, on its own monotonic clock: expiry is
    judged by how long the record stayed unchanged here, never by the holder's renewTime (the
    two machines' clocks may disagree), as client-go does."""

    record: Record
    at: float


class Action(enum.Enum):
    ACQUIRE = "acquire"  # write the record: the Lease is free, released or expired
    RENEW = "renew"  # write the record: this process holds the Lease
    WAIT = "wait"  # another process holds a live Lease


@dataclass(frozen=True)
class Decision:
    action: Action
    observed: Observed | None  # what to remember as seen (None: no Lease yet)
    record: Record | None  # what to write (None for WAIT)


def micro_time(moment: datetime.datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def decide(
    current: Record | None,
    observed: Observed | None,
    identity: str,
    now: float,
    stamp: str,
    lease_duration: int,
) -> Decision:
    """One round of client-go's tryAcquireOrRenew. `current` is the Lease as read (None: there
    is none), `observed` what this process saw before, `now` its monotonic clock, `stamp` the
    wall time to write."""
    if current is None:
        record = Record(identity, lease_duration, stamp, stamp, 0)
        return Decision(Action.ACQUIRE, None, record)
    if observed is None or observed.record != current:
        observed = Observed(current, now)
    if current.holder == identity:
        record = Record(identity, lease_duration, current.acquire_time, stamp, current.transitions)
        return Decision(Action.RENEW, observed, record)
    if current.holder and now < observed.at + current.lease_duration:
        return Decision(Action.WAIT, observed, None)
    record = Record(identity, lease_duration, stamp, stamp, current.transitions + 1)
    return Decision(Action.ACQUIRE, observed, record)


def released(record: Record, stamp: str) -> Record:
    """What a leader writes when it stops (client-go's release): no holder, and a 1 s duration
    so that a follower whose view predates the release does not wait out the full lease."""
    return Record("", 1, stamp, stamp, record.transitions)


# --- the shell: the Lease through the API -------------------------------------------------


def default_identity() -> str:
    """The pod's name (downward API), else host name and process id (unique per process)."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}"


def default_namespace() -> str:
    """The pod's namespace: POD_NAMESPACE, else the service account's, else `default`."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


@dataclass
class LeaseElector:
    """One candidate's view of the Lease and the writes that act on it. Every write carries the
    resourceVersion just read, so of two candidates acting on the same view one gets 409."""

    client: KubeClient
    namespace: str
    name: str
    identity: str
    timing: Timing
    observed: Observed | None = None
    # Its own thread: queued behind the operator's reconciles (the default executor) a renewal
    # could miss its deadline and cost the leadership.
    thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="lease")
    )

    async def run(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.thread, call)

    def lease(self, record: Record, resource_version: str | None) -> dict:
        metadata = {"name": self.name, "namespace": self.namespace}
        if resource_version is not None:
            metadata["resourceVersion"] = resource_version
        return {
            "apiVersion": LEASE_API,
            "kind": "Lease",
            "metadata": metadata,
            "spec": record.spec(),
        }

    def read(self) -> dict | None:
        return self.client.get(LEASE_API, "Lease", self.namespace, self.name)

    def write(self, current: dict | None, record: Record) -> bool:
        """Create the Lease or replace the one read; False when another candidate came first
        (409: the next round reads again)."""
        try:
            if current is None:
                return self.client.create(self.lease(record, None)) is not None
            path = KubeClient.path(LEASE_API, "Lease", self.namespace, self.name)
            version = current["metadata"].get("resourceVersion")
            return self.client.request("PUT", path, self.lease(record, version)) is not None
        except ApiError as e:
            if e.status != 409:
                raise
            log.info("lease %s/%s changed under us; reading it again", self.namespace, self.name)
            return False

    def try_acquire_or_renew(self) -> bool:
        """One round: whether this process holds the Lease now."""
        current = self.read()
        now = time.monotonic()
        stamp = micro_time(datetime.datetime.now(datetime.UTC))
        record = Record.from_lease(current) if current is not None else None
        decision = decide(
            record, self.observed, self.identity, now, stamp, self.timing.lease_duration
        )
        self.observed = decision.observed
        if decision.record is None:
            return False
        if not self.write(current, decision.record):
            return False
        if decision.action is Action.ACQUIRE:
            log.info("%s took the lease %s/%s", self.identity, self.namespace, self.name)
        self.observed = Observed(decision.record, now)
        return True

    def attempt(self) -> bool:
        """A round that an API failure only makes a miss: the next round tries again, and a
        leader that misses rounds until its renew deadline stops (client-go's rule)."""
        try:
            return self.try_acquire_or_renew()
        except Exception as e:  # any failure (API, network) is "not held this round"
            log.warning("lease %s/%s: %r", self.namespace, self.name, e)
            return False

    @property
    def leading(self) -> bool:
        return self.observed is not None and self.observed.record.holder == self.identity

    def release(self) -> None:
        """Hand the Lease back (if still ours) so a follower takes over at once."""
        if not self.leading:
            return
        try:
            current = self.read()
            if current is None or Record.from_lease(current).holder != self.identity:
                return
            stamp = micro_time(datetime.datetime.now(datetime.UTC))
            if self.write(current, released(Record.from_lease(current), stamp)):
                log.info("%s released the lease %s/%s", self.identity, self.namespace, self.name)
        except Exception as e:  # the Lease then expires on its own
            log.warning("could not release the lease %s/%s: %r", self.namespace, self.name, e)


def jittered(period: float) -> float:
    return period * (1 + random.uniform(0, JITTER - 1))


async def acquire(elector: LeaseElector, stop: asyncio.Event) -> bool:
    """Try every retry period until this process holds the Lease (True) or `stop` (False)."""
    log.info("%s waits for the lease %s/%s", elector.identity, elector.namespace, elector.name)
    while not stop.is_set():
        if await elector.run(elector.attempt):
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), jittered(elector.timing.retry_period))
    return False


async def keep(elector: LeaseElector, lost: Callable[[str], None]) -> None:
    """Renew every retry period; call `lost` when the Lease names someone else or no renewal
    went through for the renew deadline (a hung request counts as failed at the deadline)."""
    timing = elector.timing
    renewed = time.monotonic()
    while True:
        await asyncio.sleep(timing.retry_period)
        left = renewed + timing.renew_deadline - time.monotonic()
        if left > 0:
            try:
                if await asyncio.wait_for(elector.run(elector.attempt), left):
                    renewed = time.monotonic()
                    continue
            except TimeoutError:
                pass
        if not elector.leading:
            holder = elector.observed.record.holder if elector.observed else ""
            lost(f"the lease now names {holder or 'nobody'}")
            return
        if time.monotonic() - renewed >= timing.renew_deadline:
            lost(f"no renewal for {timing.renew_deadline:g} s")
            return


# --- liveness while waiting -----------------------------------------------------------------


def endpoint_address(endpoint: str) -> tuple[str, int, str]:
    """(host, port, path) of an http:// liveness endpoint, with kopf's defaults."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme != "http":
        raise ValueError(f"--liveness-endpoint: only http:// is served, got {endpoint!r}")
    return parts.hostname or "localhost", parts.port or 80, parts.path or "/"


async def serve_waiting_liveness(endpoint: str, elector: LeaseElector):
    """The liveness endpoint of a follower (200 while it waits: waiting is healthy); returns
    the aiohttp runner to clean up before kopf serves the same endpoint. It answers from
    before the first read of the Lease (holder "" until then): liveness says the process
    runs, and must not hang on, or fail with, an API server the kubelet cannot fix."""
    host, port, path = endpoint_address(endpoint)

    async def healthy(_: aiohttp.web.Request) -> aiohttp.web.Response:
        holder = elector.observed.record.holder if elector.observed else ""
        return aiohttp.web.json_response({"leader": False, "holder": holder})

    app = aiohttp.web.Application()
    app.add_routes([aiohttp.web.get(path, healthy)])
    runner = aiohttp.web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, port).start()
    return runner


# --- the run: follow, lead, release ---------------------------------------------------------


async def lead(
    elector: LeaseElector,
    operate: Callable[[asyncio.Event], Awaitable[object]],
    lost: Callable[[str], None],
    liveness_endpoint: str | None = None,
) -> None:
    """Wait for the Lease (serving the liveness endpoint meanwhile), then run `operate(stop)`
    while renewing it, and release it when `operate` returns (SIGTERM). `lost` must stop the
    process at once: after it, this process no longer holds the Lease."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    waiting = None
    if liveness_endpoint:
        waiting = await serve_waiting_liveness(liveness_endpoint, elector)
    try:
        held = await acquire(elector, stop)
    finally:
        if waiting is not None:
            await waiting.cleanup()  # kopf binds the same endpoint next
    if not held:
        return
    # Created before `operate` starts kopf: kopf leaves tasks older than itself alone.
    keeper = asyncio.create_task(keep(elector, lost))
    try:
        await operate(stop)
    finally:
        keeper.cancel()
        for signum in (signal.SIGTERM, signal.SIGINT):  # kopf installed its own
            loop.add_signal_handler(signum, stop.set)
        await elector.run(elector.release)
