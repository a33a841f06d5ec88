"""Which float32 CPU weights are oneDNN-packed (`--linear-path`): torch's plain weight (MKL
sgemm, sgemv at one row) or oneDNN's prepacked one (model/packed.py), per weight shape; and what
a step of one row (single-stream decode) runs on them.

Which wins depends on the CPU and the shape. On an AMD EPYC with AVX-512 the packed weights ran
the model's shapes about 2x faster from 8 rows up and even at one row; on an Intel Xeon they ran
0.54-1.05x at one row and 0.83-1.59x at 16 and 64; on an AVX2 EPYC (Zen 3) packed won from 16
rows, and at one row a numba GEMV on the plain weight (model/numba_ops.py) beat both MKL and
oneDNN by 1.4-2x (docs/benchmarks.md, issue 38). So `auto` times the paths on this rank's own
weights of each shape of the linear seam (model/linear.py) at 1, 16 and 64 rows, taking turns
over up to 256 MiB of them so they come from memory as in a step. The pure rule
(cpu_choice/decide.py) picks the layout from the steps of 16 and 64 rows and the one-row path
(plain, packed or gemv) from one row's; a one-row path on the plain weight beside a packed
layout keeps both copies, where the copies fit in SECOND_LAYOUT_SHARE of the memory available
at load or of the container's limit (the most time saved per byte first). A shape left without
room falls back to one layout chosen over all three row counts. The times are kept per CPU
(cpu_choice/measure.py): a machine measures each shape once.

The families' parts outside the seam (MoE experts, a router's gate, a linear-attention layer's
plain projections) are not measured and have no one-row path: `auto` packs them only where
packed won every measured shape over all three row counts; otherwise they keep the plain
default.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.config import LINEAR_PATHS
from pagefleet.engine.cpu_choice.decide import Choice, Timed, choose
from pagefleet.engine.cpu_choice.measure import TimingCache, cached_timings, time_alternately
from pagefleet.engine.model.linear import FloatLinearMethod, Linear
from pagefleet.engine.model.packed import pack_weight, packed_linear, prepack_supported

logger = logging.getLogger(__name__)

LAYOUTS = ("plain", "packed")
ONE_ROW_PATHS = ("plain", "packed", "gemv")  # gemv: numba's, on the plain weight
DEFAULT = "plain"  # torch's own path: what a tie or a failed measurement keeps
ROWS = (1, 16, 64)
ONE_ROW = "rows=1"
# Weights of one shape are timed in turn, up to this many bytes of them: in a step each layer's
# weight comes from memory, not from the cache the previous call left it in (a 1-row product
# is bandwidth-bound, and the paths differ in how close they get to the bandwidth).
ROTATION_BYTES = 256 << 20
# Plain copies kept beside packed weights for one-row steps may take this share of the memory
# available at load: the engine's KV pool and other processes need the rest.
SECOND_LAYOUT_SHARE = 0.25

Shape = tuple[int, int]


@dataclass(frozen=True)
class LinearPlan:
    """Which float weight shapes of the seam are packed (`everything`: all), whether the
    families' unmeasured parts are (`others`), and the one-row path of the shapes whose
    one-row steps run other than their layout's own path (`one_row`: "plain" or "gemv")."""

    packed: frozenset[Shape] = frozenset()
    everything: bool = False
    others: bool = False
    one_row: Mapping[Shape, str] = field(default_factory=dict)
    # The decoder layers run as one compiled call each at one row (model/one_row_decode.py),
    # on the plain weights this plan keeps for them.
    one_row_layers: bool = False

    def packs(self, shape: Shape) -> bool:
        return self.everything or shape in self.packed

    def one_row_path(self, shape: Shape) -> str | None:
        return self.one_row.get(shape)


PACK_ALL = LinearPlan(everything=True, others=True)
PACK_NONE = LinearPlan()


@dataclass(frozen=True)
class ShapePaths:
    """One shape's choice: its layout, its one-row path where that is not the layout's own
    (None), why, and the seconds per weight that path saves a one-row step."""

    layout: str
    one_row: str | None
    reason: str
    saves: float = 0.0

    @property
    def second_layout(self) -> bool:
        """Whether it keeps the plain weight beside the packed one."""
        return self.layout == "packed" and self.one_row is not None


def choose_paths(timings: Sequence[Timed], on_plain: bool = False) -> ShapePaths:
    """The layout from the classes of several rows, the one-row path from one row's: the
    best of all three paths on a packed layout, of the two that read a plain one (and of
    those two alone where `on_plain`: fused layers read the plain weight at one row)."""
    many = [t for t in timings if t.label != ONE_ROW] or list(timings)
    layout = choose(LAYOUTS, DEFAULT, many)
    packed = layout.name == "packed" and not on_plain
    return _with_one_row(layout, timings, ONE_ROW_PATHS if packed else ON_PLAIN)


