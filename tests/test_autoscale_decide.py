"""operator/autoscale.py's `recommend` and `decide` case by case: exact replicas, the
recommendation they report, and the reasons the operator writes into the ModelDeployment's
status (what a user reads to learn why a pool did or did not scale). Written against the
mutants `make mutate` found alive; each test names what it catches. `decide` takes the newest
observation and the window of earlier recommendations (the previous decision's `window`)."""

from __future__ import annotations

from pagefleet.operator.autoscale import (
    Decision,
    Observation,
    PoolReplicas,
    Recommendation,
    ScaleReason,
    decide,
    recommend,
)
from pagefleet.operator.spec import Autoscaling

SPEC = Autoscaling(
    mode="builtin",
    min_replicas=1,
    max_replicas=10,
    target_waiting_per_replica=4,
    scale_up_stabilization_s=0,
    scale_down_stabilization_s=300,
    max_scale_up_step=4,
)
FROM_ZERO = Autoscaling(**{**SPEC.__dict__, "min_replicas": 0})


def obs(waiting: float, pods: int, replicas: int, running: float = 0.0) -> Observation:
    return Observation(waiting=waiting, running=running, pods=pods, replicas=replicas)


def earlier(t: float, observation: Observation, spec: Autoscaling = SPEC) -> Recommendation:
    """What an evaluation at `t` of `observation` left in the window."""
    return Recommendation(t, recommend(observation, spec)[0])


def summary(decision: Decision) -> tuple[int, str, int]:
    return decision.replicas, decision.reason, decision.recommendation


def test_without_pod_metrics_the_current_replicas_hold_within_bounds():
    """No pod answered and nothing came before: hold, within [min, max]. Fails for: the
    clamp, the reason or the reported recommendation dropped or changed."""
    holding = "no pod metrics: holding"
    assert summary(decide(obs(0, 0, 0), (), PoolReplicas(0, 0), SPEC, 0.0)) == (
        1,
        "nothing waiting or queued with no pods -> 1",
        1,
    )
    assert summary(decide(obs(0, 0, 12), (), PoolReplicas(12, 12), SPEC, 0.0)) == (
        10,
        f"{holding} -> 10",
        10,
    )
    assert summary(decide(obs(0, 0, 3), (), PoolReplicas(3, 3), SPEC, 0.0)) == (
        3,
        f"{holding} -> 3",
        3,
    )


def test_recommendations_without_pod_metrics():
    """No pod answered: hold, unless the pool is at zero with requests waiting (the router
    holds them), then start enough pods. Fails for: `and` turned into `or` (scaling on a
    blind reading), a single waiting request not waking a pool at zero, reasons changed."""
    assert recommend(obs(40, pods=0, replicas=3), SPEC) == (
        3,
        "no pod metrics: holding",
        ScaleReason.NO_METRICS,
    )
    assert recommend(obs(0, pods=0, replicas=0), FROM_ZERO) == (
        0,
        "nothing waiting or queued with no pods",
        ScaleReason.IDLE_AT_ZERO,
    )
    woken = ScaleReason.WAKE
    assert recommend(obs(1, pods=0, replicas=0), FROM_ZERO) == (1, "1 waiting with no pods", woken)
    assert recommend(obs(9, pods=0, replicas=0), FROM_ZERO) == (3, "9 waiting with no pods", woken)


def test_recommendation_reasons_show_the_formula():
    """Fails for: the formula or the tolerance reason missing from the status."""
    replicas, why, cause = recommend(obs(30, pods=3, replicas=3, running=4), SPEC)
    assert (replicas, cause) == (8, ScaleReason.DEMAND)
    assert why == "30 waiting / 3 pods (target 4/pod, 4 running): ceil(3 x 10/4)=8"
    replicas, why, cause = recommend(obs(13, pods=3, replicas=3), SPEC)
    assert (replicas, why.endswith(": within tolerance")) == (3, True)
    assert cause == ScaleReason.WITHIN_TOLERANCE


def test_the_formula_never_recommends_zero_for_a_serving_pool():
    """Zero is the idle window's call: the formula keeps the last pod whether or not a
    request runs on it. Fails for: the floor of one dropped (a pool with minReplicas 0
    dropping its last pod between two requests, or under a running one)."""
    assert recommend(obs(0, pods=1, replicas=1, running=1), FROM_ZERO)[0] == 1
    assert recommend(obs(0, pods=1, replicas=1, running=0), FROM_ZERO)[0] == 1
    assert recommend(obs(0, pods=3, replicas=3, running=0), FROM_ZERO)[0] == 1


