"""The builtin autoscaler as a simulation: step, ramp, noisy square wave and spike queue traces
against the pure decision, asserting the replica traces users rely on."""

from __future__ import annotations

import itertools
import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.operator.autoscale import (
    Observation,
    PoolReplicas,
    Recommendation,
    decide,
    recommend,
    window_from_status,
    window_to_status,
)
from pagefleet.operator.simulate import (
    direction_changes,
    plain_hpa,
    simulate_load,
    simulate_queue,
    summarize,
)
from pagefleet.operator.spec import Autoscaling

PERIOD = 15.0
SPEC = Autoscaling(mode="builtin", min_replicas=1, max_replicas=10, target_waiting_per_replica=4)


def first_change(steps):
    return next(s for s in steps if s.replicas != steps[0].replicas)


def test_formula_and_tolerance():
    obs = Observation(waiting=30.0, running=4.0, pods=3, replicas=3)
    assert recommend(obs, SPEC)[0] == 8  # ceil(3 x (30/3)/4) = ceil(7.5)
    within = Observation(waiting=13.0, running=4.0, pods=3, replicas=3)  # 4.33/pod: +8%
    assert recommend(within, SPEC)[0] == 3
    outside = Observation(waiting=14.0, running=4.0, pods=3, replicas=3)  # 4.67/pod: +17%
    assert recommend(outside, SPEC)[0] == 4


def test_step_reacts_within_one_period_after_the_up_window():
    onset = 60.0
    trace = [0.0] * 4 + [40.0] * 20  # 40 waiting from t=60 s
    steps = simulate_queue(trace, SPEC, replicas=1)
    reaction = first_change(steps)
    assert reaction.time == onset and reaction.replicas == 5  # +4: the default step limit
    assert steps[-1].replicas == 10  # ceil(40/4), reached by successive steps
    windowed = Autoscaling(**{**SPEC.__dict__, "scale_up_stabilization_s": 60})
    steps = simulate_queue(trace, windowed, replicas=1)
    reaction = first_change(steps)
    assert onset + 60 <= reaction.time <= onset + 60 + PERIOD


def test_ramp_respects_step_limit_and_max():
    trace = [4.0 * i for i in range(40)]  # +4 waiting every 15 s, up to 156
    spec = Autoscaling(**{**SPEC.__dict__, "max_scale_up_step": 2})
    steps = simulate_queue(trace, spec, replicas=1)
    replicas = [s.replicas for s in steps]
    assert all(b - a <= 2 for a, b in zip([1, *replicas], replicas, strict=False))
    assert replicas == sorted(replicas), "a rising queue never scales down"
    assert max(replicas) == 10 and all(r >= 1 for r in replicas)


def test_noisy_square_wave_does_not_flap():
    rng = random.Random(7)
    # 2 minutes at 32 waiting, 2 minutes idle, with +-15% noise, for an hour.
    trace = [
        (32.0 if (i * PERIOD) % 240 < 120 else 0.0) * rng.uniform(0.85, 1.15) for i in range(240)
    ]
    steps = simulate_queue(trace, SPEC, replicas=1)
    changes = [
        steps[i].time
        for i in range(1, len(steps) - 1)
        if direction_changes([steps[i - 1].replicas, steps[i].replicas, steps[i + 1].replicas])
    ]
    window = SPEC.scale_down_stabilization_s
    assert all(b - a >= window for a, b in itertools.pairwise(changes)), changes
    assert min(s.replicas for s in steps[10:]) == 8, "the lulls never last a whole window"
    # Without windows the same trace flaps at every edge: the windows are what prevents it.
    plain = simulate_queue(trace, SPEC, replicas=1, controller=plain_hpa)
    assert direction_changes([s.replicas for s in plain]) >= 20


def test_spike_scales_up_then_down_after_the_window():
    trace = [0.0] * 2 + [100.0] + [0.0] * 40
    steps = simulate_queue(trace, SPEC, replicas=1)
    assert steps[2].replicas == 5  # immediate, step-limited
    up_at = steps[2].time
    down = next(s for s in steps if s.time > up_at and s.replicas != 5)
    assert down.replicas == 1
    assert up_at + SPEC.scale_down_stabilization_s < down.time
    assert down.time <= up_at + SPEC.scale_down_stabilization_s + PERIOD