def one_layout(timings: Sequence[Timed]) -> ShapePaths:
    """Where no second copy fits: one layout chosen over every class, one row included (the
    plain layout scored at one row by the faster of the two paths that read it), and its
    one-row path among those that read that layout."""
    layout = choose(LAYOUTS, DEFAULT, [_plain_at_its_best(t) for t in timings])
    return _with_one_row(layout, timings, ("packed",) if layout.name == "packed" else ON_PLAIN)


def _plain_at_its_best(timed: Timed) -> Timed:
    seconds = dict(timed.seconds)
    gemv, plain = seconds.get("gemv"), seconds.get("plain")
    if timed.label == ONE_ROW and gemv is not None and plain is not None and 0 < gemv < plain:
        seconds["plain"] = gemv
    return Timed(timed.label, seconds)


ON_PLAIN = ("plain", "gemv")  # the one-row paths that read the plain weight


def _with_one_row(layout: Choice, timings: Sequence[Timed], candidates: Sequence[str]):
    one = [t for t in timings if t.label == ONE_ROW]
    if not one or len(candidates) < 2:
        return ShapePaths(layout.name, None, layout.reason)
    row = choose(candidates, layout.name if layout.name in candidates else DEFAULT, one)
    reason = f"{layout.reason}; one row: {row.reason}"
    if row.name == layout.name:
        return ShapePaths(layout.name, None, reason)
    saves = one[0].seconds[layout.name] - one[0].seconds[row.name]
    return ShapePaths(layout.name, row.name, reason, saves)


def fit_second_layouts(wanted: Mapping[Shape, tuple[float, int]], budget: int) -> set[Shape]:
    """The shapes that keep a plain copy beside their packed weights, from `wanted`: shape ->
    (seconds a one-row step saves, bytes of its copies); the most seconds saved per byte
    first, while the copies fit in `budget` bytes."""
    kept, used = set(), 0
    for shape, (_, size) in sorted(wanted.items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1)):
        if used + size <= budget:
            kept.add(shape)
            used += size
    return kept


def second_layout_budget(meminfo: Path = Path("/proc/meminfo"), limit: int | None = None) -> int:
    """Bytes the plain copies may take: SECOND_LAYOUT_SHARE of the memory available now, or of
    the container's limit where lower (`limit`, None: read it); none where the available
    memory cannot be read."""
    if limit is None:
        from pagefleet.engine.kv_sizing import host_memory_bytes  # it imports the model stack

        limit = host_memory_bytes()
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                return int(min(available, limit) * SECOND_LAYOUT_SHARE)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def linear_plan(
    path: str,
    weights: dict[Shape, list[torch.Tensor]],
    cache=None,
    budget: int | None = None,
    layer_shapes: frozenset[Shape] = frozenset(),
) -> LinearPlan:
    """The plan for `--linear-path` `path` given the model's float seam weights by shape (only
    `auto` reads them; `budget`: bytes for second copies, None: second_layout_budget()). Logs
    each measured choice with its reason.

    `layer_shapes`: the shapes the decoder layers read where they can run fused at one row
    (model/one_row_decode.py). `auto` fuses them where their plain copies fit in the budget
    first: one call per layer instead of a dozen saved 10 ms of a 34 ms single-stream token on
    an Intel Xeon, where its GEMV reads the weights at 0.8x MKL's rate (docs/benchmarks.md)."""
    if path not in LINEAR_PATHS:
        raise ValueError(f"--linear-path {path!r}: one of {', '.join(LINEAR_PATHS)}")
    if path == "packed":
        return PACK_ALL
    if path == "plain" or not weights:
        return PACK_NONE
    cache = cache if cache is not None else TimingCache()
    measured = {}
    for shape, same in sorted(weights.items()):
        subject = f"linear {shape[0]}x{shape[1]}"
        timings, source = cached_timings(
            cache, subject, lambda same=same: measure_linear(rotation(same))
        )
        measured[shape] = (choose_paths(timings, shape in layer_shapes), timings, source)
    copies = {shape: sum(w.numel() * w.element_size() for w in weights[shape]) for shape in weights}
    budget = second_layout_budget() if budget is None else budget
    fused = _fuse_layers(layer_shapes, measured, copies, budget)
    if fused:
        budget -= sum(copies[s] for s in layer_shapes if measured[s][0].second_layout)
    wanted = {
        shape: (paths.saves * len(weights[shape]), copies[shape])
        for shape, (paths, _, _) in measured.items()
        if paths.second_layout and not (fused and shape in layer_shapes)
    }
    fits = fit_second_layouts(wanted, budget) | (set(layer_shapes) if fused else set())
    packed, one_row = set(), {}
    for shape, (paths, timings, source) in measured.items():
        copy = ""
        if paths.second_layout and shape not in fits:
            paths = one_layout(timings)
            copy = (
                f"; no room for a plain copy ({copies[shape] >> 20} MiB) within {budget >> 20} MiB"
            )
        elif paths.second_layout:
            copy = f"; keeps a plain copy ({copies[shape] >> 20} MiB)"
        logger.info(
            "linear path for %dx%d weights (%d layers): %s; one row: %s%s; %s (%s)",
            *shape,
            len(weights[shape]),
            paths.layout,
            paths.one_row or paths.layout,
            copy,
            paths.reason,
            source,
        )
        if paths.layout == "packed":
            packed.add(shape)
        if paths.one_row is not None:
            one_row[shape] = paths.one_row
    # The unmeasured parts have no one-row path: packed only where it won every shape over
    # all three row counts, one row included.
    others = all(one_layout(timings).layout == "packed" for _, timings, _ in measured.values())
    return LinearPlan(frozenset(packed), others=others, one_row=one_row, one_row_layers=fused)


