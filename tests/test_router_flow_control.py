"""Router flow control (router/flow_control.py and its use in router/app.py): requests held while
no engine can take them, released in a fair order as capacity appears, refused with 503 +
Retry-After when the queue is full or their deadline passes, and taken out at once when their
client leaves. The pure queue first, then a real `pagefleet router` over scripted fake engines
(tests/fake_engine.py). Each test names what it catches."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from fake_engine import FakeEngine, wait_scraped
from pagefleet.router.flow_control import (
    OTHER_MODEL,
    OVERFLOW_TENANT,
    SHARED_TENANT,
    FairQueue,
    FlowConfig,
    FlowControl,
    Held,
    tenant_of,
)
from pagefleet.router.scoring import Candidate, Pod
from server_utils import metric_value, running_router, wait_until


def held(tenant: str, at: float = 0.0, timeout: float = 10.0) -> Held:
    return Held("m", tenant, at, at + timeout, f"{tenant}@{at}")


def drain(queue: FairQueue) -> list[str]:
    order = []
    while (item := queue.pop()) is not None:
        order.append(item.waiter)
    return order


def test_round_robin_across_tenants_in_the_order_they_came_fifo_within_one():
    """Tenant a queues three, then b one: a1, b1, a2, a3. Catches plain FIFO (b waits behind
    all of a's), LIFO within a tenant, and a turn order that is not the arrival order."""
    queue = FairQueue(capacity=10, max_tenants=8)
    for i, tenant in enumerate(["a", "a", "a", "b", "c", "b"]):
        assert queue.push(held(tenant, at=float(i)))
    assert len(queue) == 6 and queue.tenants == 3
    assert drain(queue) == ["a@0.0", "b@3.0", "c@4.0", "a@1.0", "b@5.0", "a@2.0"]
    assert len(queue) == 0 and queue.tenants == 0


def test_the_queue_is_bounded_and_remove_and_expire_keep_the_count():
    """Catches a queue past its capacity, a removed or expired request still counted (the
    queue would refuse forever), or an expired request left to be released."""
    queue = FairQueue(capacity=3, max_tenants=8)
    first, second, third = held("a", 0.0, 5.0), held("b", 1.0, 5.0), held("a", 2.0, 5.0)
    assert all(queue.push(item) for item in (first, second, third))
    assert not queue.push(held("c", 3.0))
    assert queue.oldest() == 0.0
    assert queue.remove(second) and not queue.remove(second)
    assert queue.push(held("c", 3.0, 5.0))
    assert queue.expire(now=5.0) == [first]  # its deadline, 5.0, has come
    assert queue.oldest() == 2.0 and len(queue) == 2
    assert [i.enqueued_at for i in queue.expire(now=100.0)] == [2.0, 3.0]
    assert len(queue) == 0 and queue.oldest() is None and queue.pop() is None


def test_a_client_cannot_grow_the_tenants_tracked_or_the_models_labelled():
    """The tenant header and the model field are the client's: thousands of distinct values
    must not grow the router's memory or its metric series. Catches a tenant per value held
    without bound, a header kept as sent, and a model label per name."""
    queue = FairQueue(capacity=1000, max_tenants=4)
    for i in range(500):
        assert queue.push(held(tenant_of(f"tenant-{i}", None), float(i)))
    assert queue.tenants == 5  # four, and the overflow tenant the rest share
    assert sum(1 for _ in drain(queue)) == 500
    assert len(tenant_of("x" * 100_000, None)) < 32
    assert tenant_of(None, "Bearer k1") != tenant_of(None, "Bearer k2")
    assert tenant_of(None, "Bearer k1") != tenant_of("k1", None)
    assert tenant_of(None, None) == tenant_of("", "Basic abc") == SHARED_TENANT
    overflow = FairQueue(capacity=10, max_tenants=1)
    overflow.push(held("a"))
    late = held("b")
    overflow.push(late)
    assert late.tenant == OVERFLOW_TENANT and overflow.remove(late)

    flow = FlowControl(FlowConfig(queue_size=2, max_models=3), model=None)
    labels = {flow.label(f"model-{i}") for i in range(3)}
    for i in range(200):
        flow.hold(f"model-{i}", "t", None, now=0.0)
    assert len(flow.queues) <= 4 and set(flow.queues) <= labels | {OTHER_MODEL}
    assert flow.label("m" * 1000) == OTHER_MODEL


def pod(name: str, waiting: float = 0.0, kv: float = 0.0) -> Pod:
    return Pod(name, f"http://{name}", waiting=waiting, kv_usage=kv)


def candidates(*pods: Pod) -> list[Candidate]:
    return [Candidate(p, 1.0, {}) for p in pods]


def test_hold_without_engines_or_when_all_saturated_and_release_within_headroom():
    """Catches: holding while an engine has room, not holding when every engine is
    saturated, a newcomer overtaking held requests, a release beyond the engines' headroom
    (a herd onto a waking pod), and the deadline not refusing."""
    flow = FlowControl(FlowConfig(queue_size=8, queue_timeout=10, saturation_waiting=4), "m")
    busy, calm = pod("busy", waiting=4), pod("calm", waiting=2.5)
    assert flow.must_hold("m", [])
    assert flow.must_hold("m", candidates(busy))
    assert not flow.must_hold("m", candidates(busy, calm))
    items = [flow.hold("m", f"t{i}", None, now=float(i)) for i in range(4)]
    assert flow.must_hold("m", candidates(calm)), "a newcomer must queue behind held requests"
    assert flow.stats(now=5.0) == {"m": (4, 5.0)}
    # calm has room for 2 more before the threshold (ceil(4 - 2.5)); busy none
    settled = flow.settle(now=5.0, ready_of=lambda label: [busy, calm])
    assert settled.released == items[:2] and settled.expired == []
    assert flow.settle(now=5.0, ready_of=lambda label: [busy]).released == []
    assert flow.settle(now=12.5, ready_of=lambda label: []).expired == items[2:3]
    assert flow.stats(now=12.5) == {"m": (1, 9.5)} and flow.held == 1
    assert flow.leave(items[3]) and not flow.leave(items[3]) and flow.held == 0
    assert not flow.must_hold("m", candidates(calm))
    assert flow.stats(now=13.0) == {"m": (0, 0.0)}


def test_without_a_saturation_rule_a_ready_engine_releases_everything_and_zero_disables():
    """Catches waking only part of the queue when a pool comes back (the rest would wait for
    nothing), a saturation rule applied when none was set, and --queue-size 0 holding."""
    flow = FlowControl(FlowConfig(queue_size=8), "m")
    for _ in range(5):
        flow.hold("m", "t", None, now=0.0)
    assert not flow.must_hold("other", candidates(pod("x", waiting=1e6, kv=1.0)))
    assert len(flow.settle(now=1.0, ready_of=lambda label: [pod("x")]).released) == 5
    kv_only = FlowControl(FlowConfig(saturation_kv=0.9), "m")
    assert kv_only.must_hold("m", candidates(pod("full", kv=0.95)))
    assert not kv_only.must_hold("m", candidates(pod("full", kv=0.95), pod("ok", kv=0.5)))
    off = FlowControl(FlowConfig(queue_size=0), "m")
    assert not off.must_hold("m", []) and not off.enabled


@pytest.mark.parametrize(
    "bad",
    [
        {"queue_size": -1},
        {"queue_timeout": 0},
        {"saturation_waiting": 0},
        {"saturation_kv": 1.5},
        {"max_tenants": 0},
    ],
)
def test_flow_settings_out_of_range_are_refused(bad):
    with pytest.raises(ValueError):
        FlowConfig(**bad)


# --- a real router over fake engines --------------------------------------------------------


def queued(router: str) -> float:
    return metric_value(router, "pagefleet_router:queued_requests", {"model": "tiny"})


def rejections(router: str, reason: str) -> float:
    labels = {"model": "tiny", "reason": reason}
    return metric_value(router, "pagefleet_router:queue_rejections_total", labels)


def wait_ejected(router: str) -> None:
    """Until the router's scrapes have ejected the (down) engine: no engine is ready."""
    wait_until(
        lambda: metric_value(router, "pagefleet_router:ejections_total") >= 1,
        timeout=30,
        what="the down engine's ejection",
    )


def post_in_background(router: str, results: list, tenant: str | None = None, prompt="hi"):
    headers = {"x-tenant-id": tenant} if tenant else {}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}

    def send():
        r = httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=60)
        results.append(r)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def complete(router: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **body}
    return httpx.post(f"{router}/v1/completions", json=body, timeout=60)


