"""Which float32 CPU weights are oneDNN-packed (`--linear-path`): torch's plain weight (MKL
sgemm, sgemv at one row) or oneDNN's prepacked one (model/packed.py), per weight shape.

Which wins depends on the CPU and the shape. On an AMD EPYC the packed weights ran the model's
shapes about 2x faster from 8 rows up and even at one row; on an Intel Xeon they ran 0.54-1.05x
at one row and 0.83-1.59x at 16 and 64 (docs/benchmarks.md, issue 38). A weight holds one
layout, so `auto` times both paths on this rank's own weights of each shape of the linear seam
(model/linear.py) at 1, 16 and 64 rows (single-stream decode, a moderate batch, a large one),
taking turns over up to 256 MiB of them so they come from memory as in a step, and packs a
shape only where the pure rule (cpu_choice/decide.py) says packed wins over the rows. The
times are kept per CPU model (cpu_choice/measure.py): a machine measures each shape once.

The families' parts outside the seam (MoE experts, a router's gate, a linear-attention layer's
plain projections) are not measured: `auto` packs them only where packed won every measured
shape, as it did on the EPYC; otherwise they keep the plain default.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.config import LINEAR_PATHS
from pagefleet.engine.cpu_choice.decide import Timed, choose
from pagefleet.engine.cpu_choice.measure import TimingCache, cached_timings, time_alternately
from pagefleet.engine.model.linear import FloatLinearMethod, Linear
from pagefleet.engine.model.packed import pack_weight, packed_linear, prepack_supported

logger = logging.getLogger(__name__)

CANDIDATES = ("plain", "packed")
DEFAULT = "plain"  # torch's own path: what a tie or a failed measurement keeps
ROWS = (1, 16, 64)
# Weights of one shape are timed in turn, up to this many bytes of them: in a step each layer's
# weight comes from memory, not from the cache the previous call left it in (a 1-row product
# is bandwidth-bound, and the paths differ in how close they get to the bandwidth).
ROTATION_BYTES = 256 << 20

Shape = tuple[int, int]


@dataclass(frozen=True)
class LinearPlan:
    """Which float weight shapes of the seam are packed (`everything`: all), and whether the
    families' unmeasured parts are (`others`)."""

    packed: frozenset[Shape] = frozenset()
    everything: bool = False
    others: bool = False

    def packs(self, shape: Shape) -> bool:
        return self.everything or shape in self.packed


PACK_ALL = LinearPlan(everything=True, others=True)
PACK_NONE = LinearPlan()


def linear_plan(path: str, weights: dict[Shape, list[torch.Tensor]], cache=None) -> LinearPlan:
    """The plan for `--linear-path` `path` given the model's float seam weights by shape (only
    `auto` reads them). Logs each measured choice with its reason."""
    if path not in LINEAR_PATHS:
        raise ValueError(f"--linear-path {path!r}: one of {', '.join(LINEAR_PATHS)}")
    if path == "packed":
        return PACK_ALL
    if path == "plain" or not weights:
        return PACK_NONE
    cache = cache if cache is not None else TimingCache()
    packed = set()
    for shape, same in sorted(weights.items()):
        subject = f"linear {shape[0]}x{shape[1]}"
        timings, source = cached_timings(
            cache, subject, lambda same=same: measure_linear(rotation(same))
        )
        choice = choose(CANDIDATES, DEFAULT, timings)
        logger.info(
            "linear path for %dx%d weights (%d layers): %s; %s (%s)",
            *shape,
            len(same),
            choice.name,
            choice.reason,
            source,
        )
        if choice.name == "packed":
            packed.add(shape)
    return LinearPlan(frozenset(packed), others=len(packed) == len(weights))


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
    """Seconds per weight of x W^T on each path, per row count, the weights timed in turn;
    their packed copies live only here."""
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

        seconds = time_alternately({"plain": plain, "packed": on_packed})
        per_weight = {k: (None if v is None else v / len(weights)) for k, v in seconds.items()}
        timings.append(Timed(f"rows={n}", per_weight))
    return timings
