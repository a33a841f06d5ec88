"""Pieces every role shares: block hashing, the KV-event schema, fleet authentication, metric
parsing, tokenizer loading, HTTP error bodies, label names, the KV release client; and the CLI.
Nothing here imports a role, torch, triton or nixl."""

__version__ = "0.1.0"