def test_a_request_held_at_zero_engines_is_served_when_one_comes_up_and_a_full_queue_refuses():
    """The pool is down (its only engine ejected): the router is still ready, the gauge reads
    0, then the request is held (gauge 1, age > 0) while a second one finds the queue full
    (503 + Retry-After at once, counted); the engine comes up and the held one is answered
    (none lost), gauge back to 0. Catches the old 503 "no engine can serve", a request lost
    or answered twice, a gauge absent or stuck at zero engines, and an unbounded queue."""
    engine = FakeEngine("late")
    flags = ("--model", "tiny", "--queue-size", "1", "--scrape-interval", "0.05")
    with running_router("--endpoints", engine.url, *flags) as (router, _):
        wait_ejected(router)
        assert httpx.get(f"{router}/health", timeout=5).status_code == 200
        assert queued(router) == 0 and rejections(router, "full") == 0
        results: list[httpx.Response] = []
        thread = post_in_background(router, results)
        wait_until(lambda: queued(router) == 1, what="the request held")
        age = "pagefleet_router:oldest_queued_seconds"
        wait_until(lambda: metric_value(router, age, {"model": "tiny"}) > 0, what="its age")
        full = complete(router)
        assert full.status_code == 503, full.text
        assert full.headers["retry-after"].isdigit()
        assert full.json()["error"]["type"] == "service_unavailable"
        assert rejections(router, "full") == 1
        with engine:
            thread.join(timeout=60)
            assert [r.status_code for r in results] == [200], [r.text for r in results]
            assert results[0].json()["id"] == "late"
            assert len(engine.received) == 1
            assert queued(router) == 0
            assert metric_value(router, "pagefleet_router:queue_wait_seconds_count") == 1