def _fuse_layers(layer_shapes, measured: dict, copies: dict[Shape, int], budget: int) -> bool:
    """Whether the decoder layers run fused at one row: where they can and the plain copies
    their packed weights then keep fit in `budget`. Where not, their shapes in `measured` are
    chosen again as any other's. Logs the choice."""
    if not layer_shapes:
        return False
    need = sum(copies[s] for s in layer_shapes if s in measured and measured[s][0].second_layout)
    # A packed shape without a one-row time (its measurement failed) keeps no plain weight.
    plain_kept = all(
        s in measured and (measured[s][0].layout == "plain" or measured[s][0].one_row)
        for s in layer_shapes
    )
    if plain_kept and need <= budget:
        logger.info(
            "decoder layers at one row: one compiled call each, plain copies %d MiB",
            need >> 20,
        )
        return True
    logger.info(
        "decoder layers at one row: op by op (plain copies of %d MiB do not fit in %d MiB)",
        need >> 20,
        budget >> 20,
    )
    for shape in layer_shapes & measured.keys():
        _, timings, source = measured[shape]
        measured[shape] = (choose_paths(timings), timings, source)
    return False


def float_weights_by_shape(model: nn.Module) -> dict[Shape, list[torch.Tensor]]:
    """The float32 CPU weights of the model's linear seam (model/linear.py), by shape."""
    shapes: dict[Shape, list[torch.Tensor]] = {}
    for module in model.modules():
        if not isinstance(module, Linear) or not isinstance(module.method, FloatLinearMethod):
            continue
        weight = module.weight
        if weight is None or not prepack_supported(weight.device, weight.dtype):
            continue
        shapes.setdefault(tuple(weight.shape), []).append(weight)
    return shapes


def rotation(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The weights of a shape to take turns over: the first ones that together reach
    ROTATION_BYTES, or, where one weight alone is larger (a big vocabulary's LM head), its
    first rows up to that size, so the packed copies made to time them stay within it."""
    row_bytes = weights[0].shape[1] * weights[0].element_size()
    if weights[0].shape[0] * row_bytes > ROTATION_BYTES:
        return [weights[0][: ROTATION_BYTES // row_bytes]]
    taken, total = [], 0
    for weight in weights:
        if total + weight.shape[0] * row_bytes > ROTATION_BYTES:
            break
        taken.append(weight)
        total += weight.shape[0] * row_bytes
    return taken


def measure_linear(weights: Sequence[torch.Tensor], rows: Sequence[int] = ROWS) -> list[Timed]:
    """Seconds per weight of x W^T on each path, per row count (the numba GEMV at one row
    only), the weights timed in turn; their packed copies live only here."""
    from pagefleet.engine.model.numba_ops import linear_one_row  # compiled once imported

    packed = [pack_weight(w) for w in weights]
    timings = []
    for n in rows:
        x = torch.randn(n, weights[0].shape[1], dtype=weights[0].dtype)

        def plain(x=x):
            for w in weights:
                F.linear(x, w)

        def on_packed(x=x):
            for p in packed:
                packed_linear(x, p)

        def gemv(x=x):
            for w in weights:
                linear_one_row(x, w, None)

        paths = {"plain": plain, "packed": on_packed} | ({"gemv": gemv} if n == 1 else {})
        seconds = time_alternately(paths)
        per_weight = {k: (None if v is None else v / len(weights)) for k, v in seconds.items()}
        timings.append(Timed(f"rows={n}", per_weight))
    return timings
