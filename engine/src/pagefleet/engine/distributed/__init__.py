"""Tensor-parallel ranks of one engine: where they run and how they talk."""
