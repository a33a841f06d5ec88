"""Cost of one scheduler step (schedule + update_from_output) at 16-1024 running requests.

Mixed prefill and decode with prefix caching on: requests share system prompts, finished ones
are replaced by new arrivals, so each step carries decodes plus prompt chunks. A second run
with histories ~8x longer shows whether the step's work grows with history length (it must
not). The baseline measured in the same run is the cost of a bare Python loop that touches
each running request once, i.e. the floor of any per-request step in CPython.

    .venv/bin/python benchmarks/scheduler_step.py [--steps 300]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from pagefleet.engine.config import CacheConfig, SchedulerConfig
from pagefleet.engine.request import Request
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import Scheduler

BLOCK_SIZE = 16


def make_request(rng: random.Random, i: int, prefixes: list[list[int]], scale: int) -> Request:
    prompt = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(rng.randint(16, 128))]
    params = SamplingParams(max_tokens=rng.randint(64, 256) * scale, ignore_eos=True)
    return Request(f"r{i}", prompt, params, block_size=BLOCK_SIZE)


def measure(num_running: int, steps: int, scale: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(256 * scale)] for _ in range(8)]
    max_len = 256 * scale + 128 + 256 * scale + 1
    blocks_per_req = max_len // BLOCK_SIZE + 1
    sched = Scheduler.create(
        SchedulerConfig(
            max_num_seqs=num_running,
            max_num_batched_tokens=num_running + 512,
            max_model_len=max_len + 1,
            max_num_partial_prefills=4,
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_running * blocks_per_req),
    )
    tokens = [rng.randrange(32000) for _ in range(num_running + 1024)]
    next_id = 0

    def top_up() -> None:
        nonlocal next_id
        while sched.num_running + sched.num_waiting < num_running:
            sched.add_request(make_request(rng, next_id, prefixes, scale))
            next_id += 1

    # Warm up to a steady state: everyone admitted and well into decoding.
    for _ in range(64 * scale):
        top_up()
        out = sched.schedule()
        sched.update_from_output(out, tokens[: len(out.scheduled)])

    t_sched = t_update = 0.0
    running_sum = decode_sum = prefill_tokens = 0
    gc.collect()
    for _ in range(steps):
        top_up()
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        sched.update_from_output(out, tokens[: len(out.scheduled)])
        t2 = time.perf_counter()
        t_sched += t1 - t0
        t_update += t2 - t1
        running_sum += len(out.scheduled)
        decode_sum += sum(1 for _, n in out.scheduled if n == 1)
        prefill_tokens += sum(n for _, n in out.scheduled if n > 1)
    mean_running = running_sum / steps
    history = sum(r.num_tokens for r in sched.running) / max(sched.num_running, 1)
    step_us = (t_sched + t_update) / steps * 1e6

    # Baseline: the cheapest per-request Python work imaginable, over the same running list.
    reqs = list(sched.running)
    t0 = time.perf_counter()
    for _ in range(steps):
        for r in reqs:
            r.num_computed_tokens += 0
    floor_us = (time.perf_counter() - t0) / steps * 1e6
    return {
        "running": mean_running,
        "decodes": decode_sum / steps,
        "prefill_tokens": prefill_tokens / steps,
        "history": history,
        "schedule_us": t_sched / steps * 1e6,
        "update_us": t_update / steps * 1e6,
        "step_us": step_us,
        "per_req_us": step_us / mean_running,
        "floor_per_req_us": floor_us / max(len(reqs), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    header = (
        f"{'running':>8} {'history':>8} {'decodes':>8} {'prefill tok':>11} {'schedule µs':>12} "
        f"{'update µs':>10} {'step µs':>9} {'µs/req':>7} {'floor µs/req':>12} {'x floor':>8}"
    )
    print(header)
    results = []
    for scale in (1, 8):
        for n in (16, 64, 256, 1024):
            if scale > 1 and n < 256:
                continue
            r = measure(n, args.steps, scale)
            results.append(r)
            print(
                f"{r['running']:8.0f} {r['history']:8.0f} {r['decodes']:8.0f} "
                f"{r['prefill_tokens']:11.0f} {r['schedule_us']:12.1f} {r['update_us']:10.1f} "
                f"{r['step_us']:9.1f} {r['per_req_us']:7.2f} {r['floor_per_req_us']:12.3f} "
                f"{r['per_req_us'] / r['floor_per_req_us']:8.1f}"
            )
    short = {round(r["running"], -1): r for r in results[:4]}
    for r in results[4:]:
        base = min(short.values(), key=lambda s: abs(s["running"] - r["running"]))
        print(
            f"history {base['history']:.0f} -> {r['history']:.0f} tokens at "
            f"{r['running']:.0f} running: µs/req x{r['per_req_us'] / base['per_req_us']:.2f}"
        )


if __name__ == "__main__":
    main()
