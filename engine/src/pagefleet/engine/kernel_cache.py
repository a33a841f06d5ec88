"""Where the engine's numba kernels are cached, so that a pod with a read-only root filesystem
loads the kernels its image compiled instead of compiling them again at every start; and how
many threads their parallel loops run on (`match_torch_threads`).

numba keeps a compiled kernel beside its source (`__pycache__`) only where it may write
there; elsewhere it compiles into the user's cache, which in a pod is an emptyDir that starts
empty. Compiling the engine's kernels takes 10-15 s of CPU. With `use_image_kernels()` a
kernel whose source directory is read-only is cached in the user's directory, filled first
with that kernel's files from beside its source (what `python -m pagefleet.engine.kernel_cache`
wrote when the image was built). numba's index checks the source's content and the CPU the
code was compiled for: a kernel from an image built on another kind of CPU is compiled again,
as it is without the image's copy.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numba
from numba.core import caching, config

log = logging.getLogger(__name__)

# Older numba releases named these with a leading underscore (and take no locator list).
_USER_WIDE = getattr(caching, "UserWideCacheLocator", None) or caching._UserWideCacheLocator
_CACHE_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl
_USER_DIR, _IN_TREE = _CACHE_IMPL._locator_classes[:2]


class CalleeStamp:
    """A kernel's source stamp covering the files of the kernels it calls, as its module lists
    them in `KERNEL_CALLEES`: numba checks only the file a kernel is defined in, so a kernel
    compiled together with kernels of other files would keep their old code after they
    change (model/one_row_decode.py calls numba_ops's and numba_paged's)."""

    @classmethod
    def from_function(cls, py_func, py_file):
        locator = super().from_function(py_func, py_file)
        if locator is not None:
            locator.callees = tuple(py_func.__globals__.get("KERNEL_CALLEES", ()))
        return locator

    def get_source_stamp(self):
        stamp = super().get_source_stamp()
        if not getattr(self, "callees", ()):
            return stamp
        digest = hashlib.sha256(stamp if isinstance(stamp, bytes) else repr(stamp).encode())
        for path in self.callees:
            digest.update(Path(path).read_bytes())
        return digest.digest()


class UserDirLocator(CalleeStamp, _USER_DIR):
    """numba's cache in the user's NUMBA_CACHE_DIR."""


class InTreeLocator(CalleeStamp, _IN_TREE):
    """numba's cache beside the source, where it may write there."""


class ImageSeededCacheLocator(CalleeStamp, _USER_WIDE):
    """numba's user-wide cache, first given the kernel's files from beside its source."""

    @classmethod
    def from_function(cls, py_func, py_file):
        locator = super().from_function(py_func, py_file)
        if locator is not None:
            prefix = kernel_files_prefix(py_func, py_file)
            cache = Path(locator.get_cache_path())
            if seed(Path(py_file).parent / "__pycache__", cache, prefix):
                log.info(
                    "numba kernel %s: the compiled copy beside its source, in %s",
                    prefix[:-1],
                    cache,
                )
        return locator


def kernel_files_prefix(py_func, py_file: str) -> str:
    """The start of the names numba gives one kernel's cache files (its index `.nbi`, its
    compiled overloads `.nbc`): module, qualified name, first line."""
    qualname = py_func.__qualname__.replace("<", "").replace(">", "")
    return f"{Path(py_file).stem}.{qualname}-{py_func.__code__.co_firstlineno}."


def seed(source: Path, cache: Path, prefix: str) -> list[str]:
    """Copy one kernel's cache files from `source` into `cache` where `cache` has no index for
    it yet (an index there is newer: this process or an earlier one compiled into it). Each
    file lands whole (written aside, then renamed): another process may be reading."""
    try:
        files = sorted(p for p in source.iterdir() if p.name.startswith(prefix))
    except OSError:  # no compiled copy beside the source
        return []
    if not any(p.suffix == ".nbi" for p in files) or any(cache.glob(f"{prefix}*.nbi")):
        return []
    copied = []
    # The data files first: an index must never name a file that is not there yet.
    for path in sorted(files, key=lambda p: p.suffix == ".nbi"):
        fd, partial = tempfile.mkstemp(dir=cache, prefix=".seed-")
        with os.fdopen(fd, "wb") as out, path.open("rb") as src:
            shutil.copyfileobj(src, out)
        os.replace(partial, cache / path.name)
        copied.append(path.name)
    return copied


# numba's own order (a user's NUMBA_CACHE_DIR, then beside the source), then ours in place of
# its user-wide locator.
LOCATORS = ",".join(
    f"{__name__}.{c.__name__}" for c in (UserDirLocator, InTreeLocator, ImageSeededCacheLocator)
)


def use_image_kernels() -> None:
    """Cache this process's kernels as the module doc says; call before the kernels are
    defined (numba picks a kernel's locator then). A list the user set in
    NUMBA_CACHE_LOCATOR_CLASSES is kept. Set in numba's config, not in the environment: a
    child process that is not an engine (and may not import this module) keeps numba's own.
    (numba re-reads its config when a NUMBA_ variable changes, which an engine never does.)"""
    if not os.environ.get("NUMBA_CACHE_LOCATOR_CLASSES"):
        config.CACHE_LOCATOR_CLASSES = LOCATORS


def match_torch_threads() -> int:
    """numba's threads set to torch's (the engine's share of the machine), within numba's
    pool, before a parallel kernel runs; returns the count."""
    import torch

    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)
    return threads


def compile_all() -> None:
    """Compile every kernel the engine may run on a CPU into its cache (an image build runs
    this where the source directories are writable: the copies land beside the source)."""
    import torch

    from pagefleet.engine.attention import numba_paged
    from pagefleet.engine.model import numba_ops, one_row_decode  # noqa: F401  (compiled on import)
    from pagefleet.engine.model.quant import int4_tiles, int8_numba  # noqa: F401

    numba_paged.warm_up()
    print(f"numba {numba.__version__}: the engine's CPU kernels are compiled ({torch.__version__})")


if __name__ == "__main__":
    compile_all()
