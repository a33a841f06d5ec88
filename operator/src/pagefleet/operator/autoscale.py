"""The builtin autoscaler's decision: a pure function of the observation, the earlier
recommendations, the pool's replicas, its autoscaling spec and the time, shaped like the
HorizontalPodAutoscaler's; and the window's form in the ModelDeployment's status. Zero is
its own trip: a pool at 0 wakes as soon as the router holds a request for it, and goes to 0
only after a whole idle window (scaleToZeroIdleSeconds) with nothing running, waiting or
queued."""

from __future__ import annotations

import datetime
import enum
import math
from dataclasses import dataclass

from pagefleet.operator.spec import Autoscaling

# The HPA's default: ratios within 10% of 1.0 change nothing (avoids chasing noise).
TOLERANCE = 0.1


class ScaleReason(enum.StrEnum):
    """Why a pool has its desired replicas, in one word from a closed set: what the operator's
    metrics label a pool with (the status' reason says it in full). Of the limits a decision
    met, the last one applied names it; but a pool leaving zero for demand is woken, and one
    going to zero for its idle window is scaled to zero, whatever else bounded the number."""

    DEMAND = "demand"  # the HPA formula on the queues moved or kept it
    WITHIN_TOLERANCE = "within_tolerance"  # the queues are within 10% of the target
    LAST_POD_KEPT = "last_pod_kept"  # the formula says 0: only the idle window goes to zero
    NO_METRICS = "no_metrics"  # no pod answered: holding
    WAKE = "wake"  # from zero, for demand (requests held at the router)
    IDLE_AT_ZERO = "idle_at_zero"  # nothing waiting or queued, no pods
    SCALE_TO_ZERO = "scale_to_zero"  # idle for scaleToZeroIdleSeconds
    STABILIZATION = "stabilization"  # held by a stabilisation window
    STEP_LIMIT = "step_limit"  # maxScaleUpStep
    BOUNDS = "bounds"  # minReplicas or maxReplicas
    PODS_NOT_READY = "pods_not_ready"  # the last step's pods are not ready yet
    # Pools the builtin autoscaler does not decide, or has not yet in this process:
    KEDA = "keda"
    SPEC = "spec"  # autoscaling mode none: spec.replicas, or the workload's own
    PENDING = "pending"  # builtin, not evaluated since the operator started


@dataclass(frozen=True)
class Observation:
    """One evaluation's reading of a pool: queue totals over the pods that answered."""

    waiting: float  # sum of vllm:num_requests_waiting
    running: float  # sum of vllm:num_requests_running
    pods: int  # ready pods whose metrics were read
    replicas: int  # the Deployment's replicas when this was observed
    # Requests the router holds for the pool's model (no engine ready, or all saturated):
    # the only demand there is to see at zero pods.
    queued: float = 0.0
    # False when the router has pods but none answered: its queue is unknown, so the pool
    # counts as busy (never scaled to 0 on a blind reading).
    queue_read: bool = True

    @property
    def demand(self) -> float:
        """Requests waiting for an engine: in the engines' queues and in the router's."""
        return self.waiting + self.queued

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or queued, as far as every source could tell: the
        engines were read (or there are none) and the router answered."""
        engines_read = self.pods > 0 or self.replicas == 0
        nothing = self.waiting == 0 and self.running == 0 and self.queued == 0
        return engines_read and self.queue_read and nothing


@dataclass(frozen=True)
class Recommendation:
    """One evaluation's own recommendation, at wall-clock seconds (it outlives the operator
    process: the window is kept in the ModelDeployment's status)."""

    time: float
    replicas: int


@dataclass(frozen=True)
class PoolReplicas:
    current: int  # the Deployment's spec.replicas
    ready: int  # its ready replicas


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    recommendation: int  # this observation's own recommendation, before stabilisation
    window: tuple[Recommendation, ...] = ()  # what later decisions still need (see `needed`)
    # Since when the pool has been seen idle without a break (None: busy now); the next
    # decision's `idle_since`.
    idle_since: float | None = None
    cause: ScaleReason = ScaleReason.DEMAND


