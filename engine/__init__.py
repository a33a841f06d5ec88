"""The engine: KV-cache manager, scheduler and (later) model runner of one model replica."""
