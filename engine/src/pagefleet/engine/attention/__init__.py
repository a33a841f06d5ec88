"""Paged attention backends: the KV pool is read through block tables, written via slots."""
