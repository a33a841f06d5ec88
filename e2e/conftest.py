"""Fixtures for end-to-end tests: a tiny checkpoint and `pagefleet up` fleets on 127.0.0.1."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("e2e") / "llama", "LlamaForCausalLM"))
