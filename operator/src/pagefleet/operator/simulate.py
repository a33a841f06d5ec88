"""A discrete-time pool for exercising the autoscaler without a cluster: pods start after a
delay, the queue is either a given trace or the backlog of a load against the ready pods.
Used by the autoscaler tests and benchmarks/autoscale_sim.py."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagefleet.operator.autoscale import (
    Decision,
    Observation,
    PoolReplicas,
    Recommendation,
    decide,
    recommend,
)
from pagefleet.operator.spec import Autoscaling

Window = tuple[Recommendation, ...]
# (observation, window, pool, spec, now, idle_since): `decide`'s arguments.
Controller = Callable[
    [Observation, Window, PoolReplicas, Autoscaling, float, float | None], Decision
]


@dataclass(frozen=True)
class Step:
    time: float
    waiting: float  # queue at this evaluation
    replicas: int  # replicas after this evaluation's decision
    ready: int  # ready pods when the queue was read
    reason: str


def plain_hpa(
    observation: Observation,
    window: Window,
    pool: PoolReplicas,
    spec: Autoscaling,
    now: float,
    idle_since: float | None = None,
) -> Decision:
    """The bare HPA formula (with its 10% tolerance and min/max) on the newest observation:
    no stabilisation windows, no step limit, no waiting for pending pods."""
    replicas, reason, cause = recommend(observation, spec)
    return Decision(replicas, reason, replicas, cause=cause)


@dataclass
class _Pods:
    """Pods of one pool as start times; a pod is ready `delay` seconds after it was added."""

    ready_at: list[float]
    delay: float

    def scale(self, replicas: int, now: float) -> None:
        if replicas > len(self.ready_at):
            self.ready_at += [now + self.delay] * (replicas - len(self.ready_at))
        else:
            # Like a ReplicaSet: the youngest (least ready) pods go first.
            self.ready_at = sorted(self.ready_at)[:replicas]

    def ready(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now)


def simulate_queue(
    waiting: Sequence[float],
    spec: Autoscaling,
    replicas: int,
    period: float = 15.0,
    start_delay: float = 0.0,
    controller: Controller = decide,
) -> list[Step]:
    """`waiting[i]` is the pool's total queue at evaluation i (independent of replicas)."""
    pods = _Pods([-start_delay] * replicas, start_delay)
    window: Window = ()
    idle: float | None = None
    steps = []
    for i, queue in enumerate(waiting):
        now = i * period
        decision, ready = _evaluate(pods, (window, idle), queue, now, spec, controller)
        window, idle = decision.window, decision.idle_since
        pods.scale(decision.replicas, now)
        steps.append(Step(now, queue, decision.replicas, ready, decision.reason))
    return steps


def _evaluate(
    pods: _Pods, memory: tuple[Window, float | None], queue: float, now: float, spec, controller
):
    """One autoscaler evaluation: observe the pool, decide from the previous decision's
    (window, idle_since); returns (decision, ready)."""
    ready = pods.ready(now)
    current = len(pods.ready_at)
    observation = Observation(queue, 0.0, ready, current)
    window, idle = memory
    decision = controller(observation, window, PoolReplicas(current, ready), spec, now, idle)
    return decision, ready


def simulate_load(
    arrivals: Sequence[float],
    service_rate: float,
    spec: Autoscaling,
    replicas: int,
    period: float = 15.0,
    start_delay: float = 120.0,
    controller: Controller = decide,
) -> list[Step]:
    """`arrivals[i]` requests/s during period i; each ready pod completes `service_rate`
    requests/s; what is not served waits (the queue the autoscaler reads)."""
    pods = _Pods([-start_delay] * replicas, start_delay)
    window: Window = ()
    idle: float | None = None
    backlog = 0.0
    steps = []
    for i, rate in enumerate(arrivals):
        now = i * period
        decision, ready = _evaluate(pods, (window, idle), backlog, now, spec, controller)
        window, idle = decision.window, decision.idle_since
        steps.append(Step(now, backlog, decision.replicas, ready, decision.reason))
        pods.scale(decision.replicas, now)
        backlog = max(0.0, backlog + (rate - service_rate * pods.ready(now)) * period)
    return steps


@dataclass(frozen=True)
class Summary:
    replica_minutes: float  # pods provisioned (starting ones cost GPUs too) x time
    minutes_above_target: float  # queue per ready pod above target (or queue with none ready)
    direction_changes: int  # scale-up followed by scale-down or the reverse
    max_replicas: int


def summarize(steps: Sequence[Step], spec: Autoscaling, period: float) -> Summary:
    minutes = period / 60.0
    above = sum(
        minutes
        for s in steps
        if (s.waiting > spec.target_waiting_per_replica * s.ready if s.ready else s.waiting > 0)
    )
    return Summary(
        replica_minutes=sum(s.replicas for s in steps) * minutes,
        minutes_above_target=above,
        direction_changes=direction_changes([s.replicas for s in steps]),
        max_replicas=max((s.replicas for s in steps), default=0),
    )


def direction_changes(replicas: Sequence[int]) -> int:
    changes, last = 0, 0
    for before, after in itertools.pairwise(replicas):
        direction = int(math.copysign(1, after - before)) if after != before else 0
        if direction and last and direction != last:
            changes += 1
        last = direction or last
    return changes
