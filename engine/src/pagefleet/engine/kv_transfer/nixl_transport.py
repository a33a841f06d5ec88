"""NIXL data path: one NIXL agent (UCX backend) per engine with its whole KV pool registered
once; the decode side READs a peer's blocks straight into its own blocks and polls without
blocking. Descriptors are the coalesced regions of layout.block_regions.

The caller owns timeouts: `poll` never blocks, `wait` is a blocking convenience for tests and
benchmarks. Peer metadata travels in the gRPC handshake (service.PeerInfo).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from pagefleet.common.kv_errors import PeerUnavailable, TransferError, TransferTimeout
from pagefleet.engine.kv_transfer.layout import (
    CompatRecord,
    PoolGeometry,
    PoolInfo,
    block_regions,
    describe_pool,
    geometry_of,
)

ReadState = Literal["done", "pending", "failed"]
_STATES: dict[str, ReadState] = {"DONE": "done", "PROC": "pending", "ERR": "failed"}


@dataclass(frozen=True)
class NixlPeer:
    """A remote agent we may READ from, with where its pool lives."""

    agent_name: str
    pool: PoolInfo
    geometry: PoolGeometry


@dataclass
class ReadHandle:
    """One READ in flight; its state only moves forward (pending -> done | failed)."""

    peer: NixlPeer
    num_bytes: int
    num_descriptors: int
    state: ReadState = "pending"
    xfer: Any = field(default=None, repr=False)  # nixl_xfer_handle, None once released
    started: float = field(default_factory=time.monotonic)


def _descriptors(base: int, offsets: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """NIXL's Nx3 (address, length, device id) rows."""
    rows = np.empty((len(offsets), 3), dtype=np.uint64)
    rows[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    rows[:, 1] = lengths
    rows[:, 2] = device
    return rows


class NixlTransport:
    """This engine's NIXL agent over its KV pool."""

    def __init__(
        self,
        pool: torch.Tensor,
        agent_name: str,
        backends: Sequence[str] = ("UCX",),
        progress_interval: float | None = 0.001,
    ) -> None:
        """`progress_interval`: how often a background thread drives UCX progress, which the
        serving side needs (connection wireup; AM-emulated READs on TCP). None uses NIXL's
        own progress thread instead, which spins: about one core per agent, as nixl's Python
        API fixes its delay at 0.
        """
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.pool = pool
        self.pool_info = describe_pool(pool)
        self.geometry = geometry_of(pool)
        self.agent_name = agent_name
        config = nixl_agent_config(
            enable_prog_thread=progress_interval is None,
            backends=list(backends),
            # Our progress thread and the engine's polls share the agent.
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl_agent(agent_name, config)
        missing = set(backends) - set(self._agent.backends)
        if missing:
            raise TransferError(f"NIXL backends unavailable: {sorted(missing)}")
        # The pool is registered once: per-transfer registration would cost more than the copy.
        self._registered = self._agent.register_memory(pool)
        self._peers: dict[str, tuple[bytes, NixlPeer]] = {}
        self._closed = False
        self._stop = threading.Event()
        self._progress: threading.Thread | None = None
        if progress_interval is not None:
            self._progress = threading.Thread(
                target=self._drive_progress,
                args=(progress_interval,),
                name=f"nixl-progress-{agent_name}",
                daemon=True,
            )
            self._progress.start()

    def _drive_progress(self, interval: float) -> None:
        # Fetching notifications progresses every UCX worker; we send none, so none is lost.
        while not self._stop.wait(interval):
            # A peer going away surfaces in its transfers' states; keep progressing the rest.
            with contextlib.suppress(Exception):
                self._agent.get_new_notifs()

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered pool), for the handshake."""
        return self._agent.get_agent_metadata()

    def add_peer(
        self,
        metadata: bytes,
        pool: PoolInfo,
        compat: CompatRecord,
        agent_name: str | None = None,
    ) -> NixlPeer:
        """Load a peer's agent metadata (all from its handshake reply); idempotent.

        Pass `agent_name` (PeerInfo.nixl_agent_name) so that a restarted peer, whose agent
        has the same name and new metadata, replaces the stale entry: NIXL refuses to load
        metadata for a name it already knows.
        """
        geometry = pool.geometry(compat)
        if not geometry.same_block_layout(self.geometry):
            raise TransferError(
                f"peer pool {geometry} has another block layout than {self.geometry}"
            )
        for known, peer in self._peers.values():
            if known == metadata:
                return peer
        stale = self._peers.get(agent_name) if agent_name else None
        if stale is not None:
            self.remove_peer(stale[1])
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as e:  # nixl raises its bindings' own exception types
            raise TransferError(
                f"cannot load NIXL metadata of {agent_name or 'a peer'}: {e}"
            ) from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if agent_name and loaded != agent_name:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(loaded)
            raise TransferError(f"NIXL metadata names agent {loaded!r}, not {agent_name!r}")
        peer = NixlPeer(loaded, pool, geometry)
        self._peers[loaded] = (metadata, peer)
        return peer

    def remove_peer(self, peer: NixlPeer) -> None:
        if self._peers.pop(peer.agent_name, None) is not None:
            # An error here means NIXL already forgot the agent: nothing left to undo.
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer.agent_name)

    def start_read(self, peer: NixlPeer, pairs: Sequence[tuple[int, int]]) -> ReadHandle:
        """Post one READ of the peer's blocks onto ours, (remote id, local id) pairs.
        Raises TransferError if it cannot even be posted; later failures show in poll()."""
        regions = block_regions(peer.geometry, self.geometry, pairs)
        handle = ReadHandle(peer, int(regions[:, 2].sum()), len(regions))
        if not len(regions):
            handle.state = "done"
            return handle
        local = _descriptors(
            self.pool_info.base_address, regions[:, 1], regions[:, 2], self.pool_info.device_id
        )
        remote = _descriptors(
            peer.pool.base_address, regions[:, 0], regions[:, 2], peer.pool.device_id
        )
        try:
            handle.xfer = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, self.pool_info.mem_type),
                self._agent.get_xfer_descs(remote, peer.pool.mem_type),
                peer.agent_name,
            )
            posted = self._agent.transfer(handle.xfer)
        except Exception as e:
            self.release(handle)
            kind = PeerUnavailable if "DISCONNECT" in str(e) else TransferError
            raise kind(f"cannot post a NIXL READ from {peer.agent_name}: {e}") from e
        handle.state = _STATES.get(posted, "failed")
        return handle

    def poll(self, handle: ReadHandle) -> ReadState:
        """The READ's state now; never blocks."""
        if handle.state == "pending":
            try:
                handle.state = _STATES.get(self._agent.check_xfer_state(handle.xfer), "failed")
            except Exception:
                handle.state = "failed"
        return handle.state

    def wait(self, handle: ReadHandle, timeout: float, interval: float = 0.0) -> None:
        """Block until the READ is done; raises TransferError if it fails, TransferTimeout
        after `timeout` seconds. Meant for tests and benchmarks, not the engine loop."""
        deadline = time.monotonic() + timeout
        while (state := self.poll(handle)) == "pending":
            if time.monotonic() > deadline:
                raise TransferTimeout(f"NIXL READ from {handle.peer.agent_name} timed out")
            if interval:
                time.sleep(interval)
        if state == "failed":
            raise TransferError(f"NIXL READ from {handle.peer.agent_name} failed")

    def release(self, handle: ReadHandle) -> bool:
        """Free the READ's resources, cancelling it if still pending. False if NIXL could not
        cancel it: then the local blocks may still be written and must not be reused yet."""
        if handle.xfer is None:
            return True
        try:
            handle.xfer.release()
        except Exception:
            return False
        handle.xfer = None
        if handle.state == "pending":
            handle.state = "failed"
        return True

    def close(self) -> None:
        """Forget peers and deregister the pool; the agent goes with this object."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._progress is not None:
            self._progress.join()
        for _, peer in list(self._peers.values()):
            self.remove_peer(peer)
        self._agent.deregister_memory(self._registered)

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
