"""Prompt-sized products on tinygemm's packed 4-bit weights (quant/cpu_kernels.py): the weight
dequantized a tile at a time into bfloat16 and multiplied by torch's bfloat16 matmul.

tinygemm's CPU kernel dequantizes each weight block again for every few rows of input, so its
time grows with the rows as a float GEMM's would at a fraction of its rate: 256 rows of a
576x3072 weight took 5.5-6.1 ms, where oneDNN's bfloat16 matmul (AMX on an Intel Xeon) took
0.65 ms on the dequantized weight. Here each tile of output rows is dequantized once, into a
buffer of about TILE_BYTES, and multiplied with all the input rows: 2.0 ms in all for that
weight (docs/benchmarks.md, issue 31). The float weight is never held whole. From how many rows
the tiles take a step is measured per machine and weight shape at load (`choose_tile_rows`,
which also measures quant/row_codes.py's float32 tiles of 8-bit codes against their loops);
a step of a few rows keeps tinygemm, which reads the codes once and whose sums do not depend on
the batch (the tiles' do, in their last bits).

The tiles read tinygemm's own packed bytes (no second copy of the codes). Its layout depends
on the instruction set torch was built for: blocks of B output rows (64 with AVX-512, 32 with
AVX2), within a block one run of B/2 bytes per input column, byte i holding row i in its low
nibble and row B/2 + i in its high one. `tinygemm_block` finds the block once, on a probe
weight packed and read back; a build with another layout, or a weight without whole blocks,
keeps tinygemm at every size.

Each weight is `(q - 8) * scale + zero` with tinygemm's own bfloat16 scale and zero, rounded to
bfloat16 (nearest even) as the matmul takes it: within a bfloat16 step of what tinygemm
multiplies by, with the same bfloat16 activations and float32 sums.
"""

from __future__ import annotations

import functools
import logging

import numba
import numpy as np
import torch

from pagefleet.engine.cpu_choice.decide import Timed, choose
from pagefleet.engine.cpu_choice.measure import TimingCache, cached_timings, time_alternately
from pagefleet.engine.kernel_cache import match_torch_threads, use_image_kernels

use_image_kernels()  # before the kernel below is defined (and loaded or compiled)
logger = logging.getLogger(__name__)

TILE_BYTES = 1 << 20  # a tile's bfloat16 weights: within a core's L2 beside the rows
BLOCKS = (64, 32)  # tinygemm's output-row blocks: AVX-512 builds, AVX2 ones (not scalar builds')

_FAST = {"reassoc", "nsz", "arcp"}  # no contraction: (q - 8) * s + z rounds as written


