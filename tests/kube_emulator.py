"""kmock's KubernetesEmulator on 127.0.0.1, on its own event-loop thread, for tests that drive
it through real clients (the official kubernetes client, kopf). Leases get what leader election
relies on and kmock lacks: PUT, and a resourceVersion bumped by every write and checked by PUT
(409 when stale). One URL per client, if asked, tells whose requests were whose."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import aiohttp.web
import kmock
from kmock._internal import enums, rendering

VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
# kmock logs every request and matches each new one against its whole log, so a long test's
# requests cost quadratic time (most of a kopf test's CPU); no test reads that log.
KEPT_REQUESTS = 16
# Resources with resourceVersion and PUT (only the Lease: elsewhere the tests' objects rely on
# a resourceVersion that never changes, since kopf's JSON patches test it).
VERSIONED = {kmock.resource("coordination.k8s.io/v1/leases")}
READS = {"GET", "HEAD"}


@dataclass(frozen=True)
class Call:
    port: int  # which of the emulator's URLs the client used
    method: str
    path: str


class VersionedEmulator(kmock.KubernetesEmulator):
    """The emulator, plus PUT with optimistic concurrency on VERSIONED resources, and a log of
    every request (port, method, path)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.calls: list[Call] = []

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        del self._requests[:-KEPT_REQUESTS]
        method = request.method.value.upper()
        self.calls.append(Call(request.url.port or 0, method, request.url.path))
        if request.resource in VERSIONED and request.name is not None and method == "PUT":
            try:
                return aiohttp.web.json_response(await self._replace(request))
            except kmock.KubernetesError as e:
                return await self._render_error(e)
        if request.resource in VERSIONED and request.action == enums.action.CREATE:
            request.data.setdefault("metadata", {})["resourceVersion"] = "1"
        return await super()._handle(request)

    async def _replace(self, request: rendering.Request) -> dict:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            stored = self.objects[key].raw
            version = stored["metadata"]["resourceVersion"]
            wanted = (request.data.get("metadata") or {}).get("resourceVersion")
            if wanted and wanted != version:
                raise kmock.KubernetesError(
                    status=409, reason="Conflict", message="the object has been modified"
                )
            new = copy.deepcopy(request.data)
            new["metadata"]["resourceVersion"] = str(int(version) + 1)
            self.objects[key].history.append(new)
            await self._buses[request.resource].put({"type": "MODIFIED", "object": new})
            return new


@dataclass
class Emulated:
    urls: list[str]
    emulator: VersionedEmulator
    ports: list[int] = field(default_factory=list)

    def writes(self, url: str) -> list[Call]:
        """Every request but a read that came in through `url`."""
        port = self.ports[self.urls.index(url)]
        return [c for c in self.emulator.calls if c.port == port and c.method not in READS]


@contextmanager
def kubernetes_emulators(
    resources: dict[str, tuple[str, bool, tuple | set]],
    clients: int = 1,
    configure: Callable[..., None] | None = None,
) -> Iterator[Emulated]:
    """Serve `resources` ({"group/version/plural": (kind, namespaced, subresources)}) on
    `clients` URLs (one emulator behind them all). `configure(emulator)` may add kmock
    reactions (they take precedence over the emulator's own answers)."""
    state: dict = {}
    ready = threading.Event()

    def serve() -> None:
        async def main() -> None:
            emu = VersionedEmulator()
            async with emu, servers(emu, clients) as listening:
                for key, (kind, namespaced, subresources) in resources.items():
                    emu.resources[key] = kmock.ResourceInfo(
                        namespaced=namespaced, kind=kind, verbs=VERBS, subresources=subresources
                    )
                if configure:
                    configure(emu)
                state["emulated"] = Emulated(
                    [str(s.url).rstrip("/") for s in listening], emu, [s.port for s in listening]
                )
                ready.set()
                while not state.get("stop"):
                    await asyncio.sleep(0.02)

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "the emulator did not start"
    try:
        yield state["emulated"]
    finally:
        state["stop"] = True
        thread.join(10)


@asynccontextmanager
async def servers(emu: VersionedEmulator, count: int) -> AsyncIterator[list[kmock.Server]]:
    """`count` HTTP servers (each on its own port) in front of the one emulator."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(kmock.Server(emu)) for _ in range(count)]


@contextmanager
def kubernetes_emulator(
    resources: dict[str, tuple[str, bool, tuple | set]],
    configure: Callable[..., None] | None = None,
) -> Iterator[str]:
    """One client's emulator; yields its base URL."""
    with kubernetes_emulators(resources, configure=configure) as emulated:
        yield emulated.urls[0]