def recommend(obs: Observation, spec: Autoscaling) -> tuple[int, str, ScaleReason]:
    """The HPA formula on one observation, clamped to min/max and, for a pool with replicas,
    to at least one: ceil(replicas * avg / target), the router's queued requests counted as
    waiting. Only `decide`'s idle window takes a pool to zero; a pool at zero wakes to what
    its demand needs at the target per replica. Returns the replicas, why in words, and why in
    a word (BOUNDS where min/max changed the number)."""
    target = spec.target_waiting_per_replica
    queued = f" + {obs.queued:g} queued" if obs.queued else ""
    # At zero replicas only demand wakes the pool: pods still seen are on their way out (the
    # ReplicaSet deletes them just after the scale to zero), and the formula below would keep
    # the last of them.
    if obs.pods == 0 or obs.replicas == 0:
        if obs.replicas == 0 and obs.demand > 0:
            raw = math.ceil(obs.demand / target)
            why = f"{obs.waiting:g} waiting{queued} with no pods"
            return _clamped(raw, spec, why, ScaleReason.WAKE)
        if obs.replicas == 0 and obs.queue_read:
            why = "nothing waiting or queued with no pods"
            return _clamped(0, spec, why, ScaleReason.IDLE_AT_ZERO)
        return _clamped(obs.replicas, spec, "no pod metrics: holding", ScaleReason.NO_METRICS)
    average = obs.demand / obs.pods
    ratio = average / target
    if abs(ratio - 1.0) <= TOLERANCE:
        raw = obs.replicas
        why, cause = "within tolerance", ScaleReason.WITHIN_TOLERANCE
    else:
        raw = math.ceil(obs.replicas * ratio)
        why, cause = f"ceil({obs.replicas} x {average:.3g}/{target:g})={raw}", ScaleReason.DEMAND
    if raw == 0:
        # A pool that serves keeps a pod: zero is the idle window's call, never the
        # formula's (which would drop the last pod under a running request, or between two).
        raw = 1
        why, cause = why + ", the last pod kept", ScaleReason.LAST_POD_KEPT
    return _clamped(
        raw,
        spec,
        f"{obs.waiting:g} waiting{queued} / {obs.pods} pods (target {target:g}/pod, "
        f"{obs.running:g} running): {why}",
        cause,
    )


def _clamp(replicas: int, spec: Autoscaling) -> int:
    return max(spec.min_replicas, min(spec.max_replicas, replicas))


def _clamped(
    raw: int, spec: Autoscaling, why: str, cause: ScaleReason
) -> tuple[int, str, ScaleReason]:
    replicas = _clamp(raw, spec)
    return replicas, why, cause if replicas == raw else ScaleReason.BOUNDS


def needed(
    recommendations: tuple[Recommendation, ...], spec: Autoscaling, now: float
) -> tuple[Recommendation, ...]:
    """The recommendations (oldest first) that can still change a later decision: in the
    scale-down window those no later one equals or exceeds (it would outlast and outrank them),
    in the scale-up window those no later one equals or undercuts. Entries at minReplicas
    (resp. maxReplicas) never move a decision, whose own recommendation lies within [min, max].
    Later decisions over this are those over the whole history; an idle pool keeps no entry
    and a steady one a single entry."""
    down = [
        i
        for i, r in enumerate(recommendations)
        if now - r.time <= spec.scale_down_stabilization_s and r.replicas > spec.min_replicas
    ]
    up = [
        i
        for i, r in enumerate(recommendations)
        if now - r.time <= spec.scale_up_stabilization_s and r.replicas < spec.max_replicas
    ]
    replicas = [r.replicas for r in recommendations]
    keep = {i for n, i in enumerate(down) if all(replicas[j] < replicas[i] for j in down[n + 1 :])}
    keep |= {i for n, i in enumerate(up) if all(replicas[j] > replicas[i] for j in up[n + 1 :])}
    return tuple(r for i, r in enumerate(recommendations) if i in keep)


def idle_since_now(observation: Observation, idle_since: float | None, now: float) -> float | None:
    """When the pool's unbroken idle stretch began, this observation included."""
    if not observation.idle:
        return None
    return now if idle_since is None else min(idle_since, now)