def test_a_plain_scale_up_reports_only_its_formula():
    """Fails for: notes added when nothing held, limited or clamped the decision (`and`
    turned into `or`, `>` into `>=`, the clamp test inverted), or the reported recommendation
    lost."""
    latest = obs(24, pods=2, replicas=2)  # 12/pod: ceil(2 x 3) = 6 = 2 + 4, the limit
    decision = decide(latest, (), PoolReplicas(2, 2), SPEC, 0.0)
    assert summary(decision) == (
        6,
        "24 waiting / 2 pods (target 4/pod, 0 running): ceil(2 x 12/4)=6 -> 6",
        6,
    )


def test_scale_up_notes_step_limit_and_unready_pods_in_order():
    """Fails for: the step limit off by one, the unready count wrong, notes joined wrongly."""
    latest = obs(80, pods=2, replicas=2)  # wants 10; +4 allowed
    decision = decide(latest, (), PoolReplicas(2, 2), SPEC, 0.0)
    assert decision.replicas == 6 and decision.recommendation == 10
    assert decision.reason.endswith("ceil(2 x 40/4)=20; step limited to +4 -> 6")
    waiting = decide(latest, (), PoolReplicas(3, 1), SPEC, 0.0)  # 2 of the last 3 not ready
    assert waiting.replicas == 3
    assert waiting.reason.endswith(
        "; step limited to +4; waiting for 2 pod(s) of the last step to be ready -> 3"
    )


def test_a_pool_at_its_floor_waiting_for_pods_is_not_noted_as_waiting():
    """desired equal to the floor is no scale-up: no note. Fails for: `>` turned into `>=`."""
    latest = obs(16, pods=4, replicas=4)  # 4/pod: exactly the target
    decision = decide(latest, (), PoolReplicas(4, 2), SPEC, 0.0)
    assert decision.replicas == 4 and "waiting for" not in decision.reason


def test_held_scale_down_and_held_scale_up_say_which_window():
    """Fails for: the held notes' conditions loosened (`<=`, `>=`, `or`) or their text lost."""
    window = (earlier(0, obs(40, pods=4, replicas=4)),)
    held = decide(obs(0, pods=4, replicas=4), window, PoolReplicas(4, 4), SPEC, 100.0)
    assert held.replicas == 4 and held.recommendation == 1
    assert "; scale-down held to 4 by the 300s window" in held.reason
    up_spec = Autoscaling(**{**SPEC.__dict__, "scale_up_stabilization_s": 60})
    window = (earlier(0, obs(0, pods=2, replicas=2), up_spec),)
    held_up = decide(obs(40, pods=2, replicas=2), window, PoolReplicas(2, 2), up_spec, 30.0)
    assert held_up.replicas == 2 and held_up.recommendation == 10
    assert "; scale-up held to 2 by the 60s window" in held_up.reason
    steady = decide(obs(8, pods=2, replicas=2), (), PoolReplicas(2, 2), SPEC, 0.0)
    assert "held" not in steady.reason and steady.replicas == 2


def test_recommendations_older_than_zero_length_windows_do_not_count():
    """Zero-length windows and earlier recommendations older than them: the latest
    recommendation decides. Fails for: the window's age test dropped or loosened (a 10 s old
    recommendation holding the pool)."""
    instant = Autoscaling(**{**SPEC.__dict__, "scale_down_stabilization_s": 0})
    stale = (earlier(0, obs(0, pods=2, replicas=2), instant),)  # 10 seconds old
    decision = decide(obs(40, pods=2, replicas=2), stale, PoolReplicas(2, 2), instant, 10.0)
    assert (decision.replicas, decision.recommendation) == (6, 10)
    stale = (earlier(0, obs(40, pods=4, replicas=4), instant),)
    down = decide(obs(0, pods=4, replicas=4), stale, PoolReplicas(4, 4), instant, 10.0)
    assert (down.replicas, down.recommendation) == (1, 1)


def test_a_scale_down_that_goes_through_is_not_noted_as_held():
    """Fails for: the held-down note added when the decision reached the recommendation."""
    instant = Autoscaling(**{**SPEC.__dict__, "scale_down_stabilization_s": 0})
    decision = decide(obs(4, pods=4, replicas=4), (), PoolReplicas(4, 4), instant, 0.0)
    assert decision.replicas == 1 and "held" not in decision.reason


IDLE_S = 300.0
TO_ZERO = Autoscaling(
    **{
        **SPEC.__dict__,
        "min_replicas": 0,
        "scale_up_stabilization_s": 60,
        "scale_to_zero_idle_s": IDLE_S,
    }
)


