"""Who may talk to an engine's KV-transfer service: the two-step handshake under the fleet
secret, and the sessions it opens.

Challenge: the client sends its nonce, id, role and the address it dialled; the server answers
with a fresh nonce (single use, carrying its expiry) and its proof over all of it. Handshake:
the client, having checked the server's proof, sends its own; the server checks it, burns the
nonce and opens a session. A replayed handshake finds its nonce burnt or expired; a relayed one
names another address; a peer without the secret proves nothing. The server keeps no state for
a challenge, so unauthenticated callers cannot grow it. Pure: clocks are passed in.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

from pagefleet.common.fleet_auth import (
    NONCE_BYTES,
    FleetAuthError,
    FleetSecret,
    HandshakeContext,
    check_proof,
    client_proof,
    handshake_key,
    new_nonce,
    server_proof,
)

ROLES = ("reader", "releaser")  # reads blocks (an engine) / only releases grants
CHALLENGE_TTL_S = 30.0
SESSION_IDLE_S = 3600.0
MAX_SESSIONS = 4096
MAX_ID_CHARS = 256
SESSION_BYTES = 16


@dataclass(frozen=True)
class Peer:
    """An authenticated caller: `reader` names it for the grants it binds or releases."""

    peer_id: str
    role: str

    @property
    def reader(self) -> str:
        return f"{self.role}/{self.peer_id}"


def _check_fields(client_nonce: bytes, peer_id: str, role: str, address: str) -> None:
    if len(client_nonce) != NONCE_BYTES:
        raise FleetAuthError(f"the client nonce must have {NONCE_BYTES} bytes")
    if role not in ROLES:
        raise FleetAuthError(f"unknown role {role[:32]!r}")
    if not peer_id or len(peer_id) > MAX_ID_CHARS or len(address) > MAX_ID_CHARS:
        raise FleetAuthError("peer id or address missing or too long")


def _nonce_with_expiry(expires: float) -> bytes:
    return secrets.token_bytes(NONCE_BYTES - 8) + int(expires).to_bytes(8, "big")


def _expiry_of(server_nonce: bytes) -> int:
    return int.from_bytes(server_nonce[-8:], "big")


class PeerAuthenticator:
    """The server's side: answers challenges, verifies handshakes, keeps sessions."""

    def __init__(self, secret: FleetSecret, server_id: str, address: str) -> None:
        self._key = handshake_key(secret)
        self.server_id = server_id
        self.address = address
        self._lock = threading.Lock()
        self._burnt: dict[bytes, int] = {}  # server nonces of accepted handshakes -> expiry
        self._sessions: OrderedDict[bytes, tuple[Peer, float]] = OrderedDict()

    def challenge(
        self, client_nonce: bytes, peer_id: str, role: str, address: str, now: float
    ) -> tuple[bytes, bytes]:
        """(server nonce, server proof); raises FleetAuthError on a malformed challenge or one
        dialled to another address (a relay)."""
        _check_fields(client_nonce, peer_id, role, address)
        self._check_address(address)
        server_nonce = _nonce_with_expiry(now + CHALLENGE_TTL_S)
        ctx = HandshakeContext(client_nonce, server_nonce, self.server_id, peer_id, role, address)
        return server_nonce, server_proof(self._key, ctx)

    def verify(self, ctx: HandshakeContext, proof: bytes, now: float) -> Peer:
        """The peer, once its proof verifies for a fresh, unused nonce of ours."""
        _check_fields(ctx.client_nonce, ctx.peer_id, ctx.role, ctx.address)
        self._check_address(ctx.address)
        if ctx.server_id != self.server_id or len(ctx.server_nonce) != NONCE_BYTES:
            raise FleetAuthError("the handshake names another server or nonce")
        expires = _expiry_of(ctx.server_nonce)
        if expires < now:
            raise FleetAuthError("the challenge has expired")
        check_proof(client_proof(self._key, ctx), proof, "the peer")
        with self._lock:
            if ctx.server_nonce in self._burnt:
                raise FleetAuthError("the challenge was already used (a replay)")
            self._burnt = {n: e for n, e in self._burnt.items() if e >= now}
            self._burnt[ctx.server_nonce] = expires
        return Peer(ctx.peer_id, ctx.role)

    def _check_address(self, address: str) -> None:
        if address != self.address:
            raise FleetAuthError("the client dialled another address than this server's")

    def open_session(self, peer: Peer, now: float) -> bytes:
        session = secrets.token_bytes(SESSION_BYTES)
        with self._lock:
            self._sessions[session] = (peer, now)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return session

    def peer_of(self, session: bytes, now: float) -> Peer:
        """The session's peer (its idle clock restarts); raises FleetAuthError if unknown."""
        with self._lock:
            found = self._sessions.get(session)
            if found is None or now - found[1] > SESSION_IDLE_S:
                self._sessions.pop(session, None)
                raise FleetAuthError("no valid session: handshake first")
            self._sessions[session] = (found[0], now)
            self._sessions.move_to_end(session)
            return found[0]


@dataclass
class ClientHandshake:
    """The client's side of one handshake: the context both proofs cover."""

    secret: FleetSecret
    peer_id: str
    role: str
    address: str
    client_nonce: bytes = b""

    def __post_init__(self) -> None:
        self.client_nonce = self.client_nonce or new_nonce()

    def context(self, server_nonce: bytes, server_id: str) -> HandshakeContext:
        return HandshakeContext(
            self.client_nonce, server_nonce, server_id, self.peer_id, self.role, self.address
        )

    def check_server(self, server_nonce: bytes, server_id: str, proof: bytes) -> bytes:
        """Verify the server's proof; returns ours for the same context."""
        ctx = self.context(server_nonce, server_id)
        key = handshake_key(self.secret)
        check_proof(server_proof(key, ctx), proof, f"server {server_id[:64]!r}")
        return client_proof(key, ctx)