def test_a_held_request_past_its_deadline_gets_503_with_retry_after():
    """Catches a held request that waits forever (or for the client's own timeout), a refusal
    without Retry-After, and a deadline refusal not counted."""
    engine = FakeEngine("down")
    flags = ("--model", "tiny", "--queue-timeout", "0.5", "--scrape-interval", "0.05")
    with running_router("--endpoints", engine.url, *flags) as (router, _):
        wait_ejected(router)
        r = complete(router)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"].isdigit()
        assert "in time" in r.json()["error"]["message"]
        assert rejections(router, "deadline") == 1 and queued(router) == 0


def test_a_client_that_leaves_while_held_leaves_the_queue_and_never_reaches_an_engine():
    """The client closes its connection while held: the gauge drops back to 0 at once, and
    once the engine is up only a later request reaches it. Catches a departed client's
    request kept in the queue (it would be released to an engine, for nobody, and hold
    the queue's place until its deadline)."""
    engine = FakeEngine("late")
    flags = ("--model", "tiny", "--scrape-interval", "0.05")
    with running_router("--endpoints", engine.url, *flags) as (router, _):
        wait_ejected(router)
        payload = json.dumps({"model": "tiny", "prompt": "gone", "max_tokens": 4}).encode()
        host, port = router.removeprefix("http://").split(":")
        client = socket.create_connection((host, int(port)))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_until(lambda: queued(router) == 1, what="the request held")
        client.close()
        wait_until(lambda: queued(router) == 0, what="the departed client's request to leave")
        with engine:
            wait_scraped(engine)
            r = complete(router, prompt="stayed")
            assert r.status_code == 200, r.text
            assert [body["prompt"] for body in engine.received] == ["stayed"]


def test_held_requests_are_released_round_robin_across_tenants():
    """Tenant a holds three requests, then b one; with room for one request per release
    round (--saturation-waiting 1 over an idle engine), the engine receives a1, b1, a2, a3.
    Catches plain FIFO through the app (b would wait behind all of a's) and the tenant
    header ignored."""
    engine = FakeEngine("late")
    flags = ("--model", "tiny", "--saturation-waiting", "1", "--scrape-interval", "0.3")
    with running_router("--endpoints", engine.url, *flags) as (router, _):
        wait_ejected(router)
        results: list[httpx.Response] = []
        threads = []
        for i, (tenant, prompt) in enumerate([("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1")]):
            threads.append(post_in_background(router, results, tenant, prompt))
            wait_until(lambda n=i + 1: queued(router) == n, what=f"{prompt} held")
        with engine:
            for thread in threads:
                thread.join(timeout=60)
            assert [r.status_code for r in results] == [200] * 4
            assert [body["prompt"] for body in engine.received] == ["a1", "b1", "a2", "a3"]


def test_requests_wait_while_every_engine_is_saturated_and_go_once_one_has_room():
    """The only engine reports 5 waiting requests, over --saturation-waiting 2: a request is
    held, not sent; when the engine's queue drains it is released and answered. Catches the
    saturation rule ignored (the engine gets the request at once) or never lifted."""
    with FakeEngine("busy", waiting=5.0) as engine:
        flags = ("--model", "tiny", "--saturation-waiting", "2", "--scrape-interval", "0.05")
        with running_router("--endpoints", engine.url, *flags) as (router, _):
            wait_scraped(engine)
            results: list[httpx.Response] = []
            thread = post_in_background(router, results)
            wait_until(lambda: queued(router) == 1, what="the request held")
            wait_scraped(engine)  # more scrapes of a saturated engine release nothing
            assert engine.received == [] and queued(router) == 1
            engine.waiting = 0.0
            thread.join(timeout=60)
            assert [r.status_code for r in results] == [200]
            assert len(engine.received) == 1 and queued(router) == 0
