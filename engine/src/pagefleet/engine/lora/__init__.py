"""Multi-LoRA serving: PEFT adapters read and checked (adapter.py), slot-stacked deltas on the
model's linear layers (layers.py) computed batched per adapter slot (ops.py, triton_ops.py),
and the adapters' residency: resident slots and a CPU cache, both LRU (manager.py)."""
