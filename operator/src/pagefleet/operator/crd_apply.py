"""`pagefleet operator crd --apply`: server-side apply of the CRDs the chart ships, then a wait
until the API server serves them. Helm installs crds/ once and never upgrades it; the chart's
pre-upgrade hook runs this so a chart upgrade also upgrades the schema."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import yaml

FIELD_MANAGER = "pagefleet-crd"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
APPLY_PATCH = "application/apply-patch+yaml"
POLL_SECONDS = 0.5


class CrdApplyError(RuntimeError):
    """An apply this command refuses, or a CRD the API server did not establish in time."""


@dataclass(frozen=True)
class Condition:
    status: str  # "True" | "False" | "Unknown" | "" (absent)
    reason: str = ""
    message: str = ""


# ---------------------------------------------------------------------------------------------
# pure core


def shipped_crds() -> list[dict]:
    """Every CRD the chart's crds/ holds: the documents of `pagefleet operator crd`."""
    from pagefleet.operator.crd import render_crd

    return [doc for doc in yaml.safe_load_all(render_crd()) if doc]


def crd_name(crd: dict) -> str:
    return crd["metadata"]["name"]


def served_versions(crd: dict) -> set[str]:
    return {v["name"] for v in crd["spec"]["versions"] if v.get("served")}


def storage_version(crd: dict) -> str:
    (version,) = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
    return version


def stranded_versions(live: dict | None, new: dict) -> list[str]:
    """Versions objects are still stored in (status.storedVersions of the live CRD) that the new
    CRD no longer serves: applying it would leave those objects unreadable."""
    if live is None:
        return []
    stored = (live.get("status") or {}).get("storedVersions") or []
    return [v for v in stored if v not in served_versions(new)]


def refusal(name: str, stranded: list[str], new: dict) -> str:
    """What the user must do before the new CRD can be applied."""
    target = storage_version(new)
    kept = sorted(served_versions(new))
    return (
        f"refusing to apply customresourcedefinition/{name}: objects may still be stored as "
        f"{', '.join(stranded)}, which the new CRD no longer serves ({', '.join(kept)}).\n"
        "Before upgrading: with the old chart still installed, rewrite every object in the "
        f"storage version {target} (e.g. `kubectl get {name} -A -o json | kubectl replace -f -`, "
        "or the kube-storage-version-migrator), then drop the old versions from the CRD's "
        f"status: `kubectl patch crd {name} --subresource=status --type=merge "
        f'-p \'{{"status":{{"storedVersions":["{target}"]}}}}\'`, and upgrade again.'
    )


def condition(crd: dict | None, kind: str) -> Condition:
    for c in ((crd or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return Condition(str(c.get("status", "")), c.get("reason", ""), c.get("message", ""))
    return Condition("")


def not_established_reason(crd: dict | None) -> str | None:
    """None once the API server serves the CRD (Established), else why not, as it says."""
    if crd is None:
        return "not found"
    if condition(crd, "Established").status == "True":
        return None
    names = condition(crd, "NamesAccepted")
    if names.status == "False":
        return f"names not accepted ({names.reason}: {names.message})"
    established = condition(crd, "Established")
    return f"Established is {established.status or 'not reported'} {established.message}".strip()


def names_rejected(crd: dict | None) -> bool:
    """Whether waiting is pointless: the API server refused the CRD's names (a conflict)."""
    return condition(crd, "NamesAccepted").status == "False"


def outcome(before: dict | None, after: dict) -> str:
    """kubectl's words for what the apply did to the CRD's spec."""
    if before is None:
        return "created"
    return "unchanged" if before.get("spec") == after.get("spec") else "configured"


# ---------------------------------------------------------------------------------------------
# I/O shell (the operator's client: in-cluster config, kubeconfig, or a plain URL)


def crd_path(name: str, query: str = "") -> str:
    return f"{CRD_PATH}/{name}{query}"


def apply_crd(client, crd: dict) -> dict:
    """One server-side apply, forcing ownership of every field this manager sets (the fields
    Helm's install wrote among them). JSON is YAML, so the body is the object as JSON."""
    query = f"?fieldManager={FIELD_MANAGER}&force=true"
    result = client.request("PATCH", crd_path(crd_name(crd), query), crd, content_type=APPLY_PATCH)
    if result is None:
        raise CrdApplyError(f"customresourcedefinition/{crd_name(crd)}: apply answered 404")
    return result


def wait_established(
    client,
    names: list[str],
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll each CRD until Established is True; fail at once on rejected names, or at the
    deadline naming what the API server last said."""
    deadline = clock() + timeout
    pending = list(names)
    reasons: dict[str, str] = {}
    while pending:
        for name in list(pending):
            crd = client.request("GET", crd_path(name))
            reason = not_established_reason(crd)
            if reason is None:
                pending.remove(name)
            elif names_rejected(crd):
                raise CrdApplyError(f"customresourcedefinition/{name}: {reason}")
            else:
                reasons[name] = reason
        if pending and clock() >= deadline:
            said = "; ".join(f"{n}: {reasons[n]}" for n in pending)
            raise CrdApplyError(f"not established after {timeout:g}s: {said}")
        if pending:
            sleep(POLL_SECONDS)


def apply_crds(client, crds: list[dict], timeout: float) -> list[str]:
    """Check every CRD first (nothing is applied if one would strand stored objects), apply
    them, wait until all are established; returns one line per CRD."""
    live = {crd_name(crd): client.request("GET", crd_path(crd_name(crd))) for crd in crds}
    refusals = [
        refusal(crd_name(crd), stranded, crd)
        for crd in crds
        if (stranded := stranded_versions(live[crd_name(crd)], crd))
    ]
    if refusals:
        raise CrdApplyError("\n".join(refusals))
    lines = []
    for crd in crds:
        applied = apply_crd(client, crd)
        lines.append(
            f"customresourcedefinition/{crd_name(crd)} {outcome(live[crd_name(crd)], applied)}"
        )
    wait_established(client, [crd_name(crd) for crd in crds], timeout)
    return lines


def apply_command(api_url: str | None, timeout: float) -> int:
    """The CLI's `crd --apply`: 0 when every CRD is applied and established, 1 otherwise."""
    from urllib3.exceptions import HTTPError

    from pagefleet.operator.handlers import ApiError, KubeClient

    crds = shipped_crds()
    try:
        lines = apply_crds(KubeClient(api_url), crds, timeout)
    except (CrdApplyError, ApiError) as e:
        print(f"pagefleet operator crd --apply: {e}", file=sys.stderr)
        return 1
    except HTTPError as e:  # unreachable API server: one line, not a traceback
        print(f"pagefleet operator crd --apply: API server unreachable: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    print("established:", ", ".join(crd_name(crd) for crd in crds))
    return 0