def test_no_further_scale_up_while_pods_are_pending():
    trace = [80.0] * 60
    steps = simulate_queue(trace, SPEC, replicas=1, start_delay=90.0)
    previous = 1
    increases = 0
    for step in steps:
        if step.replicas > previous:
            increases += 1
            assert step.ready == previous, f"scaled up at {step.time} with pods pending"
        previous = step.replicas
    assert increases >= 2 and steps[-1].replicas == 10
    held = next(s for s in steps if "to be ready" in s.reason)
    assert held.replicas == 5


def test_scale_to_zero_and_back():
    """An idle pool goes to 0 one idle window (not the scale-down window) after it was first
    seen idle, stays there while nothing waits, and wakes to ceil(demand / target) at once."""
    spec = Autoscaling(
        **{
            **SPEC.__dict__,
            "min_replicas": 0,
            "scale_down_stabilization_s": 30,
            "scale_to_zero_idle_s": 60,
        }
    )
    running = Observation(waiting=0.0, running=2.0, pods=1, replicas=1)
    assert decide(running, (), PoolReplicas(1, 1), spec, 0.0).replicas == 1  # still running
    steps = simulate_queue([0.0] * 8 + [9.0] * 2, spec, replicas=1)
    assert [s.replicas for s in steps[:8]] == [1, 1, 1, 1, 0, 0, 0, 0]  # idle since t=0
    assert steps[4].time == 60.0 and "scaleToZeroIdleSeconds 60" in steps[4].reason
    assert steps[8].replicas == 3  # ceil(9/4) with no pods to average over


@settings(max_examples=60, deadline=None)
@given(
    trace=st.lists(st.floats(0, 500), min_size=1, max_size=60),
    low=st.integers(0, 3),
    span=st.integers(0, 8),
    step=st.integers(1, 5),
    delay=st.sampled_from([0.0, 30.0, 120.0]),
)
def test_bounds_and_step_limit_hold_for_any_trace(trace, low, span, step, delay):
    spec = Autoscaling(
        mode="builtin",
        min_replicas=low,
        max_replicas=max(1, low + span),
        max_scale_up_step=step,
        scale_down_stabilization_s=60,
    )
    start = max(1, low)
    steps = simulate_queue(trace, spec, replicas=start, start_delay=delay)
    previous = start
    for s in steps:
        assert spec.min_replicas <= s.replicas <= spec.max_replicas
        assert s.replicas - previous <= step
        previous = s.replicas


