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


def machine_wide(item: pytest.Item) -> bool:
    return item.nodeid.startswith("e2e/cluster/") or bool(item.get_closest_marker("machine_wide"))


def assign(items: list[pytest.Item]) -> None:
    """Give every test one xdist group and put the machine-wide ones first. Idempotent: both
    conftests call it, and only the first call changes anything."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = MACHINE_WIDE if machine_wide(item) else item.path.as_posix()
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("xdist_group").args[0] != MACHINE_WIDE)
