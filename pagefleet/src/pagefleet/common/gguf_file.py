"""A GGUF file's header, read within bounds: its metadata and its tensor table (no torch).

The engine (model config, weights) and the tokenizer loader (engines and the router alike) read
GGUF files through this one parser. A GGUF is untrusted input: every count, length, dimension
and offset it declares is checked against the bytes the file really has before anything is
allocated for it, and any inconsistency is a `GGUFError` whose message is one line naming the
problem. Type numbers and block sizes are the `gguf` library's (llama.cpp's own constants).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # 1 used 32-bit counts and is long gone
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # per tensor: far past any model, far below an overflow
MAX_STRING = 1 << 24  # a key or value string (a chat template is a few KiB)

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# The least bytes one value of a type takes (a string: its 8-byte length), to bound counts.
_MIN_SIZE = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()}, GGUFValueType.STRING: 8}


class GGUFError(ValueError):
    """A file that is not a GGUF this reader accepts; the message is one line."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: its GGUF name, dims as the file lists them (ne0, the
    contiguous one, first), ggml type and where its bytes are."""

    name: str
    dims: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (torch/numpy) shape: the file's dims reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]
    file_size: int

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path.name}: no general.architecture in its metadata")
        return arch


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its name: a checkpoint folder is not one)."""
    return str(path).endswith(".gguf")


class _Cursor:
    """Reads little-endian values from a buffer, refusing to step past its end."""

    def __init__(self, buf, name: str) -> None:
        self.buf, self.pos, self.name = buf, 0, name

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str):
        if n > self.left:
            raise GGUFError(
                f"{self.name}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                f"the file has {self.left} left"
            )
        start, self.pos = self.pos, self.pos + n
        return self.buf[start : self.pos]

    def scalar(self, vtype: GGUFValueType, what: str):
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, min_size: int) -> int:
        """A declared count, refused if its items cannot fit in what is left of the file."""
        n = self.scalar(GGUFValueType.UINT64, what)
        if n * min_size > self.left:
            raise GGUFError(
                f"{self.name}: truncated or corrupt: {what} declares {n} items, more than "
                f"the {self.left} bytes left in the file can hold"
            )
        return n

    def string(self, what: str) -> str:
        n = self.scalar(GGUFValueType.UINT64, f"{what} length")
        if n > MAX_STRING:
            raise GGUFError(f"{self.name}: {what} declares a string of {n} bytes")
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.name}: {what} is not UTF-8 ({e.reason})") from None

    def strings(self, n: int, what: str) -> list[str]:
        """`n` strings in a row: `string()` inlined, as vocabularies hold ~10^5 of them."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        out = []
        try:
            for _ in range(n):
                (length,) = struct.unpack_from("<Q", buf, pos)
                pos += 8
                if length > MAX_STRING or pos + length > end:
                    raise struct.error
                out.append(str(buf[pos : pos + length], "utf-8"))
                pos += length
        except struct.error:
            raise GGUFError(f"{self.name}: truncated or corrupt: {what}[{len(out)}]") from None
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.name}: {what}[{len(out)}] is not UTF-8 ({e.reason})") from None
        self.pos = pos
        return out

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar(GGUFValueType.UINT32, f"{what} type")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFError(f"{self.name}: {what} has unknown value type {raw}") from None

    def value(self, vtype: GGUFValueType, what: str):
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(vtype, what)
        item = self.value_type(f"{what} item")
        if item == GGUFValueType.ARRAY:
            raise GGUFError(f"{self.name}: {what} is an array of arrays (not used by models)")
        n = self.count(what, _MIN_SIZE[item])
        if item == GGUFValueType.STRING:
            return self.strings(n, what)
        fmt = _SCALARS[item]
        size = struct.calcsize(fmt)
        return np.frombuffer(self.take(n * size, what), dtype=np.dtype(fmt)).tolist()


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of the GGUF at `path`, every declared size checked."""
    path = Path(path)
    return _parse(map_file(path), path)


def map_file(path: Path) -> memoryview:
    """The file mapped into memory, copy-on-write (so torch may view it without a warning; it
    is never written). The mapping lives as long as anything still views it."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    if size < 24:  # magic, version and the two counts
        raise GGUFError(f"{path.name}: truncated: {size} bytes is no GGUF header")
    with path.open("rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))


def _parse(buf, path: Path) -> GGUFHeader:
    cur = _Cursor(buf, path.name)
    magic = bytes(cur.take(4, "magic"))
    if magic != MAGIC:
        raise GGUFError(f"{path.name}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    version = cur.scalar(GGUFValueType.UINT32, "version")
    if version not in VERSIONS:
        raise GGUFError(f"{path.name}: GGUF version {version} is not supported ({VERSIONS})")
    # A tensor entry takes at least 8 (name) + 4 (dims) + 8 + 4 + 8 bytes; a key/value 8 + 4.
    n_tensors = cur.count("the tensor count", 32)
    n_kv = cur.count("the metadata count", 12)
    metadata = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        metadata[key] = cur.value(cur.value_type(key), key)
    entries = [_tensor_entry(cur, i) for i in range(n_tensors)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path.name}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = _place(entries, data_start, len(buf), path.name)
    return GGUFHeader(path, version, metadata, tensors, len(buf))


def _tensor_entry(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"tensor name #{i}")
    n_dims = cur.scalar(GGUFValueType.UINT32, f"{name} dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"{cur.name}: tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS})")
    dims = tuple(cur.scalar(GGUFValueType.UINT64, f"{name} shape") for _ in range(n_dims))
    raw_type = cur.scalar(GGUFValueType.UINT32, f"{name} type")
    offset = cur.scalar(GGUFValueType.UINT64, f"{name} offset")
    return name, dims, raw_type, offset


def _place(entries, data_start: int, file_size: int, file: str) -> dict[str, TensorInfo]:
    """Each tensor's type and byte range, refused unless it lies inside the file."""
    tensors = {}
    for name, dims, raw_type, offset in entries:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{file}: tensor {name!r} has unknown ggml type {raw_type}") from None
        nbytes = tensor_nbytes(dims, ggml_type, f"{file}: tensor {name!r}")
        start = data_start + offset
        if start + nbytes > file_size:
            raise GGUFError(
                f"{file}: truncated: tensor {name!r} needs bytes {start}..{start + nbytes}, "
                f"the file has {file_size}"
            )
        if name in tensors:
            raise GGUFError(f"{file}: tensor {name!r} is listed twice")
        tensors[name] = TensorInfo(name, dims, ggml_type, start, nbytes)
    return tensors


def tensor_nbytes(dims: tuple[int, ...], ggml_type: GGMLQuantizationType, what: str) -> int:
    """Bytes of a tensor of these dims and type: rows of whole blocks along ne0."""
    if ggml_type not in GGML_QUANT_SIZES:
        raise GGUFError(f"{what} has ggml type {ggml_type.name}, whose size is not known")
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    elements = 1
    for d in dims:
        if d < 1:
            raise GGUFError(f"{what} has a dimension of {d}")
        elements *= d
        if elements > MAX_ELEMENTS:
            raise GGUFError(f"{what} declares more than {MAX_ELEMENTS} elements")
    if dims[0] % block:
        raise GGUFError(f"{what}: its rows of {dims[0]} are not whole {ggml_type.name} blocks")
    return elements // block * block_bytes
