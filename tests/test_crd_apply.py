"""`pagefleet operator crd --apply` (the chart's pre-upgrade hook) as a process against kmock's
emulator holding an older CRD: the schema is upgraded to the rendering, a rerun changes
nothing, a CRD that would strand stored objects is refused, and the command waits for
Established. kmock does not establish CRDs: the tests play the API server's part there."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kube_emulator import kubernetes_emulator
from pagefleet.common.names import VERSION
from pagefleet.operator.crd_apply import (
    APPLY_PATCH,
    CRD_PATH,
    FIELD_MANAGER,
    CrdApplyError,
    apply_crds,
    shipped_crds,
    wait_established,
)
from pagefleet.operator.handlers import KubeClient

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
RESOURCES = {
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, ()),
}
(NEW,) = shipped_crds()
NAME = NEW["metadata"]["name"]
SPEC_PROPERTIES = ("spec", "versions", 0, "schema", "openAPIV3Schema", "properties", "spec")


def spec_schema(crd: dict) -> dict:
    node = crd
    for key in SPEC_PROPERTIES:
        node = node[key]
    return node["properties"]


# The field an upgrade adds: the older CRD is the rendering without it.
ADDED = next(reversed(spec_schema(NEW)))


def established(status: str = "True", names: str = "True") -> list[dict]:
    return [
        {"type": "NamesAccepted", "status": names, "reason": "NoConflicts" if names else ""},
        {"type": "Established", "status": status, "reason": "InitialNamesAccepted"},
    ]


def older_crd(stored_versions: list[str], conditions: list[dict]) -> dict:
    """The CRD a previous chart installed, with the status the API server keeps on it."""
    old = copy.deepcopy(NEW)
    del spec_schema(old)[ADDED]
    for extra in (v for v in stored_versions if v != VERSION):
        version = copy.deepcopy(old["spec"]["versions"][0]) | {"name": extra, "storage": False}
        old["spec"]["versions"].append(version)
    old["status"] = {"storedVersions": stored_versions, "conditions": conditions}
    return old


def seed(client: KubeClient, crd: dict) -> None:
    client.request("POST", CRD_PATH, crd)


def stored(client: KubeClient) -> dict:
    return client.request("GET", f"{CRD_PATH}/{NAME}")


def crd_apply(url: str, *extra: str) -> subprocess.CompletedProcess:
    args = [PAGEFLEET, "operator", "crd", "--apply", "--kubernetes-api", url, *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_apply_upgrades_an_older_crd_to_the_rendering_and_a_rerun_changes_nothing():
    """Catches the upgrade Helm never does: after the hook, the API server holds the new
    schema (an older one would prune the new field from every ModelDeployment)."""
    with kubernetes_emulator(RESOURCES) as url:
        client = KubeClient(url)
        seed(client, older_crd([VERSION], established()))
        assert ADDED not in spec_schema(stored(client))

        out = crd_apply(url)
        assert out.returncode == 0, out.stderr
        assert f"customresourcedefinition/{NAME} configured" in out.stdout
        after = stored(client)
        assert after["spec"] == NEW["spec"] and ADDED in spec_schema(after)
        assert {k: after[k] for k in ("apiVersion", "kind")} == {
            k: NEW[k] for k in ("apiVersion", "kind")
        }

        again = crd_apply(url)
        assert again.returncode == 0, again.stderr
        assert f"customresourcedefinition/{NAME} unchanged" in again.stdout
        assert stored(client) == after


def test_apply_refuses_a_crd_that_stops_serving_a_stored_version():
    """Catches an upgrade that strands stored objects: objects still stored as a version the
    new CRD does not serve could no longer be read. Nothing is applied; the message says what
    to do."""
    with kubernetes_emulator(RESOURCES) as url:
        client = KubeClient(url)
        seed(client, older_crd(["v1alpha0", VERSION], established()))
        before = stored(client)

        out = crd_apply(url)
        assert out.returncode == 1
        assert f"refusing to apply customresourcedefinition/{NAME}" in out.stderr
        assert "stored as v1alpha0" in out.stderr
        assert f"storage version {VERSION}" in out.stderr
        assert f'"storedVersions":["{VERSION}"]' in out.stderr
        assert stored(client) == before, "a refused apply must write nothing"


def test_apply_waits_for_established_and_fails_clearly_when_it_never_comes():
    """The command returns only once the API server serves the new schema (Helm then upgrades
    the operator, which needs it); a CRD that never becomes established fails the hook with
    what the API server said, within the timeout."""
    with kubernetes_emulator(RESOURCES) as url:
        client = KubeClient(url)
        seed(client, older_crd([VERSION], established("False")))
        out = crd_apply(url, "--timeout", "1")
        assert out.returncode == 1
        assert f"not established after 1s: {NAME}: Established is False" in out.stderr
        assert ADDED in spec_schema(stored(client)), "the apply itself went through"

    with kubernetes_emulator(RESOURCES) as url:
        client = KubeClient(url)
        seed(client, older_crd([VERSION], established("False")))
        proc = subprocess.Popen(
            [PAGEFLEET, "operator", "crd", "--apply", "--kubernetes-api", url, "--timeout", "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # The API server's part: establish the CRD once the new schema is in.
            deadline = time.monotonic() + 60
            while ADDED not in spec_schema(stored(client)):
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
                time.sleep(0.05)
            patch = {"status": {"conditions": established()}}
            client.request("PATCH", f"{CRD_PATH}/{NAME}", patch, "application/merge-patch+json")
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 0, stderr
        assert f"established: {NAME}" in stdout


class RecordingClient:
    """The requests `apply_crds` makes, answered from a dict of live CRDs."""

    def __init__(self, live: dict[str, dict]) -> None:
        self.live = live
        self.requests: list[tuple[str, str, str]] = []

    def request(self, method, path, body=None, content_type="application/json"):
        self.requests.append((method, path, content_type))
        name = path.removeprefix(CRD_PATH + "/").split("?")[0]
        if method == "PATCH":
            self.live[name] = {**body, "status": self.live.get(name, {}).get("status", {})}
        return self.live.get(name)


def test_the_apply_is_a_forced_server_side_apply_by_its_own_field_manager():
    """Server-side apply with force takes over the fields Helm's install wrote (a merge patch
    could never remove a field); its own manager name lets `kubectl` show who set them."""
    old = older_crd([VERSION], established())
    client = RecordingClient({NAME: old})
    assert apply_crds(client, [NEW], timeout=1) == [f"customresourcedefinition/{NAME} configured"]
    methods = [(m, p.split("?")[0]) for m, p, _ in client.requests]
    path = f"{CRD_PATH}/{NAME}"
    # Read the stored versions, apply, read Established: RBAC grants exactly get and patch.
    assert methods == [("GET", path), ("PATCH", path), ("GET", path)]
    (patch,) = [r for r in client.requests if r[0] == "PATCH"]
    assert patch[1].endswith(f"?fieldManager={FIELD_MANAGER}&force=true")
    assert patch[2] == APPLY_PATCH


def test_rejected_names_fail_at_once_instead_of_waiting_out_the_timeout():
    crd = older_crd([VERSION], established("False", names="False"))
    crd["status"]["conditions"][0] |= {"reason": "NameConflict", "message": '"md" is taken'}
    slept: list[float] = []
    with pytest.raises(CrdApplyError, match='names not accepted \\(NameConflict: "md" is taken'):
        wait_established(RecordingClient({NAME: crd}), [NAME], 60, sleep=slept.append)
    assert slept == []


def test_a_missing_crd_after_apply_is_reported_not_waited_on_forever():
    ticks = iter(range(100))
    with pytest.raises(CrdApplyError, match=f"not established after 2s: {NAME}: not found"):
        wait_established(
            RecordingClient({}), [NAME], 2, clock=lambda: next(ticks), sleep=lambda s: None
        )