def at_zero(queued: float, queue_read: bool = True) -> Observation:
    """A pool at 0 replicas: no engine to read, only the router's queue."""
    return Observation(0.0, 0.0, pods=0, replicas=0, queued=queued, queue_read=queue_read)


def test_a_pool_at_zero_wakes_at_once_on_the_routers_queue():
    """One request held at the router wakes a pool at 0 to its first replica in the same
    evaluation, even with an up-window and a window full of zeros. Catches the one-way trip
    (a pool at 0 read "no pod metrics: holding" forever) and a cold start delayed by the
    up-window."""
    zeros = tuple(Recommendation(t, 0) for t in (0.0, 15.0, 30.0))
    woken = decide(at_zero(1), zeros, PoolReplicas(0, 0), TO_ZERO, 45.0)
    assert summary(woken) == (1, "0 waiting + 1 queued with no pods -> 1", 1)
    assert woken.idle_since is None


def test_pods_on_their_way_out_do_not_wake_a_pool_at_zero():
    """Just after a scale to zero the pool's pod may still be listed, Ready and answering,
    until the ReplicaSet deletes it. Fails for: the formula keeping "the last pod" of a pool
    at zero (it wakes again at once, and flaps), or demand on it not waking the pool."""
    leaving = Observation(0.0, 0.0, pods=1, replicas=0)
    assert decide(leaving, (), PoolReplicas(0, 0), TO_ZERO, 0.0).replicas == 0
    busy = Observation(5.0, 1.0, pods=1, replicas=0)
    assert decide(busy, (), PoolReplicas(0, 0), TO_ZERO, 0.0).replicas == 2  # ceil(5/4)


def test_a_pool_at_zero_stays_there_while_nothing_is_queued():
    """Fails for: a pool at 0 woken by nothing, or by a router that did not answer."""
    idle = decide(at_zero(0), (), PoolReplicas(0, 0), TO_ZERO, 0.0)
    assert summary(idle) == (0, "nothing waiting or queued with no pods -> 0", 0)
    blind = decide(at_zero(0, queue_read=False), (), PoolReplicas(0, 0), TO_ZERO, 0.0)
    assert summary(blind) == (0, "no pod metrics: holding -> 0", 0)


def test_a_burst_at_zero_wakes_to_the_target_per_replica_within_max():
    """A burst wakes to ceil(queued / target), bounded by maxReplicas and the step limit.
    Fails for: waking to one pod for any burst, or to more than the target asks, or past
    maxReplicas."""
    wide = Autoscaling(**{**TO_ZERO.__dict__, "max_scale_up_step": 100})
    assert decide(at_zero(9), (), PoolReplicas(0, 0), wide, 0.0).replicas == 3  # ceil(9/4)
    assert decide(at_zero(8), (), PoolReplicas(0, 0), wide, 0.0).replicas == 2
    assert decide(at_zero(1000), (), PoolReplicas(0, 0), wide, 0.0).replicas == 10
    stepped = decide(at_zero(1000), (), PoolReplicas(0, 0), TO_ZERO, 0.0)
    assert stepped.replicas == 4 and "step limited to +4" in stepped.reason


def serving(waiting=0.0, running=0.0, queued=0.0, pods=1, queue_read=True) -> Observation:
    return Observation(waiting, running, pods, 1, queued, queue_read)


def run_idle(observations: list[Observation], spec: Autoscaling = TO_ZERO) -> list[Decision]:
    """Evaluations every 15 s of a 1-replica pool, carrying window and idle start along."""
    decisions, window, idle, replicas = [], (), None, 1
    for i, observation in enumerate(observations):
        pool = PoolReplicas(replicas, replicas)
        if replicas == 0:
            observation = at_zero(observation.queued)
        decision = decide(observation, window, pool, spec, i * 15.0, idle)
        decisions.append(decision)
        window, idle, replicas = decision.window, decision.idle_since, decision.replicas
    return decisions


def test_zero_comes_only_after_a_whole_idle_window():
    """Idle from t=0: 1 replica through t=285 s, 0 at t=300 s (scaleToZeroIdleSeconds), and
    0 after. Fails for: zero before the window (the formula's own 0, or the scale-down
    window), or never."""
    decisions = run_idle([serving()] * 25)
    replicas = [d.replicas for d in decisions]
    assert replicas == [1] * 20 + [0] * 5
    assert decisions[20].reason == (
        "nothing running, waiting or queued for 300s (scaleToZeroIdleSeconds 300) -> 0"
    )
    assert all(d.idle_since == 0.0 for d in decisions[:21])
    kept = Autoscaling(**{**TO_ZERO.__dict__, "min_replicas": 1})
    assert {d.replicas for d in run_idle([serving()] * 40, kept)} == {1}


