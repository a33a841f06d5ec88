"""kmock's KubernetesEmulator on 127.0.0.1, on its own event-loop thread, for tests that drive
it through real clients (the official kubernetes client, kopf)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


@contextmanager
def kubernetes_emulator(
    resources: dict[str, tuple[str, bool, tuple | set]],
    configure: Callable[..., None] | None = None,
) -> Iterator[str]:
    """Serve `resources` ({"group/version/plural": (kind, namespaced, subresources)}); yields
    the emulator's base URL. `configure(emulator)` may add kmock reactions (they take
    precedence over the emulator's own answers)."""
    import kmock

    state: dict = {}
    ready = threading.Event()

    def serve() -> None:
        async def main() -> None:
            async with kmock.KubernetesEmulator() as emu, kmock.Server(emu) as server:
                for key, (kind, namespaced, subresources) in resources.items():
                    emu.resources[key] = kmock.ResourceInfo(
                        namespaced=namespaced, kind=kind, verbs=VERBS, subresources=subresources
                    )
                if configure:
                    configure(emu)
                state["url"] = str(server.url).rstrip("/")
                ready.set()
                while not state.get("stop"):
                    await asyncio.sleep(0.02)

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "the emulator did not start"
    try:
        yield state["url"]
    finally:
        state["stop"] = True
        thread.join(10)
