"""Times the CPU candidates on this machine and keeps the times per CPU model.

What is kept is the measured seconds (not the decisions), in `<cache>/cpu-choices.json` under a
key naming the CPU model, the thread count, torch's version and the measuring method: a machine
measures each shape once, every later start reads the times back, and the pure rule
(cpu_choice/decide.py) turns them into a choice at every start. Delete the file to measure
again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagefleet.common.demo_model import cache_root
from pagefleet.engine.cpu_choice.decide import Timed

logger = logging.getLogger(__name__)

CACHE_FILE = "cpu-choices.json"
METHOD = 6  # bumped when what is measured changes, so older times are not read as new ones
ROUNDS = 5  # timed rounds per candidate, alternated so a neighbour's burst hits both
ROUND_SECONDS = 0.002  # calls per round are batched to about this long


# Instruction sets that change which kernels win: the same model name ("AMD EPYC", "Intel(R)
# Xeon(R) Processor" in a cloud VM) covers CPUs with and without them.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_model() -> str:
    """This CPU, named well enough to tell apart the machines a choice or a figure came from."""
    with contextlib.suppress(OSError):
        return describe_cpu(Path("/proc/cpuinfo").read_text())
    return platform.processor() or "unknown CPU"


def describe_cpu(cpuinfo: str) -> str:
    """The first processor of a /proc/cpuinfo text: its model name, then family, model and
    stepping, the instruction sets of ISA_FLAGS it has, and its cache size. A VM's model name
    alone can hide a different generation ("AMD EPYC" with or without AVX-512)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block ends
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    ids = ", ".join(
        f"{key.split()[-1]} {fields[key]}"
        for key in ("cpu family", "model", "stepping")
        if fields.get(key)
    )
    flags = set(fields.get("flags", "").split())
    details = [ids] if ids else []
    details.append(" ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2")
    if fields.get("cache size"):
        details.append(f"cache {fields['cache size']}")
    return f"{name} ({'; '.join(details)})"


def machine_key() -> str:
    threads, version = torch.get_num_threads(), torch.__version__
    return f"{cpu_model()} | {threads} threads | torch {version} | method {METHOD}"


class TimingCache:
    """Measured timings by machine, then by what was measured ("linear 960x576"). A missing,
    unreadable or malformed entry reads as not measured; writes replace the file whole (write,
    then rename), so engines starting together never read half a file. `path` None: nothing
    is kept (no home to keep it in)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else _default_path()
        self.machine = machine_key()

    def get(self, subject: str) -> list[Timed] | None:
        machine = self._read().get(self.machine)
        entry = machine.get(subject) if isinstance(machine, dict) else None
        if not isinstance(entry, list) or not entry:
            return None
        timings = [_timed_of(item) for item in entry]
        return None if None in timings else timings

    def put(self, subject: str, timings: list[Timed]) -> None:
        if self.path is None:
            return
        data = self._read()
        machine = data.get(self.machine)
        if not isinstance(machine, dict):
            data[self.machine] = machine = {}
        machine[subject] = [{"label": t.label, "seconds": dict(t.seconds)} for t in timings]
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".cpu-choices-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            tmp = None
        except OSError as e:  # a read-only home: this start's choice stands, unkept
            logger.warning("could not keep the CPU timings in %s: %s", self.path, e)
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    @contextlib.contextmanager
    def measuring(self):
        """Held while measuring and keeping: engines starting together (TP ranks, a node's
        pods) measure one at a time, so they neither skew each other's times nor lose each
        other's writes; one that waited finds the times already kept."""
        if self.path is None:
            yield
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_suffix(".lock"), "a")  # noqa: SIM115 (held to the end)
        except OSError:
            yield
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def _timed_of(item: object) -> Timed | None:
    """One kept workload class, or None where it is not what put() writes."""
    if not isinstance(item, dict) or not isinstance(item.get("label"), str):
        return None
    seconds = item.get("seconds")
    if not isinstance(seconds, dict):
        return None
    for value in seconds.values():
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
    return Timed(item["label"], dict(seconds))


def _default_path() -> Path | None:
    try:
        return cache_root() / CACHE_FILE
    except RuntimeError:  # no home directory to find
        return None


def cached_timings(
    cache: TimingCache, subject: str, measure: Callable[[], list[Timed]]
) -> tuple[list[Timed], str]:
    """The subject's timings from the cache, else measured now (and kept unless a candidate
    failed: a passing failure must not pin the default for good); with where from."""
    timings = cache.get(subject)
    if timings is not None:
        return timings, f"measured earlier on this machine, {cache.path}"
    with cache.measuring():
        timings = cache.get(subject)  # another engine may have measured while this one waited
        if timings is not None:
            return timings, f"measured by another engine on this machine, {cache.path}"
        start = time.perf_counter()
        try:
            timings = measure()
        except (RuntimeError, ValueError) as e:  # a failed measurement keeps the defaults
            logger.warning("measuring %s failed: %s", subject, e)
            return [], f"the measurement failed: {e}"
        took = time.perf_counter() - start
        if any(s is None for t in timings for s in t.seconds.values()):
            return timings, f"measured now in {took:.2f} s, not kept (a candidate failed)"
        cache.put(subject, timings)
    return timings, f"measured now in {took:.2f} s, kept in {cache.path}"


def time_alternately(calls: dict[str, Callable[[], object]]) -> dict[str, float | None]:
    """Seconds per call of each candidate: the best of ROUNDS rounds, the candidates taking
    turns round by round; a candidate that raises in its first call gets None (one that raises
    later fails the whole measurement)."""
    best: dict[str, float | None] = {}
    repeats: dict[str, int] = {}
    for name, call in calls.items():
        try:
            start = time.perf_counter()
            call()  # warm-up (oneDNN builds its kernel on the first call)
            once = max(time.perf_counter() - start, 1e-7)
        except (RuntimeError, ValueError):
            best[name] = None
            continue
        repeats[name] = max(1, int(ROUND_SECONDS / once))
        best[name] = float("inf")
    for _ in range(ROUNDS):
        for name, n in repeats.items():
            call = calls[name]
            start = time.perf_counter()
            for _ in range(n):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / n)
    return best
