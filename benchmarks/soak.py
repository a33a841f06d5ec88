"""The long chaos soak in the cluster lab (e2e/cluster/soak.py; its short plan runs in `make
test`): Poisson chat and completion load through a disaggregated and a colocated deployment
of the tiny checkpoint while engines, routers and the operator are SIGKILLed, a prefill pod's
link is cut, pods are frozen past their probes and an engine Deployment rolls, again and again.
Prints the accounting table (every request's outcome, success outside the fault windows, KV
blocks held at the end, TTFT per phase) that docs/benchmarks.md records.

Needs root (the lab makes network namespaces), like the cluster lab's tests:

    .venv/bin/python benchmarks/soak.py --duration 600 --rate 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from e2e.cluster.conftest import open_lab  # noqa: E402 (after the path is set)
from e2e.cluster.fleet import Offline  # noqa: E402
from e2e.cluster.soak import lab_options, plan_long, run_soak, start_fleet  # noqa: E402


def model_store(root: Path) -> Path:
    """The tiny checkpoint where the deployments' `models` claim finds it."""
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(
        root / "tiny-llama", "LlamaForCausalLM", max_position_embeddings=8192
    )
    store = root / "store"
    shutil.copytree(checkpoint, store / "tiny")
    for path in [store, *store.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return store


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600, help="seconds of load (600)")
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second (3)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    plan = plan_long(args.duration, args.rate)
    print(f"plan: {args.duration:.0f} s at {args.rate}/s, {len(plan.faults)} faults:")
    for fault in plan.faults:
        print(f"  {fault.at_s:6.0f} s {fault.kind} {fault.deployment} {fault.role}".rstrip())
    with tempfile.TemporaryDirectory(prefix="pagefleet-soak-") as tmp:
        store = model_store(Path(tmp))
        offline = Offline(store / "tiny")
        started = time.monotonic()
        with open_lab(Path(tmp) / "lab", **lab_options(store)) as lab:
            fleet = start_fleet(lab)
            print(f"fleet serving after {time.monotonic() - started:.0f} s")
            report = run_soak(fleet, plan, offline)
    print(report.table())
    counts = report.counts()
    ok, calm = report.success_outside_faults()
    good = counts["wrong"] == 0 and counts["lost"] == 0 and report.held_blocks == 0
    return 0 if good and ok >= 0.99 * calm else 1


if __name__ == "__main__":
    sys.exit(main())