def test_never_to_zero_while_anything_is_in_flight():
    """Long idle before, then one reading of anything in flight (running, waiting, queued at
    the router), or a reading that cannot tell (the router or every engine unread): not 0,
    and the idle window starts over. Fails for: any of the four sources ignored, or an
    interruption that does not restart the window."""
    busy = [
        serving(running=1),
        serving(waiting=1),
        serving(queued=1),
        serving(queue_read=False),
        serving(pods=0),
    ]
    for interruption in busy:
        trace = [serving()] * 19 + [interruption] + [serving()] * 21
        decisions = run_idle(trace)
        assert decisions[19].replicas == 1 and decisions[19].idle_since is None, interruption
        replicas = [d.replicas for d in decisions]
        # Idle again from t=300 s (step 20): zero one whole window later, at step 40.
        assert replicas[:40] == [1] * 40 and replicas[40] == 0, interruption


def test_the_routers_queue_counts_as_waiting_on_a_serving_pool():
    """Requests held at the router (all engines saturated) are demand like the engines' own
    queues. Fails for: a saturated pool that never grows because its engines' queues are
    capped."""
    saturated = Observation(waiting=0, running=16, pods=2, replicas=2, queued=16)
    replicas, why, _ = recommend(saturated, SPEC)
    assert replicas == 4
    assert why == "0 waiting + 16 queued / 2 pods (target 4/pod, 16 running): ceil(2 x 8/4)=4"


def test_each_decision_names_its_cause_from_the_closed_set():
    """The one word the operator's metrics label a pool's desired replicas with: the last
    limit a decision met, else what the queues said. Fails for: a limit that changed the
    number not named (a pool at maxReplicas graphed as plain demand), or one named that did
    not change it."""
    up_window = Autoscaling(**{**SPEC.__dict__, "scale_up_stabilization_s": 60})
    window = (earlier(0, obs(40, pods=4, replicas=4)),)
    quiet_window = (earlier(0, obs(0, pods=2, replicas=2), up_window),)
    idle = decide(obs(0, 1, 1), (), PoolReplicas(1, 1), FROM_ZERO, 0.0, idle_since=-IDLE_S)
    cases = {
        ScaleReason.DEMAND: decide(obs(24, 2, 2), (), PoolReplicas(2, 2), SPEC, 0.0),
        ScaleReason.WITHIN_TOLERANCE: decide(obs(13, 3, 3), (), PoolReplicas(3, 3), SPEC, 0.0),
        ScaleReason.LAST_POD_KEPT: decide(obs(0, 1, 1), (), PoolReplicas(1, 1), FROM_ZERO, 0.0),
        ScaleReason.NO_METRICS: decide(obs(0, 0, 3), (), PoolReplicas(3, 3), SPEC, 0.0),
        ScaleReason.WAKE: decide(at_zero(1), (), PoolReplicas(0, 0), TO_ZERO, 0.0),
        ScaleReason.IDLE_AT_ZERO: decide(at_zero(0), (), PoolReplicas(0, 0), TO_ZERO, 0.0),
        ScaleReason.SCALE_TO_ZERO: idle,
        ScaleReason.STABILIZATION: decide(obs(0, 4, 4), window, PoolReplicas(4, 4), SPEC, 100.0),
        ScaleReason.STEP_LIMIT: decide(obs(80, 2, 2), (), PoolReplicas(2, 2), SPEC, 0.0),
        ScaleReason.BOUNDS: decide(obs(400, 8, 8), (), PoolReplicas(8, 8), SPEC, 0.0),
        ScaleReason.PODS_NOT_READY: decide(obs(80, 2, 2), (), PoolReplicas(3, 1), SPEC, 0.0),
    }
    assert {reason: d.cause for reason, d in cases.items()} == {r: r for r in cases}
    held_up = decide(obs(40, 2, 2), quiet_window, PoolReplicas(2, 2), up_window, 30.0)
    assert held_up.cause == ScaleReason.STABILIZATION
    # At zero with minReplicas 1: the bound wakes the pool, not demand.
    assert decide(at_zero(0), (), PoolReplicas(0, 0), SPEC, 0.0).cause == ScaleReason.BOUNDS
    # A burst at zero is a wake, however the step limit or maxReplicas bounded it.
    burst = decide(at_zero(1000), (), PoolReplicas(0, 0), TO_ZERO, 0.0)
    assert (burst.replicas, burst.cause) == (4, ScaleReason.WAKE)
    assert "step limited" in burst.reason
