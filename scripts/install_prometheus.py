"""Install the real `prometheus` and `promtool` (Debian's `prometheus` package) into .venv/bin,
idempotently, for the metrics tests and `make lint`.

apt (the machine's ordinary package client, which checks the package against the signed
archive) downloads the .deb into a cache folder and the two binaries are unpacked from it:
nothing is installed system-wide, so no service is enabled, started or listening; tests start
their own process on addresses they own. Binaries already there that report a supported
version need no network.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
import install_helm

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PrometheusSource:
    """The Debian package that holds the binaries, and the oldest release the tests are
    written against (rule unit tests, the query API and the scrape options they use)."""

    package: str = "prometheus"
    binaries: tuple[str, ...] = ("prometheus", "promtool")
    min_version: tuple[int, int] = (2, 42)


def default_cache() -> Path:
    return install_helm.default_cache().parent / "prometheus-download"


def version_of(binary: Path) -> tuple[int, int] | None:
    """(major, minor) that `binary --version` reports, or None if it does not run."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    found = re.search(r"version (\d+)\.(\d+)\.", out.stdout + out.stderr)
    return (int(found[1]), int(found[2])) if found and out.returncode == 0 else None


def is_installed(dest_dir: Path, source: PrometheusSource) -> bool:
    for name in source.binaries:
        version = version_of(dest_dir / name)
        if version is None or version < source.min_version or version[0] != 2:
            return False
    return True


def _apt_download(cache: Path, source: PrometheusSource) -> subprocess.CompletedProcess:
    # The sandbox user cannot write a root-owned cache folder; apt still checks the hashes.
    cmd = ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", source.package]
    return subprocess.run(cmd, cwd=cache, capture_output=True, text=True)


def download_deb(cache: Path, source: PrometheusSource) -> Path:
    """The newest cached .deb of the package, fetched with apt if none is there. Package lists
    never fetched on this machine are fetched once (as root, `apt-get update`)."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{source.package}_*.deb"))
    if found:
        return found[-1]
    out = _apt_download(cache, source)
    if out.returncode != 0 and os.geteuid() == 0:
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
        out = _apt_download(cache, source)
    if out.returncode != 0:
        raise RuntimeError(
            f"apt-get download {source.package} failed (run `apt-get update` as root first?): "
            f"{out.stderr.strip()}"
        )
    found = sorted(cache.glob(f"{source.package}_*.deb"))
    if not found:
        raise RuntimeError(f"apt downloaded no {source.package}_*.deb into {cache}")
    return found[-1]


def extract_binaries(deb: Path, source: PrometheusSource) -> dict[str, bytes]:
    """The binaries' bytes from the package's file tree (dpkg-deb reads the archive)."""
    tree = subprocess.run(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True
    ).stdout
    out = {}
    with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
        for name in source.binaries:
            member = tar.extractfile(f"./usr/bin/{name}")
            if member is None:
                raise RuntimeError(f"/usr/bin/{name} is not a file in {deb.name}")
            out[name] = member.read()
    return out


def install_prometheus(
    dest_dir: Path, cache: Path, source: PrometheusSource = PrometheusSource()
) -> dict[str, Path]:
    """Ensure `dest_dir` holds a supported prometheus and promtool; their paths. No network
    when they are already there."""
    paths = {name: dest_dir / name for name in source.binaries}
    if is_installed(dest_dir, source):
        return paths
    deb = download_deb(cache, source)
    try:
        binaries = extract_binaries(deb, source)
    except (subprocess.CalledProcessError, KeyError, tarfile.TarError):
        # A truncated or foreign file in the cache: fetch it again once.
        deb.unlink()
        binaries = extract_binaries(download_deb(cache, source), source)
    for name, data in binaries.items():
        install_helm.write_executable(paths[name], data)
    if not is_installed(dest_dir, source):
        got = {name: version_of(path) for name, path in paths.items()}
        raise RuntimeError(f"{deb.name} gave {got}, need 2.x >= {source.min_version}")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest-dir", type=Path, default=ROOT / ".venv" / "bin")
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args(argv)
    for path in install_prometheus(args.dest_dir, args.cache).values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
