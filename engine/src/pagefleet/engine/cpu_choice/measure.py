"""Times the CPU candidates on this machine and keeps the times per CPU model.

What is kept is the measured seconds (not the decisions), in `<cache>/cpu-choices.json` under a
key naming the CPU model, the thread count, torch's version and the measuring method: a machine
measures each shape once, every later start reads the times back, and the pure rule
(cpu_choice/decide.py) turns them into a choice at every start. Delete the file to measure
again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagefleet.common.demo_model import cache_dir
from pagefleet.engine.cpu_choice.decide import Timed

logger = logging.getLogger(__name__)

CACHE_FILE = "cpu-choices.json"
METHOD = 2  # bumped when what is measured changes, so older times are not read as new ones
ROUNDS = 5  # timed rounds per candidate, alternated so a neighbour's burst hits both
ROUND_SECONDS = 0.002  # calls per round are batched to about this long


def cpu_model() -> str:
    """The CPU's model name (every choice and recorded figure names the machine it came from)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine_key() -> str:
    threads, version = torch.get_num_threads(), torch.__version__
    return f"{cpu_model()} | {threads} threads | torch {version} | method {METHOD}"


class TimingCache:
    """Measured timings by machine, then by what was measured ("linear 960x576"). A missing or
    unreadable file is an empty cache; writes replace the file whole (write, then rename), so
    engines starting together never read half a file, at worst one measures again."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else _default_path()
        self.machine = machine_key()

    def get(self, subject: str) -> list[Timed] | None:
        entry = self._read().get(self.machine, {}).get(subject)
        if not isinstance(entry, list):
            return None
        try:
            return [Timed(str(t["label"]), dict(t["seconds"])) for t in entry]
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, subject: str, timings: list[Timed]) -> None:
        data = self._read()
        data.setdefault(self.machine, {})[subject] = [
            {"label": t.label, "seconds": dict(t.seconds)} for t in timings
        ]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".cpu-choices-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: this start's choice stands, unkept
            logger.warning("could not keep the CPU timings in %s: %s", self.path, e)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def _default_path() -> Path:
    try:
        return cache_dir() / CACHE_FILE
    except OSError:  # no writable cache: a path that reads as empty, and writes only warn
        return Path(os.environ.get("PAGEFLEET_CACHE") or Path.home() / ".cache") / CACHE_FILE


def cached_timings(
    cache: TimingCache, subject: str, measure: Callable[[], list[Timed]]
) -> tuple[list[Timed], str]:
    """The subject's timings from the cache, else measured now (and kept); with where from."""
    timings = cache.get(subject)
    if timings is not None:
        return timings, f"measured earlier on this machine, {cache.path}"
    start = time.perf_counter()
    try:
        timings = measure()
    except (RuntimeError, ValueError) as e:  # a failed measurement keeps the defaults
        logger.warning("measuring %s failed: %s", subject, e)
        return [], f"the measurement failed: {e}"
    cache.put(subject, timings)
    return timings, f"measured now in {time.perf_counter() - start:.2f} s, kept in {cache.path}"


def time_alternately(calls: dict[str, Callable[[], object]]) -> dict[str, float | None]:
    """Seconds per call of each candidate: the best of ROUNDS rounds, the candidates taking
    turns round by round; a candidate that raises gets None."""
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
