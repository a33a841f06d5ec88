"""`pagefleet up`'s plan: which processes a local fleet runs, with which flags."""

from __future__ import annotations

import itertools
import json

import pytest

from pagefleet.common.cli import build_parser
from pagefleet.common.fleet_auth import load_fleet_secret
from pagefleet.fleet.up import FleetOptions, plan_fleet, write_fleet_secret


def plan(**kw):
    ports = itertools.count(9000, 10)
    opts = FleetOptions(model="/m", fleet_secret_file="/run/s", **kw)
    return plan_fleet(opts, "pagefleet", lambda: next(ports))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_default_fleet_is_colocated_prefill_decode_and_a_precise_router():
    specs = plan()
    assert [(s.name, s.role) for s in specs] == [
        ("engine-0", "both"),
        ("prefill", "prefill"),
        ("decode", "decode"),
        ("router", "router"),
    ]
    engines, router = specs[:3], specs[3].argv
    roles = [json.loads(flag(e.argv, "--kv-transfer-config"))["kv_role"] for e in engines[1:]]
    assert roles == ["kv_producer", "kv_consumer"]
    assert "--kv-transfer-config" not in engines[0].argv
    assert flag(router, "--endpoints").split(",") == [
        engines[0].url,
        f"{engines[1].url}@prefill",
        f"{engines[2].url}@decode",
    ]
    events = [json.loads(flag(e.argv, "--kv-events-config"))["endpoint"] for e in engines]
    assert flag(router, "--kv-events-endpoints").split(",") == events
    assert flag(router, "--prefix-index") == "precise" and flag(router, "--port") == "8000"
    # Every child shares the fleet's secret file; every command parses as `pagefleet` would.
    assert {flag(s.argv, "--fleet-secret-file") for s in specs} == {"/run/s"}
    for e in engines:
        build_parser().parse_args(e.argv[1:])
    build_parser().parse_args(router[1:])


def test_each_run_writes_a_fresh_secret_only_its_user_can_read(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = write_fleet_secret(tmp_path / "a"), write_fleet_secret(tmp_path / "b")
    assert first.stat().st_mode & 0o777 == 0o600
    secrets = [load_fleet_secret(str(p)) for p in (first, second)]
    assert secrets[0] != secrets[1] and len(secrets[0].value) >= 32


def test_simulated_fleets_have_no_kv_transfer_and_bad_sizes_are_refused():
    specs = plan(simulate=True, disaggregated=False, engines=8)
    assert len(specs) == 9 and all("--simulate" in s.argv for s in specs[:8])
    with pytest.raises(ValueError, match="--simulate"):
        plan(simulate=True, disaggregated=True)
    with pytest.raises(ValueError, match="--engines"):
        plan(engines=0, disaggregated=False)


def test_local_engines_are_told_what_the_operators_pods_are_told():
    """`pagefleet up` and the operator build engine commands in one place: a local prefill or
    decode engine gets the flags and JSON config keys the operator gives its pods (only
    addresses differ), so the local fleet runs engines as a cluster does."""
    from pagefleet.operator.reconcile import desired_objects

    md = {
        "metadata": {"name": "pd", "namespace": "serving", "uid": "uid-pd"},
        "spec": {
            "model": {"name": "demo", "source": "hostPath", "path": "/srv/m"},
            "mode": "disaggregated",
            "pools": {"prefill": {}, "decode": {}},
        },
    }
    pods = {
        d["metadata"]["name"].removeprefix("pd-"): d["spec"]["template"]["spec"]["containers"][0]
        for d in desired_objects(md)
        if d["kind"] == "Deployment"
    }
    local = {s.role: s.argv for s in plan()}
    for role in ("prefill", "decode"):
        cluster = pods[role]["command"]
        assert {a for a in local[role] if a.startswith("--")} == {
            a for a in cluster if a.startswith("--")
        }
        for config in ("--kv-events-config", "--kv-transfer-config"):
            mine, theirs = json.loads(flag(local[role], config)), json.loads(flag(cluster, config))
            assert mine.keys() == theirs.keys()
        transfer = json.loads(flag(local[role], "--kv-transfer-config"))
        cluster_transfer = json.loads(flag(cluster, "--kv-transfer-config"))
        assert transfer["kv_role"] == cluster_transfer["kv_role"]
        assert transfer["kv_connector"] == cluster_transfer["kv_connector"] == "nixl"


def test_engines_share_the_cores_unless_the_user_set_omp_num_threads(monkeypatch):
    from pagefleet.fleet.up import threads_per_engine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (threads_per_engine(3, 2), threads_per_engine(3, 16), threads_per_engine(1, 8)) == (
        1,
        5,
        8,
    )
    specs = plan(threads_per_engine=1)
    assert [s.env for s in specs] == [{"OMP_NUM_THREADS": "1"}] * 3 + [{}]  # not the router
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads_per_engine(3, 2) is None


def test_picked_ports_stay_out_of_the_kernels_ephemeral_range(tmp_path, monkeypatch):
    """A fleet's router binds the port picked for it seconds later, after the engines started:
    a port from the ephemeral range could meanwhile go to any socket bound to port 0 (one CI
    run lost the router's so). Where the range leaves no room below it, any free port does."""
    from pagefleet.fleet import up

    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(up, "EPHEMERAL_RANGE", ranges)
    ranges.write_text("32768\t60999\n")
    picked = {up.free_port() for _ in range(20)}
    assert all(up.LOWEST_PICKED <= p < 32768 for p in picked)
    assert len(picked) > 1  # drawn, not one fixed port
    ranges.write_text("1024\t65535\n")
    assert 1024 <= up.free_port() <= 65535
    ranges.unlink()  # no procfs: the kernel's choice
    assert up.free_port() > 0


def test_a_fleets_ports_never_repeat_the_routers_or_each_other():
    """Every port is picked before any child binds it, so nothing but the plan keeps two
    children off one port: a pick that meets the router's port, or a port (or pair) an earlier
    pick holds, is picked again. (A fleet's router once lost its port so.)"""
    # The picker offers the router's port, then a pair overlapping an earlier one, then
    # fresh pairs.
    offered = iter(
        [
            8000,
            9000,
            9001,
            9000,
            7999,
            9002,
            9004,
            9006,
            9008,
            9010,
            9012,
            9014,
            9016,
            9018,
            9020,
            9022,
        ]
    )
    opts = FleetOptions(model="/m", fleet_secret_file="/run/s", port=8000)
    specs = plan_fleet(opts, "pagefleet", lambda: next(offered))
    ports = [8000]
    for spec in specs[:-1]:
        ports.append(int(spec.url.rsplit(":", 1)[1]))
        events = json.loads(flag(spec.argv, "--kv-events-config"))["endpoint"]
        ports += [int(events.rsplit(":", 1)[1]), int(events.rsplit(":", 1)[1]) + 1]
        if "--kv-transfer-config" in spec.argv:
            kv = json.loads(flag(spec.argv, "--kv-transfer-config"))["kv_port"]
            ports += [kv, kv + 1]
    assert len(ports) == len(set(ports)), sorted(ports)