@numba.njit(
    numba.void(
        numba.uint8[::1],
        numba.uint16[:, :, ::1],
        numba.int64,
        numba.int64,
        numba.int64,
        numba.int64,
        numba.uint16[:, ::1],
        numba.int64,
    ),
    parallel=True,
    fastmath=_FAST,
    cache=True,
    nogil=True,
)
def _dequantize_tile(packed, scale_zeros, group, block, first_row, k_rows, out, threads):
    """out[k, j] = bfloat16((q - 8) * scale + zero) of weight row first_row + j and input
    column k, for the tile's out.shape[1] rows (whole blocks). `packed`: tinygemm's bytes,
    flat; `scale_zeros` [groups, rows, 2] bfloat16 bits; `k_rows`: the input width; the input
    columns split into `threads` runs."""
    width = out.shape[1]
    half = block // 2
    per = (k_rows + threads - 1) // threads
    for t in numba.prange(threads):
        start, stop = t * per, min(k_rows, (t + 1) * per)
        scale_bits = np.empty(block, np.uint32)
        zero_bits = np.empty(block, np.uint32)
        values = np.empty(block, np.float32)
        value_bits = values.view(np.uint32)
        scales, zeros = scale_bits.view(np.float32), zero_bits.view(np.float32)
        for b in range(width // block):
            col = b * block
            current = -1
            for k in range(start, stop):
                g = k // group
                if g != current:  # bfloat16 bits -> float32: the high half of the word
                    for j in range(block):
                        scale_bits[j] = np.uint32(scale_zeros[g, first_row + col + j, 0]) << 16
                        zero_bits[j] = np.uint32(scale_zeros[g, first_row + col + j, 1]) << 16
                    current = g
                base = ((first_row // block + b) * k_rows + k) * half
                for i in range(half):
                    byte = packed[base + i]
                    low = np.float32(byte & np.uint8(15)) - np.float32(8.0)
                    high = np.float32(byte >> np.uint8(4)) - np.float32(8.0)
                    values[i] = low * scales[i] + zeros[i]
                    values[half + i] = high * scales[half + i] + zeros[half + i]
                row = out[k]
                for j in range(block):  # round to nearest even, as torch casts
                    v = value_bits[j]
                    row[col + j] = np.uint16((v + ((v >> 16) & 1) + 0x7FFF) >> 16)


def _tinygemm_codes(packed: torch.Tensor, block: int) -> torch.Tensor | None:
    """The codes [rows, k] (0..15) tinygemm's `packed` [rows, k / 2] holds in blocks of
    `block` rows, or None where the rows are not whole blocks."""
    rows, k = packed.shape[0], 2 * packed.shape[1]
    if rows % block:
        return None
    both = packed.contiguous().view(torch.uint8).reshape(rows // block, k, block // 2)
    blocks = torch.cat([both & 15, both >> 4], dim=2)  # [blocks, k, block]: row b*block + j
    return blocks.permute(0, 2, 1).reshape(rows, k)


@functools.cache
def tinygemm_block() -> int | None:
    """The block of output rows this torch build's tinygemm packs in, as BLOCKS reads it, or
    None for a layout the tiles do not read (another build): found once, on a probe weight
    two blocks of every kind tall. It is fixed by the build, so a weight need only have whole
    blocks."""
    rows, k = 2 * max(BLOCKS), 64
    codes = torch.randint(0, 16, (rows, k), generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    for block in BLOCKS:
        if torch.equal(_tinygemm_codes(packed, block), codes.to(torch.uint8)):
            return block
    return None


class Int4Tiles:
    """x W^T for many rows of bfloat16 x on tinygemm's packed weight (see the module
    docstring); `of` builds one where this build's layout is one the tiles read."""

    def __init__(self, packed: np.ndarray, scale_zeros, group: int, block: int, k: int) -> None:
        self.packed, self.scale_zeros = packed, scale_zeros
        self.group, self.block, self.k = group, block, k
        rows = scale_zeros.shape[1]
        # A tile holds whole blocks: one block even where that passes TILE_BYTES (k > 8192).
        per_tile = max(block, TILE_BYTES // (2 * k) // block * block)
        self.tiles = [(r, min(rows, r + per_tile)) for r in range(0, rows, per_tile)]
        self.rows = rows
        self.buffer_elements = k * min(rows, per_tile)

    @classmethod
    def of(cls, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int):
        """Tiles over tinygemm's `packed` weight [rows (padded), k / 2] and its `scale_zeros`
        [k / group, rows, 2] bfloat16, or None where this build's layout is not one the
        tiles read or the rows are not whole blocks of it (the weight stays on tinygemm)."""
        block = tinygemm_block()
        rows, k = packed.shape[0], 2 * packed.shape[1]
        if block is None or rows % block or k % group:
            return None
        if tuple(scale_zeros.shape) != (k // group, rows, 2):
            raise ValueError(f"scale/zero pairs {tuple(scale_zeros.shape)} for a {rows}x{k} weight")
        flat = packed.contiguous().view(torch.uint8).numpy().reshape(-1)
        sz = scale_zeros.contiguous().view(torch.uint16).numpy()
        return cls(flat, sz, group, block, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[m, k] bfloat16 -> [m, rows] bfloat16 (rows: the padded output width)."""
        threads = match_torch_threads()
        out = torch.empty(x.shape[0], self.rows, dtype=torch.bfloat16)
        buffer = np.empty(self.buffer_elements, np.uint16)
        for start, stop in self.tiles:
            tile = buffer[: self.k * (stop - start)].reshape(self.k, stop - start)
            _dequantize_tile(
                self.packed, self.scale_zeros, self.group, self.block, start, self.k, tile, threads
            )
            weight = torch.from_numpy(tile.view(np.int16)).view(torch.bfloat16)
            if len(self.tiles) == 1:
                torch.mm(x, weight, out=out)
            else:
                out[:, start:stop] = torch.mm(x, weight)
        return out


# Where the tiles may take over. They pay for dequantizing the whole weight at each call, which
# tinygemm's per-row cost overtakes somewhere above 64 rows here (about even at 64): measured
# per machine and shape at these row counts, by the load (`choose_tile_rows`).
MEASURED_ROWS = (128, 256, 512)
PATHS = ("tinygemm", "tiles")


def measure_paths(paths_at, rows: tuple[int, ...] = MEASURED_ROWS) -> list[Timed]:
    """Seconds per call of each path on one weight at each row count (`paths_at(rows)`: the
    calls by path name, on an input of that many rows)."""
    return [Timed(f"rows={n}", time_alternately(paths_at(n))) for n in rows]


def tile_rows(timings: list[Timed], paths: tuple[str, str] = PATHS) -> tuple[int | None, str]:
    """The fewest rows from which the tiles (`paths[1]`) take a step, and why: the smallest
    measured row count from which they beat the other path by the margin at every measured
    count (decide.py's rule, class by class; a tie, a loss or a failed measurement keeps the
    other path there). None: the other path at every size."""

    def rows_of(timed: Timed) -> int:
        return int(timed.label.removeprefix("rows="))

    rows = None
    reasons = []
    for timed in sorted(timings, key=rows_of, reverse=True):
        choice = choose(paths, paths[0], [timed])
        reasons.append(f"{timed.label}: {choice.reason}")
        if choice.name != paths[1]:
            break
        rows = rows_of(timed)
    return rows, "; ".join(reversed(reasons))


def choose_tile_rows(planes: list, cache: TimingCache | None = None) -> None:
    """Each plane's `tile_rows` (quant/cpu_kernels.py's TinyGemmPlane and CodesPlane: their
    `tile_subject`, `tile_paths`, `PATHS` and `MEASURED_ROWS`), measured once per machine and
    weight shape on the first plane of that shape (cpu_choice/measure.py keeps the times),
    after the whole model is loaded. Logs each shape's choice."""
    cache = cache if cache is not None else TimingCache()
    by_subject: dict[str, list] = {}
    for plane in planes:
        subject = plane.tile_subject()
        if subject is not None:
            by_subject.setdefault(subject, []).append(plane)
    for subject, same in by_subject.items():
        first = same[0]
        timings, source = cached_timings(
            cache,
            subject,
            lambda first=first: measure_paths(first.tile_paths, first.MEASURED_ROWS),
        )
        rows, reason = tile_rows(timings, first.PATHS)
        logger.info(
            "%s (%d weights): tiles from %s rows; %s (%s)",
            subject,
            len(same),
            rows if rows is not None else "no number of",
            reason,
            source,
        )
        for plane in same:
            plane.tile_rows = rows