def decide(
    observation: Observation,
    window: tuple[Recommendation, ...],
    pool: PoolReplicas,
    spec: Autoscaling,
    now: float,
    idle_since: float | None = None,
) -> Decision:
    """Replicas for the pool now, from this observation, the earlier recommendations
    (`window`, oldest first; the previous decision's `window`) and the start of the pool's
    idle stretch (the previous decision's `idle_since`).

    Like the HPA: a scale-up goes to the lowest recommendation of the up-window, a scale-down
    to the highest of the down-window (so a dip must last the whole window); then the step
    limit and min/max. No scale-up while pods of the last step are still not ready. Zero has
    its own rules: a pool at 0 with demand wakes at once (no window holds a cold start back),
    and a pool with minReplicas 0 goes to 0 once it has been idle for scaleToZeroIdleSeconds."""
    idle = idle_since_now(observation, idle_since, now)
    if pool.current > 0 and spec.min_replicas == 0 and idle is not None:
        idle_for = now - idle
        if idle_for >= spec.scale_to_zero_idle_s:
            reason = (
                f"nothing running, waiting or queued for {idle_for:g}s "
                f"(scaleToZeroIdleSeconds {spec.scale_to_zero_idle_s:g}) -> 0"
            )
            return Decision(0, reason, 0, (), idle, ScaleReason.SCALE_TO_ZERO)
    latest, latest_reason, cause = recommend(observation, spec)
    if pool.current == 0 and latest > 0:
        # Waking: the up-window exists to ignore blips on a serving pool; at zero a request
        # is held at the router until a pod loads, so every second of delay is the client's.
        window = ()
    recommendations = (*window, Recommendation(now, latest))
    up = [r.replicas for r in recommendations if now - r.time <= spec.scale_up_stabilization_s]
    down = [r.replicas for r in recommendations if now - r.time <= spec.scale_down_stabilization_s]
    up_floor = min(up, default=latest)
    down_ceiling = max(down, default=latest)
    current = pool.current
    desired, notes = current, []
    if desired < up_floor:
        desired = up_floor
    if desired > down_ceiling:
        desired = down_ceiling
    if latest < current and desired > latest:
        notes.append(
            f"scale-down held to {desired} by the {spec.scale_down_stabilization_s:g}s window"
        )
        cause = ScaleReason.STABILIZATION
    if latest > current and desired < latest:
        notes.append(f"scale-up held to {desired} by the {spec.scale_up_stabilization_s:g}s window")
        cause = ScaleReason.STABILIZATION
    if desired > current + spec.max_scale_up_step:
        desired = current + spec.max_scale_up_step
        notes.append(f"step limited to +{spec.max_scale_up_step}")
        cause = ScaleReason.STEP_LIMIT
    clamped = _clamp(desired, spec)
    if clamped != desired:
        notes.append(f"clamped to [{spec.min_replicas}, {spec.max_replicas}]")
        desired, cause = clamped, ScaleReason.BOUNDS
    floor = max(current, spec.min_replicas)
    if desired > floor and pool.ready < current:
        desired = floor
        notes.append(f"waiting for {current - pool.ready} pod(s) of the last step to be ready")
        cause = ScaleReason.PODS_NOT_READY
    if current == 0 and desired > 0 and observation.demand > 0:
        cause = ScaleReason.WAKE  # a cold start, however many pods it starts
    reason = latest_reason + "".join(f"; {n}" for n in notes) + f" -> {desired}"
    return Decision(desired, reason, latest, needed(recommendations, spec, now), idle, cause)


def window_to_status(window: tuple[Recommendation, ...]) -> list[dict[str, int | str]]:
    """The window as status holds it: RFC 3339 times, rounded up to the second (a restored
    window then expires no earlier than the one it was written from)."""
    return [{"time": _rfc3339(math.ceil(r.time)), "replicas": r.replicas} for r in window]


def window_from_status(recorded: object, now: float, current: int) -> tuple[Recommendation, ...]:
    """The window a restarted operator continues with. Nothing recorded (a first start, a
    status written by an older operator): like the HPA, the current replicas as if recommended
    now, so a restart never lets a pool drop at once. Malformed entries are skipped."""
    if not isinstance(recorded, list):
        return (Recommendation(now, current),)
    window = []
    for entry in recorded:
        try:
            when = datetime.datetime.fromisoformat(entry["time"]).timestamp()
            replicas = entry["replicas"]
        except (TypeError, KeyError, ValueError):
            continue
        if isinstance(replicas, int) and not isinstance(replicas, bool):
            # Never from the future (another node's clock): it would hold the pool too long.
            window.append(Recommendation(min(when, now), replicas))
    return tuple(sorted(window, key=lambda r: r.time))


def _rfc3339(seconds: int) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
