"""operator/autoscale.py's `recommend` and `decide` case by case: exact replicas, the
recommendation they report, and the reasons the operator writes into the ModelDeployment's
status (what a user reads to learn why a pool did or did not scale). Written against the
mutants `make mutate` found alive; each test names what it catches."""

from __future__ import annotations

from pagefleet.operator.autoscale import Decision, Observation, PoolReplicas, decide, recommend
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


def obs(t: float, waiting: float, pods: int, replicas: int, running: float = 0.0) -> Observation:
    return Observation(t, waiting=waiting, running=running, pods=pods, replicas=replicas)


def test_without_observations_the_current_replicas_hold_within_bounds():
    """Fails for: the clamp, the reason or the reported recommendation dropped or changed."""
    assert decide((), PoolReplicas(0, 0), SPEC, 0.0) == Decision(1, "no observations yet", 0)
    assert decide((), PoolReplicas(12, 12), SPEC, 0.0) == Decision(10, "no observations yet", 12)
    assert decide((), PoolReplicas(3, 3), SPEC, 0.0) == Decision(3, "no observations yet", 3)


def test_recommendations_without_pod_metrics():
    """No pod answered: hold, unless the pool is at zero with requests waiting (the router
    holds them), then start enough pods. Fails for: `and` turned into `or` (scaling on a
    blind reading), a single waiting request not waking a pool at zero, reasons changed."""
    assert recommend(obs(0, 40, pods=0, replicas=3), SPEC) == (3, "no pod metrics: holding")
    assert recommend(obs(0, 0, pods=0, replicas=0), FROM_ZERO) == (0, "no pod metrics: holding")
    assert recommend(obs(0, 1, pods=0, replicas=0), FROM_ZERO) == (1, "1 waiting with no pods")
    assert recommend(obs(0, 9, pods=0, replicas=0), FROM_ZERO) == (3, "9 waiting with no pods")


def test_recommendation_reasons_show_the_formula():
    """Fails for: the formula or the tolerance reason missing from the status."""
    replicas, why = recommend(obs(0, 30, pods=3, replicas=3, running=4), SPEC)
    assert replicas == 8
    assert why == "30 waiting / 3 pods (target 4/pod, 4 running): ceil(3 x 10/4)=8"
    replicas, why = recommend(obs(0, 13, pods=3, replicas=3), SPEC)
    assert (replicas, why.endswith(": within tolerance")) == (3, True)


def test_the_last_running_pod_is_kept_for_a_single_running_request():
    """Fails for: the guard needing more than one running request."""
    assert recommend(obs(0, 0, pods=1, replicas=1, running=1), FROM_ZERO)[0] == 1
    assert recommend(obs(0, 0, pods=1, replicas=1, running=0), FROM_ZERO)[0] == 0


def test_a_plain_scale_up_reports_only_its_formula():
    """Fails for: notes added when nothing held, limited or clamped the decision (`and`
    turned into `or`, `>` into `>=`, the clamp test inverted), or the reported recommendation
    lost."""
    history = (obs(0, 24, pods=2, replicas=2),)  # 12/pod: ceil(2 x 3) = 6 = 2 + 4, the limit
    decision = decide(history, PoolReplicas(2, 2), SPEC, 0.0)
    assert decision == Decision(
        6, "24 waiting / 2 pods (target 4/pod, 0 running): ceil(2 x 12/4)=6 -> 6", 6
    )


def test_scale_up_notes_step_limit_and_unready_pods_in_order():
    """Fails for: the step limit off by one, the unready count wrong, notes joined wrongly."""
    history = (obs(0, 80, pods=2, replicas=2),)  # wants 10; +4 allowed
    decision = decide(history, PoolReplicas(2, 2), SPEC, 0.0)
    assert decision.replicas == 6 and decision.recommendation == 10
    assert decision.reason.endswith("ceil(2 x 40/4)=20; step limited to +4 -> 6")
    waiting = decide(history, PoolReplicas(3, 1), SPEC, 0.0)  # 2 of the last 3 not ready
    assert waiting.replicas == 3
    assert waiting.reason.endswith(
        "; step limited to +4; waiting for 2 pod(s) of the last step to be ready -> 3"
    )


def test_a_pool_at_its_floor_waiting_for_pods_is_not_noted_as_waiting():
    """desired equal to the floor is no scale-up: no note. Fails for: `>` turned into `>=`."""
    history = (obs(0, 16, pods=4, replicas=4),)  # 4/pod: exactly the target
    decision = decide(history, PoolReplicas(4, 2), SPEC, 0.0)
    assert decision.replicas == 4 and "waiting for" not in decision.reason


def test_held_scale_down_and_held_scale_up_say_which_window():
    """Fails for: the held notes' conditions loosened (`<=`, `>=`, `or`) or their text lost."""
    down = (obs(0, 40, pods=4, replicas=4), obs(100, 0, pods=4, replicas=4))
    held = decide(down, PoolReplicas(4, 4), SPEC, 100.0)
    assert held.replicas == 4 and held.recommendation == 1
    assert "; scale-down held to 4 by the 300s window" in held.reason
    up_spec = Autoscaling(**{**SPEC.__dict__, "scale_up_stabilization_s": 60})
    up = (obs(0, 0, pods=2, replicas=2), obs(30, 40, pods=2, replicas=2))
    held_up = decide(up, PoolReplicas(2, 2), up_spec, 30.0)
    assert held_up.replicas == 2 and held_up.recommendation == 10
    assert "; scale-up held to 2 by the 60s window" in held_up.reason
    steady = decide((obs(0, 8, pods=2, replicas=2),), PoolReplicas(2, 2), SPEC, 0.0)
    assert "held" not in steady.reason and steady.replicas == 2


def test_windows_with_no_observation_in_them_fall_back_to_the_latest():
    """Zero-length windows and an observation older than them: the latest recommendation
    decides. Fails for: an empty window's min/max taken without a default."""
    instant = Autoscaling(**{**SPEC.__dict__, "scale_down_stabilization_s": 0})
    stale = (obs(0, 40, pods=2, replicas=2),)  # 10 seconds old at decision time
    decision = decide(stale, PoolReplicas(2, 2), instant, 10.0)
    assert (decision.replicas, decision.recommendation) == (6, 10)
    down = decide((obs(0, 0, pods=4, replicas=4),), PoolReplicas(4, 4), instant, 10.0)
    assert (down.replicas, down.recommendation) == (1, 1)


def test_a_scale_down_that_goes_through_is_not_noted_as_held():
    """Fails for: the held-down note added when the decision reached the recommendation."""
    instant = Autoscaling(**{**SPEC.__dict__, "scale_down_stabilization_s": 0})
    decision = decide((obs(0, 4, pods=4, replicas=4),), PoolReplicas(4, 4), instant, 0.0)
    assert decision.replicas == 1 and "held" not in decision.reason
