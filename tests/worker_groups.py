"""How `make test` splits the suite between its two pytest-xdist workers (`--dist loadgroup`).

Each test file is one unit of work, so a module's fixtures (its engines, its checkpoints)
start once. The tests that cannot share the machine with each other form one more unit, run
first so the longest unit does not start last: Ray's (`ray.init()` joins any Ray cluster it
finds running on the machine) and the cluster lab's (e2e/cluster: labs share the host's
mount-point bookkeeping). `make test` runs the lab after the workers, alone: a lab is a fleet
of pods' processes on a 2-core machine, and beside a worker its timing (probes, leases,
the soak's request rate) was seen to fail.

The numba kernels are compiled before the workers start (`make test`): numba writes a
kernel's cache index without a lock, and two workers compiling at once could lose entries.
"""

from __future__ import annotations

import pytest

MACHINE_WIDE = "machine-wide"
# The files that took longest on the workers (seconds of their tests in `make test` on the
# 2-core Zen 3 machine, 2026-12-07), handed out first after the machine-wide unit so that no
# long file starts last while the other worker runs out of work. Only the order depends on
# this list: a stale one costs minutes, never a result.
LONGEST_FIRST = (
    "tests/test_trained_model.py",  # 234 s
    "e2e/test_fleet.py",  # 186
    "tests/test_pd.py",  # 157
    "tests/test_router.py",  # 127
    "tests/test_pd_tensor_parallel.py",  # 89
    "tests/test_model_equivalence.py",  # 71
    "tests/test_server.py",  # 67
    "tests/test_spec_decode_pd_tp.py",  # 67
    "tests/test_operator_kopf.py",  # 58
    "tests/test_spec_decode_draft.py",  # 51
)


def machine_wide(item: pytest.Item) -> bool:
    return item.nodeid.startswith("e2e/cluster/") or bool(item.get_closest_marker("machine_wide"))


def assign(items: list[pytest.Item]) -> None:
    """Give every test one xdist group (its file's path, relative to the root) and order the
    groups: the machine-wide one, `LONGEST_FIRST`, then the rest as collected. Idempotent: both
    conftests call it, and only the first call changes anything."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = MACHINE_WIDE if machine_wide(item) else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))
    rank = {MACHINE_WIDE: -1} | {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.get_closest_marker("xdist_group").args[0], len(rank)))
