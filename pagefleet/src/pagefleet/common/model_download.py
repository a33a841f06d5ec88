"""TEMPORARY stand-in until issue-17a merges (not committed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HfSource:
    repo: str
    revision: str = "main"


def parse_hf_uri(uri: str) -> HfSource:
    if not uri.startswith("hf://"):
        raise ValueError(f"{uri!r} is not an hf:// uri")
    rest = uri[5:]
    repo, _, rev = rest.partition("@")
    if repo.count("/") != 1 or ".." in rest:
        raise ValueError(f"bad hf uri {uri!r}")
    return HfSource(repo, rev or "main")


def cache_path(cache_dir, source: HfSource) -> Path:
    org, name = source.repo.split("/")
    return Path(cache_dir) / "hf" / org / name / source.revision
