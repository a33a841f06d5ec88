"""Fleet-internal request fields on the engine's API.

`kv_transfer_params` steers KV transfer: hold a prompt's blocks for another pod
(`do_remote_decode`), or pull blocks from a peer's address (`do_remote_prefill`). Only the
fleet's router may set it: it signs the fields, the request id and an expiry with the fleet
secret (pagefleet.common.fleet_auth), and the engine acts on them only if the signature verifies.
Anyone else gets a 403 that says so.
"""

from __future__ import annotations

from pagefleet.common.fleet_auth import SIGNATURE_HEADER, FieldSigner, FleetAuthError
from pagefleet.common.http_errors import APIError

FIELD = "kv_transfer_params"


def check_fleet_fields(
    fields: dict | None, headers, signer: FieldSigner | None, now: float
) -> None:
    """Raise a 403 unless `fields` is absent or signed by this fleet's router for this
    request (`headers`: the request's, with X-Request-Id and the signature)."""
    if fields is None:
        return
    if signer is None:
        raise APIError(
            403,
            f"{FIELD} may only be set by a pagefleet router of this fleet, and this engine "
            "has no fleet secret (--fleet-secret-file)",
            "permission_error",
            FIELD,
        )
    try:
        signer.verify(headers.get(SIGNATURE_HEADER), headers.get("x-request-id", ""), fields, now)
    except FleetAuthError as e:
        raise APIError(
            403, f"{FIELD} may only be set by this fleet's router: {e}", "permission_error", FIELD
        ) from None
