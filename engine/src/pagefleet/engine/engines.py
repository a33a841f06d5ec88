"""Which core loop serves an engine's args: `PoolingEngine` for the pooling runner (embeddings),
else `LLMEngine` (generation). `LLM` and `AsyncLLM` build their engine here."""

from __future__ import annotations

from pagefleet.common.fleet_auth import FleetSecret
from pagefleet.common.kv_events import KVEventListener
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.model.checkpoint import read_config
from pagefleet.engine.pooling.config import resolve_runner


def make_engine(
    args: EngineArgs,
    kv_event_listener: KVEventListener | None = None,
    fleet_secret: FleetSecret | None = None,
) -> LLMEngine:
    runner = resolve_runner(args.runner, args.convert, args.model, read_config(args.model))
    if runner == "pooling":
        if args.enable_lora:
            raise ValueError("--enable-lora: LoRA adapters run with the generate runner only")
        from pagefleet.engine.pooling.engine import PoolingEngine

        return PoolingEngine(args, kv_event_listener, fleet_secret)
    return LLMEngine(args, kv_event_listener, fleet_secret)
