"""A ModelDeployment's status from what the operator observed: per-pool replicas and the reason
for their number, Ready/Progressing/Degraded conditions. Pure; the handlers write it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagefleet.common.names import LABEL_INSTANCE, LABEL_POOL, LABEL_WORKER_INDEX
from pagefleet.operator.autoscale import Recommendation, ScaleReason, window_to_status


@dataclass(frozen=True)
class PoolObserved:
    name: str
    replicas: int  # the Deployment's spec.replicas (0 when it does not exist yet)
    ready: int  # its status.readyReplicas
    desired: int
    reason: str
    # The builtin autoscaler's window (None for other pools): a restarted operator goes on
    # from it, so its scale-down window survives the restart.
    window: tuple[Recommendation, ...] | None = None
    spec_replicas: int | None = None  # spec.pools.<name>.replicas as applied in this pass
    workload: str = "Deployment"  # or LeaderWorkerSet (a multi-node pool)
    leaders_only: bool = False  # multi-node: only each group's leader serves
    cause: ScaleReason = ScaleReason.SPEC  # `reason` in a word (the operator's metrics)


@dataclass(frozen=True)
class Observed:
    pools: tuple[PoolObserved, ...]
    router_replicas: int
    router_ready: int
    error: tuple[str, str] | None = None  # (reason, message) when the spec or the API failed
    images: dict[str, str] | None = None  # the engine images pinned to this ModelDeployment
    # The capacity admission's CapacityAdmitted condition: (status True/False/Unknown,
    # reason, message); None when no pool was checked (operator/admission.py).
    capacity: tuple[str, str, str] | None = None
    # spec.inferencePool's Endpoint Picker (0 and 0 without one).
    picker_replicas: int = 0
    picker_ready: int = 0


def condition(
    kind: str,
    ok: bool | None,
    reason: str,
    message: str,
    previous: list[dict],
    now: str,
    generation: int | None = None,
) -> dict[str, Any]:
    """A condition whose lastTransitionTime only moves when its status changes (`ok` None:
    Unknown)."""
    status = "Unknown" if ok is None else ("True" if ok else "False")
    before = next((c for c in previous if c.get("type") == kind), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else now
    result: dict[str, Any] = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now,
    }
    if generation is not None:
        result["observedGeneration"] = generation
    return result


def _pool_status(pool: PoolObserved, before: dict[str, Any], now: str) -> dict[str, Any]:
    status: dict[str, Any] = {
        "replicas": pool.replicas,
        "readyReplicas": pool.ready,
        "desiredReplicas": pool.desired,
        "reason": pool.reason,
    }
    # When the pool's desired replicas last changed (the operator's scaling decisions).
    moved = "desiredReplicas" in before and before["desiredReplicas"] != pool.desired
    last = now if moved or "desiredReplicas" not in before else before.get("lastScaleTime")
    if last:
        status["lastScaleTime"] = last
    if pool.spec_replicas is not None:
        status["specReplicas"] = pool.spec_replicas
    status["workload"] = pool.workload
    if pool.window is not None:
        status["recommendations"] = window_to_status(pool.window)
    return status


def _serving_pool(pools: tuple[PoolObserved, ...]) -> PoolObserved | None:
    # The scale subresource's one number: the colocated pool (see operator/crd.py).
    return next((p for p in pools if p.name == "colocated"), None)


def build_status(
    name: str, generation: int | None, observed: Observed, previous: dict[str, Any], now: str
) -> dict[str, Any]:
    conditions_before = previous.get("conditions") or []
    pools_before = previous.get("pools") or {}
    pools = {
        p.name: _pool_status(p, pools_before.get(p.name) or {}, now) for p in observed.pools
    } or pools_before  # a spec error observes nothing: keep the last figures
    converging = [
        p.name for p in observed.pools if not (p.replicas == p.desired and p.ready >= p.desired)
    ]
    router_ok = observed.router_ready >= observed.router_replicas
    picker_ok = observed.picker_ready >= observed.picker_replicas
    unready = [p.name for p in observed.pools if p.desired > 0 and p.ready == 0]
    if observed.error:
        ready_ok, ready_reason, ready_msg = False, observed.error[0], observed.error[1]
    elif unready:
        ready_ok, ready_reason = False, "PodsNotReady"
        ready_msg = f"no ready pods in pool(s) {', '.join(unready)}"
    elif not router_ok:
        ready_ok, ready_reason, ready_msg = False, "RouterNotReady", "router pods are not ready"
    elif not picker_ok:
        ready_ok, ready_reason = False, "PickerNotReady"
        ready_msg = "the InferencePool's Endpoint Picker pods are not ready"
    else:
        ready_ok, ready_reason, ready_msg = True, "Serving", "every pool and the router serve"
    progressing = bool(converging) or not router_ok or not picker_ok
    conditions = [
        condition("Ready", ready_ok, ready_reason, ready_msg, conditions_before, now, generation),
        condition(
            "Progressing",
            progressing,
            "Scaling" if progressing else "Stable",
            f"converging: {', '.join(converging) or 'router'}" if progressing else "converged",
            conditions_before,
            now,
            generation,
        ),
        condition(
            "Degraded",
            observed.error is not None,
            observed.error[0] if observed.error else "AsExpected",
            observed.error[1] if observed.error else "spec applied",
            conditions_before,
            now,
            generation,
        ),
    ]
    if observed.capacity is not None:
        state, reason, message = observed.capacity
        ok = None if state == "Unknown" else state == "True"
        conditions.append(
            condition("CapacityAdmitted", ok, reason, message, conditions_before, now, generation)
        )
    status: dict[str, Any] = {
        "pools": pools,
        "ready": " ".join(f"{p.name} {p.ready}/{p.desired}" for p in observed.pools)
        or previous.get("ready", ""),
        "conditions": conditions,
    }
    if generation is not None:
        status["observedGeneration"] = generation
    if observed.images is not None:
        status["images"] = observed.images
    serving = _serving_pool(observed.pools)
    if serving is not None:
        status["replicas"] = serving.replicas
        selector = f"{LABEL_INSTANCE}={name},{LABEL_POOL}={serving.name}"
        # An HPA on the scale subresource reads the pods that serve: a group's leader.
        status["selector"] = selector + (f",{LABEL_WORKER_INDEX}=0" if serving.leaders_only else "")
    return status
