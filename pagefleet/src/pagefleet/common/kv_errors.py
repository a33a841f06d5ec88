"""Errors of the KV transfer layer: one family, so callers fall back to local prefill on any."""

from __future__ import annotations


class TransferError(RuntimeError):
    """Any failure to move KV blocks from a peer; the caller recomputes locally."""


class IncompatiblePeer(TransferError):
    """The peer's KV cache cannot be read into ours (model, dtype, shape or layout differ)."""

    def __init__(self, peer: str, mismatches: list[str]) -> None:
        self.peer = peer
        self.mismatches = list(mismatches)
        super().__init__(f"incompatible KV transfer peer {peer}: " + "; ".join(self.mismatches))


class AuthenticationFailed(TransferError):
    """The peer did not prove it holds the fleet secret (or we did not, to it)."""


class UnknownRequest(TransferError):
    """The peer holds no blocks for this request id (never held, released or expired)."""


class PeerUnavailable(TransferError):
    """The peer could not be reached or went away during the call."""


class TransferTimeout(TransferError):
    """The transfer did not finish within the caller's deadline."""
