"""Leader election between operator replicas: the pure decision (acquire, renew, wait), the
Lease shell against the emulator (409 on a stale write, losing the Lease), and two real
`pagefleet operator` processes of which only the Lease holder acts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from operator_harness import (
    NS,
    RESOURCES,
    get,
    model_deployment,
    samples,
    wait_for,
)

from kube_emulator import kubernetes_emulators
from pagefleet.operator.handlers import KubeClient
from pagefleet.operator.leader import (
    LEASE_API,
    Action,
    LeaseElector,
    Observed,
    Record,
    Timing,
    decide,
    endpoint_address,
    keep,
    released,
)
from pagefleet.operator.main import LOST_LEASE_EXIT
from server_utils import PAGEFLEET, free_port

ME, OTHER = "operator-a", "operator-b"
T0, T1 = "2030-01-01T00:00:00.000000Z", "2030-01-01T00:00:05.000000Z"


def held_by(holder: str, transitions: int = 0, duration: int = 15) -> Record:
    return Record(holder, duration, T0, T0, transitions)


# --- the decision ---------------------------------------------------------------------------


def test_no_lease_is_acquired_with_no_transition():
    decision = decide(None, None, ME, now=100.0, stamp=T1, lease_duration=15)
    assert decision.action is Action.ACQUIRE
    assert decision.record == Record(ME, 15, T1, T1, 0)


def test_a_released_lease_is_acquired_at_once_and_counts_a_transition():
    """A follower that saw the leader renew a moment ago still takes a released Lease now:
    the empty holder, not the age, says it is free."""
    before = Observed(held_by(OTHER, transitions=2), at=99.0)
    free = released(held_by(OTHER, transitions=2), T0)
    assert free == Record("", 1, T0, T0, 2)
    decision = decide(free, before, ME, now=99.5, stamp=T1, lease_duration=15)
    assert decision.action is Action.ACQUIRE
    assert decision.record == Record(ME, 15, T1, T1, 3)


def test_own_lease_is_renewed_keeping_acquire_time_and_transitions():
    mine = held_by(ME, transitions=4)
    decision = decide(mine, Observed(mine, 10.0), ME, now=12.0, stamp=T1, lease_duration=15)
    assert decision.action is Action.RENEW
    assert decision.record == Record(ME, 15, T0, T1, 4)


def test_a_live_foreign_lease_is_waited_on():
    theirs = held_by(OTHER)
    first = decide(theirs, None, ME, now=50.0, stamp=T1, lease_duration=15)
    assert (first.action, first.record, first.observed) == (
        Action.WAIT,
        None,
        Observed(theirs, 50.0),
    )
    later = decide(theirs, first.observed, ME, now=64.9, stamp=T1, lease_duration=15)
    assert later.action is Action.WAIT
    assert later.observed == Observed(theirs, 50.0)  # unchanged: the clock keeps running


def test_a_foreign_lease_unrenewed_for_its_duration_is_taken_over():
    theirs = held_by(OTHER, transitions=1, duration=15)
    decision = decide(theirs, Observed(theirs, 50.0), ME, now=65.0, stamp=T1, lease_duration=15)
    assert decision.action is Action.ACQUIRE
    assert decision.record == Record(ME, 15, T1, T1, 2)


def test_a_renewed_foreign_lease_never_expires():
    """Each renewal is a new record: the wait restarts from when it was seen."""
    observed = None
    for step in range(10):
        renewed = Record(OTHER, 15, T0, f"2030-01-01T00:00:{step:02d}.000000Z", 0)
        decision = decide(renewed, observed, ME, now=10.0 * step, stamp=T1, lease_duration=15)
        assert decision.action is Action.WAIT
        observed = decision.observed
        assert observed.at == 10.0 * step


def test_expiry_follows_this_clock_not_the_holders_renew_time():
    """Catches judging expiry by renewTime: a holder whose clock is an hour behind would look
    expired to everyone at once. What counts is how long the record stayed unchanged here."""
    skewed = Record(OTHER, 15, "2029-12-31T23:00:00.000000Z", "2029-12-31T23:00:00.000000Z", 0)
    decision = decide(skewed, None, ME, now=1000.0, stamp=T1, lease_duration=15)
    assert decision.action is Action.WAIT


def test_the_holders_duration_counts_not_mine():
    theirs = held_by(OTHER, duration=60)
    decision = decide(theirs, Observed(theirs, 0.0), ME, now=30.0, stamp=T1, lease_duration=15)
    assert decision.action is Action.WAIT


def test_timing_must_let_a_leader_stop_before_a_follower_takes_over():
    Timing(15, 10, 2)
    for bad in ((10, 10, 2), (15, 10, 9), (15, 10, 0)):
        with pytest.raises(ValueError, match="lease duration > renew deadline"):
            Timing(*bad)


def test_lease_spec_round_trip_and_endpoint():
    record = Record(ME, 15, T0, T1, 3)
    assert Record.from_lease({"spec": record.spec()}) == record
    assert Record.from_lease({"spec": {}}) == Record("", 0, None, None, 0)
    assert endpoint_address("http://0.0.0.0:8081/healthz") == ("0.0.0.0", 8081, "/healthz")
    with pytest.raises(ValueError, match="http://"):
        endpoint_address("https://0.0.0.0:8081/healthz")


# --- the shell against the emulator ---------------------------------------------------------

LEASES = {**RESOURCES, "coordination.k8s.io/v1/leases": ("Lease", True, ())}
FAST = Timing(lease_duration=2, renew_deadline=1.0, retry_period=0.2)


def elector(url: str, identity: str, timing: Timing = FAST) -> LeaseElector:
    return LeaseElector(KubeClient(url), NS, "pagefleet-operator", identity, timing)


def lease(client: KubeClient) -> dict:
    return client.get(LEASE_API, "Lease", NS, "pagefleet-operator") or {}


def test_one_candidate_holds_and_a_stale_write_is_refused():
    """Two candidates acting on the same view of the Lease: the second write carries a stale
    resourceVersion and gets 409, so only one of them believes it holds the Lease."""
    with kubernetes_emulators(LEASES) as emulated:
        url = emulated.urls[0]
        a, b = elector(url, ME), elector(url, OTHER)
        assert a.try_acquire_or_renew() and a.leading
        assert not b.try_acquire_or_renew() and not b.leading
        view = b.read()
        assert view["spec"]["holderIdentity"] == ME
        assert a.try_acquire_or_renew()  # a renews: the Lease's resourceVersion moves on
        taken = Record(OTHER, 2, T1, T1, 1)
        assert not b.write(view, taken)  # 409: b's view is stale
        assert lease(KubeClient(url))["spec"]["holderIdentity"] == ME
        a.release()
        assert lease(KubeClient(url))["spec"]["holderIdentity"] == ""
        assert b.try_acquire_or_renew()
        assert lease(KubeClient(url))["spec"]["leaseTransitions"] == 1


def test_a_leader_whose_lease_is_taken_is_told_at_once():
    with kubernetes_emulators(LEASES) as emulated:
        url = emulated.urls[0]
        a = elector(url, ME)
        assert a.try_acquire_or_renew()
        current = a.read()
        assert a.write(current, Record(OTHER, 2, T1, T1, 1))  # someone took it
        why: list[str] = []
        asyncio.run(asyncio.wait_for(keep(a, why.append), 10))
        assert why == [f"the lease now names {OTHER}"]


def test_a_leader_that_cannot_renew_stops_at_the_renew_deadline():
    with kubernetes_emulators(LEASES) as emulated:
        a = elector(emulated.urls[0], ME)
        assert a.try_acquire_or_renew()
        a.client = KubeClient(f"http://127.0.0.1:{free_port()}")  # the API is gone
        why: list[str] = []
        asyncio.run(asyncio.wait_for(keep(a, why.append), 10))
        assert why == ["no renewal for 1 s"]


# --- two real operators ---------------------------------------------------------------------

PROCESS_TIMING = (
    "--leader-election-lease-duration=4",
    "--leader-election-renew-deadline=3",
    "--leader-election-retry-period=0.3",
)


@contextmanager
def operator_process(url: str, name: str) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """`pagefleet operator` as pod `name` would run it; yields it, its liveness URL and its
    metrics URL."""
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    metrics_port = free_port()
    proc = subprocess.Popen(
        [
            PAGEFLEET,
            "operator",
            "--kubernetes-api",
            url,
            "--autoscale-interval=0.5",
            f"--liveness-endpoint={liveness}",
            f"--metrics-bind-address=127.0.0.1:{metrics_port}",
            f"--leader-election-namespace={NS}",
            *PROCESS_TIMING,
        ],
        env={**os.environ, "POD_NAME": name},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc, liveness, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def stop(proc: subprocess.Popen, signum: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(signum)
    try:
        output, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    return proc.returncode, output


def alive(liveness: str) -> dict | None:
    try:
        response = httpx.get(liveness, timeout=2)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def following(liveness: str, leader: str) -> dict | None:
    """The follower's liveness answer once it names `leader`. Liveness answers before the
    follower's first read of the Lease (holder ""): a 200 alone proves only that it runs."""
    answer = alive(liveness)
    return answer if answer and answer.get("holder") == leader else None


