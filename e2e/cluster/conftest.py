"""Fixtures of the cluster lab: a fresh lab per test (it starts in well under a second), and
the tiny checkpoint that engine pods serve. Every lab must leave nothing behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import worker_groups

from .lab import Lab

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TIME_FACTOR = 0.5  # every duration of a pod spec runs at half length in the lab


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    worker_groups.assign(items)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny random Llama, long enough for the examples' max-model-len (8192)."""
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("checkpoint") / "tiny-llama"
    return write_tiny_checkpoint(path, "LlamaForCausalLM", max_position_embeddings=8192)


@pytest.fixture(scope="session")
def model_store(tmp_path_factory, tiny_checkpoint) -> Path:
    """What the `models` PersistentVolumeClaim holds: the checkpoint under the folder names the
    chart and the examples use."""
    store = tmp_path_factory.mktemp("model-store")
    for name in ("llama-3-8b", "tiny", "qwen2-7b"):
        shutil.copytree(tiny_checkpoint, store / name)
    for path in [store, *store.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return store


def open_lab(root: Path, **kwargs) -> Lab:
    return Lab(root, time_factor=TIME_FACTOR, **kwargs)


@pytest.fixture
def lab(tmp_path):
    with open_lab(tmp_path / "lab") as lab:
        yield lab
    assert not lab.leftovers(), f"the lab left {lab.leftovers()}"


@pytest.fixture(scope="session")
def offline(tiny_checkpoint):
    from .fleet import Offline

    return Offline(tiny_checkpoint)
