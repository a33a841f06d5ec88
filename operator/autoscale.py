"""The builtin autoscaler's decision: a pure function of the observation history, the pool's
replicas, its autoscaling spec and the time, shaped like the HorizontalPodAutoscaler's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagefleet.operator.spec import Autoscaling

# The HPA's default: ratios within 10% of 1.0 change nothing (avoids chasing noise).
TOLERANCE = 0.1


@dataclass(frozen=True)
class Observation:
    """One evaluation's reading of a pool: queue totals over the pods that answered."""

    time: float  # seconds, any monotonic origin
    waiting: float  # sum of vllm:num_requests_waiting
    running: float  # sum of vllm:num_requests_running
    pods: int  # ready pods whose metrics were read
    replicas: int  # the Deployment's replicas when this was observed


@dataclass(frozen=True)
class PoolReplicas:
    current: int  # the Deployment's spec.replicas
    ready: int  # its ready replicas


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    recommendation: int  # this observation's own recommendation, before stabilisation


def recommend(obs: Observation, spec: Autoscaling) -> tuple[int, str]:
    """The HPA formula on one observation, clamped to min/max: ceil(replicas * avg / target)."""
    target = spec.target_waiting_per_replica
    if obs.pods == 0:
        if obs.replicas == 0 and obs.waiting > 0:
            raw = math.ceil(obs.waiting / target)
            return _clamp(raw, spec), f"{obs.waiting:g} waiting with no pods"
        return _clamp(obs.replicas, spec), "no pod metrics: holding"
    average = obs.waiting / obs.pods
    ratio = average / target
    if abs(ratio - 1.0) <= TOLERANCE:
        raw = obs.replicas
        why = "within tolerance"
    else:
        raw = math.ceil(obs.replicas * ratio)
        why = f"ceil({obs.replicas} x {average:.3g}/{target:g})={raw}"
    if raw == 0 and obs.running > 0:
        raw = 1  # requests still running: never scale the last pod away under them
    return _clamp(raw, spec), (
        f"{obs.waiting:g} waiting / {obs.pods} pods (target {target:g}/pod, "
        f"{obs.running:g} running): {why}"
    )


def _clamp(replicas: int, spec: Autoscaling) -> int:
    return max(spec.min_replicas, min(spec.max_replicas, replicas))


def trim(history: tuple[Observation, ...], spec: Autoscaling, now: float) -> tuple:
    """The observations either stabilisation window still needs."""
    keep = max(spec.scale_up_stabilization_s, spec.scale_down_stabilization_s)
    return tuple(o for o in history if now - o.time <= keep)


def decide(
    history: tuple[Observation, ...],
    pool: PoolReplicas,
    spec: Autoscaling,
    now: float,
) -> Decision:
    """Replicas for the pool now; `history` ends with the newest observation.

    Like the HPA: a scale-up goes to the lowest recommendation of the up-window, a scale-down
    to the highest of the down-window (so a dip must last the whole window); then the step
    limit and min/max. No scale-up while pods of the last step are still not ready."""
    if not history:
        return Decision(_clamp(pool.current, spec), "no observations yet", pool.current)
    latest, latest_reason = recommend(history[-1], spec)
    up = [recommend(o, spec)[0] for o in history if now - o.time <= spec.scale_up_stabilization_s]
    down = [
        recommend(o, spec)[0] for o in history if now - o.time <= spec.scale_down_stabilization_s
    ]
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
    if latest > current and desired < latest:
        notes.append(f"scale-up held to {desired} by the {spec.scale_up_stabilization_s:g}s window")
    if desired > current + spec.max_scale_up_step:
        desired = current + spec.max_scale_up_step
        notes.append(f"step limited to +{spec.max_scale_up_step}")
    clamped = _clamp(desired, spec)
    if clamped != desired:
        notes.append(f"clamped to [{spec.min_replicas}, {spec.max_replicas}]")
        desired = clamped
    floor = max(current, spec.min_replicas)
    if desired > floor and pool.ready < current:
        desired = floor
        notes.append(f"waiting for {current - pool.ready} pod(s) of the last step to be ready")
    reason = latest_reason + "".join(f"; {n}" for n in notes) + f" -> {desired}"
    return Decision(desired, reason, latest)