def scraped(url: str, name: str) -> float | None:
    """One sample (without labels, or summed) of a process' /metrics."""
    found = samples(httpx.get(url, timeout=10).text, name)
    return sum(found.values()) if found else None


def holder(client: KubeClient) -> str | None:
    return lease(client).get("spec", {}).get("holderIdentity")


def replicas(client: KubeClient) -> int | None:
    found = get(client, "apps/v1", "Deployment", "llama-colocated") or {}
    return (found.get("spec") or {}).get("replicas")


def scale(client: KubeClient, count: int) -> None:
    md = get(client, "pagefleet.io/v1alpha1", "ModelDeployment", "llama")
    client.merge_patch(md, {"spec": {"pools": {"colocated": {"replicas": count}}}})


def lease_reads(emulated, url: str) -> int:
    port = emulated.ports[emulated.urls.index(url)]
    return sum(
        c.port == port and c.method == "GET" and c.path.endswith("/leases/pagefleet-operator")
        for c in emulated.emulator.calls
    )


def test_two_operators_one_acts_the_other_takes_over_when_it_dies():
    """Only the Lease holder writes; the follower's liveness URL answers while it waits; after
    SIGKILL of the leader the follower takes the Lease and applies a change made after the
    kill; SIGTERM on the new leader hands the Lease back. Each process' /metrics says whether
    it leads (served while it waits too), and only the leader counts reconciles."""
    with kubernetes_emulators(LEASES, clients=3) as emulated:
        url_a, url_b, url_test = emulated.urls
        client = KubeClient(url_test)
        with (
            operator_process(url_a, "op-a") as (a, live_a, metrics_a),
            operator_process(url_b, "op-b") as (b, live_b, metrics_b),
        ):
            wait_for(lambda: holder(client) in {"op-a", "op-b"}, 30, "a leader")
            leader, follower = ("op-a", "op-b") if holder(client) == "op-a" else ("op-b", "op-a")
            procs = {"op-a": (a, live_a, url_a, metrics_a), "op-b": (b, live_b, url_b, metrics_b)}
            lead_proc, lead_live, lead_url, lead_metrics = procs[leader]
            follow_proc, follow_live, follow_url, follow_metrics = procs[follower]

            client.create(model_deployment(pools={"colocated": {"replicas": 1}}))
            wait_for(lambda: replicas(client) == 1, 30, "the leader's reconcile")
            scale(client, 2)
            wait_for(lambda: replicas(client) == 2, 30, "the leader applies an edit")
            # Liveness answers from the start (waiting is healthy, and it must not hang on the
            # API); the holder it names appears after the follower's first read of the Lease.
            assert wait_for(
                lambda: following(follow_live, leader), 30, "the follower names the leader"
            ) == {"leader": False, "holder": leader}
            # The follower kept trying (and so would have acted by now if it could).
            reads = lease_reads(emulated, follow_url)
            wait_for(lambda: lease_reads(emulated, follow_url) >= reads + 3, 30, "its tries")
            # Both start with no Lease and may both try to create it (client-go does): the
            # loser's one refused create is no write; anything else from the follower is.
            writes = emulated.writes(follow_url)
            creates = [c for c in writes if c.method == "POST" and c.path.endswith("/leases")]
            assert len(creates) <= 1 and writes == creates, "the follower wrote"
            assert emulated.writes(lead_url), "the leader wrote nothing"
            assert alive(lead_live) == {}, "the leader's (kopf's) liveness"
            assert holder(client) == leader
            assert scraped(lead_metrics, "pagefleet_operator:leader") == 1
            assert scraped(lead_metrics, "pagefleet_operator:reconciles_total") >= 1
            assert scraped(follow_metrics, "pagefleet_operator:leader") == 0
            assert scraped(follow_metrics, "pagefleet_operator:reconciles_total") is None

            lead_proc.send_signal(signal.SIGKILL)
            lead_proc.wait(30)
            scale(client, 3)  # after the kill: only the follower can apply it
            wait_for(lambda: holder(client) == follower, 30, "the follower takes over")
            wait_for(lambda: replicas(client) == 3, 30, "the new leader applies the edit")
            assert lease(client)["spec"]["leaseTransitions"] == 1
            # kopf's endpoint now (its body is its probes' results: {} here).
            assert wait_for(lambda: alive(follow_live) == {}, 30, "the new leader's liveness")
            assert scraped(follow_metrics, "pagefleet_operator:leader") == 1

            code, output = stop(follow_proc)
            assert code == 0, output
            assert holder(client) == "", "SIGTERM did not release the lease"
            assert "released the lease" in output


