"""The fleet secret's pure parts: the router's signature over fleet-internal fields, and the
KV-transfer handshake (proofs, replays, relays, sessions). Each forgery an attacker without
the secret could try is refused; the fleet's own messages verify."""

from __future__ import annotations

import pytest

from pagefleet.common.fleet_auth import (
    FieldSigner,
    FleetAuthError,
    FleetSecret,
    load_fleet_secret,
)
from pagefleet.common.peer_auth import (
    CHALLENGE_TTL_S,
    MAX_SESSIONS,
    SESSION_IDLE_S,
    ClientHandshake,
    PeerAuthenticator,
)

SECRET = FleetSecret(b"unit-test-fleet-secret-0123456789")
OTHER = FleetSecret(b"another-fleets-secret-0123456789")
FIELDS = {"do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_port": 14579}


def test_secrets_come_from_a_file_or_the_environment_and_never_show(tmp_path):
    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789abcdef\n")
    assert load_fleet_secret(str(path), {}).value == b"from-a-file-0123456789abcdef"
    env = {"PAGEFLEET_FLEET_SECRET": "from-the-env-0123456789abc"}
    assert load_fleet_secret(None, env).value == b"from-the-env-0123456789abc"
    assert load_fleet_secret(None, {}) is None
    with pytest.raises(ValueError, match="at least 16 bytes"):
        FleetSecret(b"short")
    assert "from-the-env" not in repr(load_fleet_secret(None, env))


def test_only_the_routers_signature_over_exactly_these_fields_verifies():
    signer = FieldSigner(SECRET)
    signature = signer.sign("req-1", FIELDS, now=1000.0)
    signer.verify(signature, "req-1", dict(reversed(FIELDS.items())), now=1050.0)  # key order
    forged = [
        (FieldSigner(OTHER).sign("req-1", FIELDS, 1000.0), "req-1", FIELDS, 1050.0),
        (signature, "req-2", FIELDS, 1050.0),  # replayed on another request
        (signature, "req-1", {**FIELDS, "remote_host": "6.6.6.6"}, 1050.0),  # SSRF
        (signature, "req-1", FIELDS, 1000.0 + signer.ttl_s + 1),  # expired
        (signature.replace("v1.1120", "v1.9999"), "req-1", FIELDS, 1050.0),  # later expiry
        (None, "req-1", FIELDS, 1050.0),
        ("garbage", "req-1", FIELDS, 1050.0),
    ]
    for sig, request_id, fields, now in forged:
        with pytest.raises(FleetAuthError):
            signer.verify(sig, request_id, fields, now)


def handshake(auth: PeerAuthenticator, client: ClientHandshake, now: float):
    """Both steps as the gRPC service runs them; returns the peer or raises."""
    nonce, proof = auth.challenge(
        client.client_nonce, client.peer_id, client.role, client.address, now
    )
    mine = client.check_server(nonce, auth.server_id, proof)
    return auth.verify(client.context(nonce, auth.server_id), mine, now), nonce, mine


def test_a_handshake_proves_both_sides_and_cannot_be_replayed_or_relayed():
    auth = PeerAuthenticator(SECRET, "prefill-0", "10.0.0.7:14579")
    client = ClientHandshake(SECRET, "decode-0", "reader", "10.0.0.7:14579")
    peer, nonce, proof = handshake(auth, client, now=100.0)
    assert peer.reader == "reader/decode-0"
    with pytest.raises(FleetAuthError, match="already used"):
        auth.verify(client.context(nonce, "prefill-0"), proof, 101.0)
    # Dialled through another listener (a relay): refused at the first step.
    relayed = ClientHandshake(SECRET, "decode-0", "reader", "10.6.6.6:14579")
    with pytest.raises(FleetAuthError, match="another address"):
        handshake(auth, relayed, 100.0)
    # A client without the secret: its proof fails; it cannot check ours either.
    rogue = ClientHandshake(OTHER, "rogue", "reader", "10.0.0.7:14579")
    with pytest.raises(FleetAuthError, match="fleet secret"):
        handshake(auth, rogue, 100.0)
    # A rogue server (no secret) cannot prove itself to a fleet client.
    fake = PeerAuthenticator(OTHER, "prefill-0", "10.0.0.7:14579")
    with pytest.raises(FleetAuthError, match="fleet secret"):
        handshake(fake, ClientHandshake(SECRET, "decode-0", "reader", "10.0.0.7:14579"), 100.0)
    # A challenge answered too late, or an unknown role.
    late = ClientHandshake(SECRET, "decode-1", "reader", "10.0.0.7:14579")
    nonce, proof = auth.challenge(late.client_nonce, "decode-1", "reader", late.address, 100.0)
    mine = late.check_server(nonce, "prefill-0", proof)
    with pytest.raises(FleetAuthError, match="expired"):
        auth.verify(late.context(nonce, "prefill-0"), mine, 100.0 + CHALLENGE_TTL_S + 1)
    with pytest.raises(FleetAuthError, match="role"):
        handshake(auth, ClientHandshake(SECRET, "d", "admin", "10.0.0.7:14579"), 100.0)


def test_sessions_expire_when_idle_and_are_bounded():
    auth = PeerAuthenticator(SECRET, "prefill-0", "h:1")
    peer, _, _ = handshake(auth, ClientHandshake(SECRET, "decode-0", "reader", "h:1"), 0.0)
    session = auth.open_session(peer, now=0.0)
    assert auth.peer_of(session, SESSION_IDLE_S - 1) == peer  # use restarts the idle clock
    assert auth.peer_of(session, 2 * SESSION_IDLE_S - 2) == peer
    with pytest.raises(FleetAuthError):
        auth.peer_of(session, 4 * SESSION_IDLE_S)
    with pytest.raises(FleetAuthError):
        auth.peer_of(b"guessed-session!", 0.0)
    sessions = [auth.open_session(peer, 0.0) for _ in range(MAX_SESSIONS + 1)]
    with pytest.raises(FleetAuthError):
        auth.peer_of(sessions[0], 0.0)  # the oldest made room
    assert auth.peer_of(sessions[-1], 0.0) == peer