def test_load_model_defaults_beat_plain_hpa_on_flapping():
    """A closed loop (queue = unserved load) with a 2-minute pod start: the defaults change
    direction less than the plain formula; both keep up with a sustained load."""
    arrivals = [20.0 if (i // 8) % 2 == 0 else 2.0 for i in range(160)]  # 2-min bursts
    ours = simulate_load(arrivals, service_rate=4.0, spec=SPEC, replicas=1)
    plain = simulate_load(arrivals, 4.0, SPEC, replicas=1, controller=plain_hpa)
    a, b = summarize(ours, SPEC, PERIOD), summarize(plain, SPEC, PERIOD)
    assert a.direction_changes < b.direction_changes
    assert a.max_replicas <= SPEC.max_replicas


def _run(spec, queues, replicas, start, window, restart_at=None):
    """Evaluations every PERIOD from `start` (wall clock) over a pool whose pods are all ready;
    at `restart_at` the window goes through the status (as a restarted operator reads it)."""
    decisions = []
    for i, queue in enumerate(queues):
        now = start + i * PERIOD
        if i == restart_at:
            stored = json.loads(json.dumps(window_to_status(window)))
            window = window_from_status(stored, now, replicas)
        observation = Observation(waiting=queue, running=0.0, pods=replicas, replicas=replicas)
        decision = decide(observation, window, PoolReplicas(replicas, replicas), spec, now)
        decisions.append(decision.replicas)
        window, replicas = decision.window, decision.replicas
    return decisions


def test_a_restart_in_a_lull_keeps_the_scale_down_window():
    """Catches an autoscaler whose window lives in memory only: restarted in a lull, it took
    8 replicas to 1 at once. Through the status, the restarted operator decides exactly as an
    uninterrupted one: the pool goes down one window after the load stopped, not earlier."""
    spec = Autoscaling(mode="builtin", min_replicas=1, max_replicas=8, max_scale_up_step=8)
    queues = [64.0] * 6 + [0.0] * 40  # 8 replicas' worth, then nothing
    start = 1_760_000_000.25  # wall-clock seconds, not on a whole second
    steady = _run(spec, queues, 1, start, ())
    assert steady[5] == 8 and steady[-1] == 1
    down_at = steady.index(1, 6)
    assert (down_at - 5) * PERIOD > spec.scale_down_stabilization_s
    for restart in (6, 8, down_at - 1):
        assert _run(spec, queues, 1, start, (), restart_at=restart) == steady, restart


def test_nothing_recorded_seeds_the_window_with_the_current_replicas():
    """As the HPA does after a controller restart: with no window in status (first start of
    this version, status lost), the current replicas count as recommended now."""
    spec = Autoscaling(mode="builtin", min_replicas=1, max_replicas=8)
    now = 1_760_000_000.0
    window = window_from_status(None, now, 8)
    assert window == (Recommendation(now, 8),)
    idle = Observation(waiting=0.0, running=0.0, pods=8, replicas=8)
    held = decide(idle, window, PoolReplicas(8, 8), spec, now + PERIOD)
    assert held.replicas == 8 and "scale-down held" in held.reason
    later = now + spec.scale_down_stabilization_s + PERIOD
    assert decide(idle, held.window, PoolReplicas(8, 8), spec, later).replicas == 1
    # What a user or another writer left there does not break the operator.
    junk = [{"time": "yesterday", "replicas": 3}, {"replicas": 2}, 5, {"time": None}]
    assert window_from_status(junk, now, 8) == ()
    # A time ahead of this clock (another node's) counts as now, never later.
    ahead = [{"time": "2099-01-01T00:00:00Z", "replicas": 4}]
    assert window_from_status(ahead, now, 8) == (Recommendation(now, 4),)


@settings(max_examples=80, deadline=None)
@given(
    queues=st.lists(st.floats(0, 200), min_size=1, max_size=50),
    ready_lag=st.lists(st.integers(0, 3), min_size=50, max_size=50),
    up_window=st.sampled_from([0, 30, 60]),
    down_window=st.sampled_from([0, 45, 300]),
    low=st.integers(0, 2),
    step=st.integers(1, 4),
)
def test_the_kept_window_decides_as_the_whole_history(
    queues, ready_lag, up_window, down_window, low, step
):
    """`decide` keeps only the recommendations that can still matter (what status holds); its
    decisions equal those over every recommendation of the windows, for any trace."""
    spec = Autoscaling(
        mode="builtin",
        min_replicas=low,
        max_replicas=low + 6,
        max_scale_up_step=step,
        scale_up_stabilization_s=up_window,
        scale_down_stabilization_s=down_window,
    )
    keep = max(up_window, down_window)
    kept: tuple[Recommendation, ...] = ()
    everything: tuple[Recommendation, ...] = ()
    replicas = max(1, low)
    for i, queue in enumerate(queues):
        now = i * PERIOD
        ready = max(0, replicas - ready_lag[i])
        observation = Observation(queue, 0.0, ready, replicas)
        pool = PoolReplicas(replicas, ready)
        short = decide(observation, kept, pool, spec, now)
        full = decide(observation, everything, pool, spec, now)
        assert (short.replicas, short.reason) == (full.replicas, full.reason)
        assert len(short.window) <= len(everything) + 1
        kept = short.window
        everything = tuple(
            r
            for r in (*everything, Recommendation(now, full.recommendation))
            if now - r.time <= keep
        )
        replicas = full.replicas
