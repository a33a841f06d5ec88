"""An engine whose source is read-only (a pod's image) loads the numba kernels compiled beside
that source instead of compiling them again (engine/kernel_cache.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from numba.core import config

from pagefleet.engine import kernel_cache
from pagefleet.engine.attention import numba_paged

ENGINE_SRC = Path(kernel_cache.__file__).parent

# What a pod's engine runs: the kernels of a float32 CPU model and of its paged attention.
POD = """
import json, numba, torch
from pagefleet.engine.attention import numba_paged
from pagefleet.engine.model import numba_ops
numba_paged.warm_up((torch.float32,))
stats = {"hits": 0, "misses": []}
for module in (numba_ops, numba_paged):
    for name, f in vars(module).items():
        if isinstance(f, numba.core.registry.CPUDispatcher):
            stats["hits"] += sum(f.stats.cache_hits.values())
            stats["misses"] += [name] * sum(f.stats.cache_misses.values())
print(json.dumps(stats))
"""


def test_a_read_only_engine_loads_the_kernels_compiled_beside_its_source(tmp_path):
    numba_paged.warm_up((torch.float32,))  # this process compiles into the writable tree
    assert any((ENGINE_SRC / "model" / "__pycache__").glob("numba_ops._gemv-*.nbi"))
    home = tmp_path / "home"
    home.mkdir()
    src = str(ENGINE_SRC)
    # The engine's source read-only, as under a pod's readOnlyRootFilesystem; HOME its emptyDir.
    script = f'mount --bind "{src}" "{src}" && mount -o remount,ro,bind "{src}" && exec "$@"'
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    run = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "pod", sys.executable, "-c", POD],
        env={**env, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout.splitlines()[-1])
    assert stats["misses"] == [] and stats["hits"] >= 4, stats
    # It read them from its own cache, seeded from the source's (which it could not write).
    seeded = {p.name for p in (home / ".cache" / "numba").rglob("*.nbi")}
    assert any(n.startswith("numba_ops._gemv-") for n in seeded), seeded
    assert any(n.startswith("numba_paged.") for n in seeded), seeded


def test_seeding_copies_one_kernels_files_only_where_its_index_is_missing(tmp_path):
    source, cache = tmp_path / "source", tmp_path / "cache"
    source.mkdir()
    cache.mkdir()
    for name in ("ops.norm-3.py311.nbi", "ops.norm-3.py311.1.nbc", "ops.norm-30.py311.nbi"):
        (source / name).write_bytes(name.encode())
    (source / "ops.gemv-9.py311.1.nbc").write_bytes(b"data without an index")

    copied = kernel_cache.seed(source, cache, "ops.norm-3.")
    assert sorted(copied) == ["ops.norm-3.py311.1.nbc", "ops.norm-3.py311.nbi"]
    assert (cache / "ops.norm-3.py311.nbi").read_bytes() == b"ops.norm-3.py311.nbi"
    assert sorted(p.name for p in cache.iterdir()) == sorted(copied)  # no partial files left

    # An index already there is this machine's own, maybe newer: it is kept as it is.
    (cache / "ops.norm-3.py311.nbi").write_bytes(b"compiled here")
    assert kernel_cache.seed(source, cache, "ops.norm-3.") == []
    assert (cache / "ops.norm-3.py311.nbi").read_bytes() == b"compiled here"
    # Nothing to seed from: data files without their index, or no directory at all.
    assert kernel_cache.seed(source, cache, "ops.gemv-9.") == []
    assert kernel_cache.seed(tmp_path / "absent", cache, "ops.norm-3.") == []


def test_a_locator_list_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_LOCATOR_CLASSES", "UserWideCacheLocator")
    monkeypatch.setattr(config, "CACHE_LOCATOR_CLASSES", "UserWideCacheLocator")
    kernel_cache.use_image_kernels()
    assert config.CACHE_LOCATOR_CLASSES == "UserWideCacheLocator"


def test_the_engines_locators_stay_out_of_child_processes(monkeypatch):
    """Only this process is told: a Python without pagefleet, started from an engine, would
    fail on every cached kernel if the environment named our locator."""
    monkeypatch.delenv("NUMBA_CACHE_LOCATOR_CLASSES", raising=False)
    monkeypatch.setattr(config, "CACHE_LOCATOR_CLASSES", "")
    kernel_cache.use_image_kernels()
    assert config.CACHE_LOCATOR_CLASSES == kernel_cache.LOCATORS
    assert "NUMBA_CACHE_LOCATOR_CLASSES" not in os.environ


CALLER = """
import numba
import callee

KERNEL_CALLEES = (callee.__file__,)


@numba.njit(cache=True)
def f(x):
    return callee.g(x)
"""
CALLEE = """
import numba


@numba.njit(cache=True)
def g(x):
    return x + {step}
"""
RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pagefleet.engine.kernel_cache import use_image_kernels
use_image_kernels()
import caller
print(json.dumps([caller.f(1), sum(caller.f.stats.cache_hits.values())]))
"""


def test_a_cached_kernel_is_compiled_again_when_a_kernel_it_calls_changes(tmp_path):
    """numba checks only the caller's own file: without the callees' files in its stamp, the
    caller's cached copy would keep the callee's old code (one_row_decode.py's kernel calls
    numba_ops's and numba_paged's)."""
    (tmp_path / "caller.py").write_text(CALLER)

    def run(step: int) -> list[int]:
        (tmp_path / "callee.py").write_text(CALLEE.format(step=step))
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
        done = subprocess.run(
            [sys.executable, "-c", RUN, str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    assert run(1) == [2, 0]
    assert run(1) == [2, 1]  # unchanged: loaded from the cache
    assert run(2)[0] == 3  # the callee changed: compiled again, not the stale copy