def test_a_paused_leader_that_lost_the_lease_exits_when_it_resumes():
    """client-go's rule: a leader that could not renew in time stops at once (non-zero exit:
    the kubelet restarts it as a follower), so it never acts beside the new leader."""
    with kubernetes_emulators(LEASES, clients=3) as emulated:
        url_a, url_b, url_test = emulated.urls
        client = KubeClient(url_test)
        with operator_process(url_a, "op-a") as (a, _, _):
            wait_for(lambda: holder(client) == "op-a", 30, "op-a leads")
            with operator_process(url_b, "op-b") as (b, live_b, _):
                wait_for(lambda: alive(live_b), 30, "op-b waits")
                a.send_signal(signal.SIGSTOP)
                try:
                    wait_for(lambda: holder(client) == "op-b", 30, "op-b takes over")
                finally:
                    a.send_signal(signal.SIGCONT)
                code, output = stop(a, signal.SIGCONT)
                assert code == LOST_LEASE_EXIT, output
                assert "lost the leader lease" in output
                assert holder(client) == "op-b"
                assert b.poll() is None
                assert stop(b)[0] == 0


def test_a_waiting_follower_stops_on_sigterm():
    with kubernetes_emulators(LEASES, clients=2) as emulated:
        url_a, url_test = emulated.urls
        client = KubeClient(url_test)
        current = {
            "apiVersion": LEASE_API,
            "kind": "Lease",
            "metadata": {"name": "pagefleet-operator", "namespace": NS},
            "spec": Record("someone-else", 3600, T0, T0, 0).spec(),
        }
        client.create(current)
        with operator_process(url_a, "op-a") as (a, live_a, metrics_a):
            wait_for(lambda: following(live_a, "someone-else"), 30, "the follower's first read")
            assert scraped(metrics_a, "pagefleet_operator:leader") == 0
            code, output = stop(a)
            assert code == 0, output
            assert emulated.writes(url_a) == []
            assert holder(client) == "someone-else"
