"""Pooling models (embeddings): the pooling runner beside the generation one.

A pooling engine runs the same scheduler, KV cache and model as a generation engine, but its
requests are prefill-only: each computes its prompt (chunked, batched by the token budget) and
finishes with one vector pooled from the final hidden states, without a sampler or a decode
step. `config.py` says which runner a checkpoint gets and how it pools (its
sentence-transformers files, or --pooler-config), `pooler.py` pools, `engine.py` is the loop.
"""
