"""Autoscaler simulation over a day-shaped load (quiet night, morning ramp, bursts, evening
peak) with a pod start delay: our defaults vs the plain HPA formula without windows.

Run: .venv/bin/python benchmarks/autoscale_sim.py [--seed 0] [--start-delays 60,180]
Prints a markdown table: replica-minutes (cost), minutes with the queue above target
(latency pain), direction changes (flapping)."""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import replace

from pagefleet.operator.simulate import plain_hpa, simulate_load, summarize
from pagefleet.operator.spec import Autoscaling

PERIOD = 15.0  # the operator's default evaluation interval
SERVICE_RATE = 2.0  # requests/s one ready replica completes


def day_trace(seed: int, period: float = PERIOD) -> list[float]:
    """Arrivals (requests/s) for each period of 24 h: a diurnal curve, a steep morning ramp,
    bursts of 2-6 minutes at 2-3x, and +-10% noise."""
    rng = random.Random(seed)
    steps = int(24 * 3600 / period)
    bursts: dict[int, float] = {}
    for _ in range(30):
        start, length = rng.randrange(steps), rng.randint(8, 24)
        factor = rng.uniform(2.0, 3.0)
        for i in range(start, min(steps, start + length)):
            bursts[i] = factor
    trace = []
    for i in range(steps):
        hour = i * period / 3600
        # Night ~1 req/s, day ~16 req/s peaking at 14:00, a ramp between 07:00 and 09:00.
        day = 0.5 - 0.5 * math.cos(2 * math.pi * (hour - 2) / 24)
        ramp = min(1.0, max(0.0, (hour - 7) / 2)) if hour < 20 else max(0.0, (22 - hour) / 2)
        base = 1.0 + 15.0 * day * (0.4 + 0.6 * ramp)
        trace.append(base * bursts.get(i, 1.0) * rng.uniform(0.9, 1.1))
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-delays", default="60,180", help="pod start delays, seconds")
    args = parser.parse_args()
    arrivals = day_trace(args.seed)
    spec = Autoscaling(mode="builtin", min_replicas=1, max_replicas=32)
    plain_spec = replace(spec, scale_down_stabilization_s=0, max_scale_up_step=1000)
    mean = sum(arrivals) / len(arrivals)
    print(
        f"day trace: {len(arrivals)} periods of {PERIOD:g} s, mean {mean:.1f}"
        f" req/s, peak {max(arrivals):.1f} req/s; {SERVICE_RATE:g} req/s per ready replica; "
        f"target {spec.target_waiting_per_replica:g} waiting/replica, replicas 1-32\n"
    )
    # The floor: exactly the replicas the load needs each period, no start delay, no queue.
    ideal = sum(math.ceil(rate / SERVICE_RATE) for rate in arrivals) * PERIOD / 60
    print(f"lower bound (ceil(load / rate) each period, instant pods): {ideal:,.0f} replica-min\n")
    print(
        "| controller | pod start | replica-minutes | minutes queue > target "
        "| direction changes | max replicas | sim time |"
    )
    print("|---|---|---|---|---|---|---|")
    for delay in (float(d) for d in args.start_delays.split(",")):
        for name, controller, controller_spec in (
            ("pagefleet defaults (up 0 s, down 300 s, step 4, pending guard)", None, spec),
            ("plain HPA formula, no windows", plain_hpa, plain_spec),
        ):
            started = time.perf_counter()
            kwargs = {"controller": controller} if controller else {}
            steps = simulate_load(
                arrivals, SERVICE_RATE, controller_spec, 1, PERIOD, delay, **kwargs
            )
            elapsed = time.perf_counter() - started
            s = summarize(steps, spec, PERIOD)
            print(
                f"| {name} | {delay:g} s | {s.replica_minutes:,.0f} | "
                f"{s.minutes_above_target:,.1f} | {s.direction_changes} | {s.max_replicas} | "
                f"{elapsed:.2f} s |"
            )


if __name__ == "__main__":
    main()
