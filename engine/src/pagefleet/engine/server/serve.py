"""`pagefleet serve MODEL`: flags (vLLM's names), the uvicorn server, graceful SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

import uvicorn

from pagefleet.common.fleet_auth import FieldSigner, load_fleet_secret
from pagefleet.engine.config import KV_CACHE_DTYPES, LINEAR_PATHS, EngineArgs

logger = logging.getLogger("pagefleet.server")


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve one model over an OpenAI-compatible HTTP API",
        description="Serve a local Hugging Face checkpoint or GGUF file with vLLM's API, "
        "metrics and flags.",
    )
    p.add_argument("model", help="a local Hugging Face checkpoint directory or GGUF file")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (8000)")
    _add_engine_flags(p)
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEFLEET_API_KEY"),
        help="require this bearer key on the API (or set PAGEFLEET_API_KEY)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 with Retry-After beyond this many waiting requests",
    )
    p.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=None,
        help="answer 400 beyond this many sequences (prompts x n) in one request "
        "(default: --max-num-seqs)",
    )
    p.add_argument(
        "--client-stall-timeout",
        type=float,
        default=30.0,
        help="abort a request whose client leaves its output unread this long, in seconds (30)",
    )
    p.add_argument(
        "--fleet-secret-file",
        default=None,
        help="file holding the secret this engine's router and KV peers share (or set "
        "PAGEFLEET_FLEET_SECRET_FILE or PAGEFLEET_FLEET_SECRET); needed for "
        "--kv-transfer-config, and for kv_transfer_params from the router",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 << 20,
        help="answer 413 beyond this request body size (4 MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (30)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between throughput log lines; 0 = off (10)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (warning)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="no forward pass: the real scheduler, cache, metrics and events with a calibrated "
        "step-time model and filler tokens (the model dir gives the tokenizer and config only)",
    )
    p.add_argument(
        "--simulate-profile",
        default=None,
        help="time-model coefficients as JSON or a JSON file (see engine/simulated.py; "
        "default: shaped like an 8B model on one H100)",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help="publish KV-cache events; vLLM's JSON, e.g. "
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}',
    )
    _add_tool_flags(p)
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora "
        "and --lora-root): clients holding the API key may then load adapters from there",
    )
    p.add_argument(
        "--lora-root",
        default=None,
        help="the only folder run-time loaded LoRA adapters may come from (symlinks followed)",
    )
    p.set_defaults(func=run_serve)


def _add_tool_flags(p: argparse.ArgumentParser) -> None:
    from pagefleet.engine.server.tool_parsers import TOOL_CALL_PARSERS

    p.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='parse tool calls out of the output for tool_choice "auto" (needs '
        "--tool-call-parser); required and named tool choices work without it",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the checkpoint's tool-call format: hermes (<tool_call>{json}</tool_call>, Qwen) "
        "or llama3_json (Llama 3.1+)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the template itself) instead of the "
        "checkpoint's, e.g. one that renders tools",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='leave the tools out of the prompt when tool_choice is "none"',
    )


def chat_template_from(value: str | None) -> str | None:
    """vLLM's --chat-template: a file's contents, or the value itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        return path.read_text() if path.is_file() else value
    except OSError:  # a long template is no valid path
        return value


def lora_updates_from(args: argparse.Namespace):
    """Run-time adapter loading (server/lora_routes.py), or None; ValueError for flags that
    do not go together."""
    from pagefleet.engine.server.lora_routes import LoRAUpdates

    if not args.allow_runtime_lora_updating:
        if args.lora_root is not None:
            raise ValueError("--lora-root is read only with --allow-runtime-lora-updating")
        return None
    if not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    if args.lora_root is None or not Path(args.lora_root).is_dir():
        raise ValueError("--allow-runtime-lora-updating needs --lora-root, an existing folder")
    return LoRAUpdates(Path(args.lora_root).resolve())


def tool_call_config(args: argparse.Namespace):
    from pagefleet.engine.server.tool_parsers import ToolCallConfig

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return ToolCallConfig(
        args.enable_auto_tool_choice,
        args.tool_call_parser,
        args.exclude_tools_when_tool_choice_none,
    )


def _default(name: str):
    return EngineArgs.__dataclass_fields__[name].default


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags with EngineArgs' names; every default is EngineArgs' own (one set of defaults)."""

    def flag(name: str, help: str, **kwargs) -> None:
        default = _default(name)
        shown = "" if default is None else " (%(default)s)"
        p.add_argument("--" + name.replace("_", "-"), default=default, help=help + shown, **kwargs)

    def switch(name: str, help: str) -> None:
        flag(name, help, action=argparse.BooleanOptionalAction)

    flag("served_model_name", "model name in the API (default: the model path)")
    flag("tokenizer", "a folder with the Hugging Face tokenizer to use (default: the model's)")
    flag(
        "max_model_len",
        "most tokens (prompt + output) per request (default: the model's)",
        type=int,
    )
    flag("max_num_seqs", "most running requests", type=int)
    flag("max_num_batched_tokens", "token budget of one engine step", type=int)
    flag("block_size", "tokens per KV block", type=int)
    switch("enable_prefix_caching", "reuse KV blocks of shared prefixes")
    switch("enable_chunked_prefill", "split long prompts over steps")
    flag("max_num_partial_prefills", "prompts split over steps at once", type=int)
    flag(
        "long_prefill_token_threshold",
        "most prompt tokens per request per step; 0 = the budget",
        type=int,
    )
    flag(
        "gpu_memory_utilization",
        "fraction of GPU memory for weights, activations and KV",
        type=float,
    )
    flag("kv_cache_memory", "GiB of KV cache on CPU (per tensor-parallel rank)", type=float)
    flag(
        "num_gpu_blocks_override",
        "KV blocks in the pool, overriding the memory-based size",
        type=int,
    )
    flag(
        "dtype",
        "weights and activations dtype (auto: float32 on CPU, bfloat16 on CUDA)",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
    )
    flag(
        "quantization",
        "weight format: fp8, compressed-tensors, awq, gptq, gguf (default: the checkpoint's "
        "quantization_config; fp8 on a float checkpoint quantizes it at load; none dequantizes "
        "a GGUF file into --dtype at load)",
    )
    flag(
        "kv_cache_dtype",
        "KV cache dtype (auto: the model's; fp8 = fp8_e4m3: half the bytes of a 16-bit cache, "
        "per-layer scales from the checkpoint's k_scale/v_scale, else 1.0)",
        choices=list(KV_CACHE_DTYPES),
    )
    flag("device", "cpu, cuda or auto")
    flag(
        "linear_path",
        "float32 CPU linears: packed (oneDNN-prepacked weights), plain (torch's MKL path) or "
        "auto (per weight shape, whichever measures faster on this CPU at 1, 16 and 64 rows; "
        "measured once per CPU model, kept in ~/.cache/pagefleet/cpu-choices.json, logged)",
        choices=list(LINEAR_PATHS),
    )
    flag(
        "attention_backend",
        "paged-attention kernels (auto: triton on CUDA; on CPU torch or numba, the in-place "
        "decode kernel, whichever measures faster for the model on this CPU, kept and logged)",
        choices=["auto", "triton", "numba", "torch"],
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=_default("enforce_eager"),
        help="no CUDA graphs: run decode steps eagerly (graphs are captured at start-up)",
    )
    flag("seed", "seed of unseeded sampling", type=int)
    flag(
        "kv_transfer_config",
        "disaggregated prefill/decode; vLLM's JSON, e.g. "
        '{"kv_connector": "nixl", "kv_role": "kv_producer"} (kv_connector nixl or tcp; kv_role '
        "kv_producer, kv_consumer or kv_both; optional kv_ip (address peers use, 127.0.0.1), "
        "kv_port (14579), kv_bind_host, transfer_timeout (30 s))",
    )
    flag(
        "kv_hold_timeout",
        "seconds a prefill engine holds a request's blocks for its decode engine",
        type=float,
    )
    flag(
        "tensor_parallel_size",
        "ranks (one GPU each) the weights and KV heads are split over",
        type=int,
    )
    flag(
        "distributed_executor_backend",
        "where ranks 1.. run: mp (local processes) or ray (actors, several nodes); default: mp "
        "while the ranks fit this node's GPUs, else ray",
        choices=["mp", "ray"],
    )
    switch(
        "enable_expert_parallel",
        "mixture-of-experts models: place whole experts on the tensor-parallel ranks instead "
        "of a slice of every expert on each",
    )
    flag(
        "all2all_backend",
        "with --enable-expert-parallel, how tokens meet their experts: allgather_reducescatter "
        "(one all-reduce, tokens are on every rank already) or alltoall (routed rows sent to "
        "the ranks holding their experts and back)",
    )
    flag(
        "kv_offloading_size",
        "GiB of host memory (pinned on CUDA) for a CPU tier of blocks evicted from the KV pool; "
        "a prefix found there is loaded back instead of recomputed (0: none)",
        type=float,
    )
    flag(
        "speculative_config",
        "speculative decoding; vLLM's JSON, e.g. "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} '
        "(method ngram; num_speculative_tokens 1..16; prompt_lookup_min (1) and "
        "prompt_lookup_max (4): n-gram lengths looked up in the request's tokens)",
    )
    flag(
        "num_state_snapshots",
        "hybrid models: linear-attention states kept for prefix-cache hits (default: "
        "--max-num-seqs with prefix caching, else 1)",
        type=int,
    )
    flag(
        "runner",
        "generate, or pooling (embeddings: /v1/embeddings and /pooling); auto picks pooling for "
        "a checkpoint that declares it (sentence-transformers modules.json, or a *Model "
        "architecture without an LM head)",
        choices=["auto", "generate", "pooling"],
    )
    flag(
        "convert",
        "embed: pool a *ForCausalLM checkpoint's hidden states (auto: embed under --runner "
        "pooling)",
        choices=["auto", "none", "embed"],
    )
    flag(
        "pooler_config",
        "how a pooling model pools, over its sentence-transformers files; vLLM's JSON, e.g. "
        '{"pooling_type": "MEAN", "normalize": false} (pooling_type LAST, MEAN or CLS; '
        "normalize (or use_activation); dimensions: a default Matryoshka width)",
    )
    flag(
        "kv_offloading_backend",
        "the offload tier's implementation (lmcache is not built into pagefleet)",
        choices=["native", "lmcache"],
    )
    switch("enable_lora", "serve LoRA adapters: a request's model may name one")
    flag(
        "lora_modules",
        "LoRA adapters (PEFT folders) served from the start: name=path, or JSON "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}\'',
        nargs="+",
    )
    flag("max_loras", "LoRA adapters one engine step runs (resident slots)", type=int)
    flag("max_lora_rank", "largest LoRA rank an adapter may have", type=int)
    flag(
        "max_cpu_loras",
        "LoRA adapters kept in host memory, least recently used dropped (default: --max-loras)",
        type=int,
    )


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags: every field but `simulate` is a flag of the same name."""
    names = [f for f in EngineArgs.__dataclass_fields__ if f != "simulate"]
    return EngineArgs(**{name: getattr(args, name) for name in names}, simulate=_simulation(args))


def _simulation(args: argparse.Namespace):
    if not args.simulate:
        if args.simulate_profile:
            raise ValueError("--simulate-profile needs --simulate")
        return None
    from pagefleet.engine.simulated import SimulationProfile

    return SimulationProfile.load(args.simulate_profile)


def run_serve(args: argparse.Namespace, banner: str | None = None) -> int:
    """Serve until SIGTERM or Ctrl-C; `banner` is printed once the server accepts requests."""
    from pagefleet.engine.async_llm import AsyncLLM
    from pagefleet.engine.server.app import ServerConfig, build_app

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tools = tool_call_config(args)  # a flag error before the model loads
    lora_updates = lora_updates_from(args)
    secret = load_fleet_secret(args.fleet_secret_file)
    publisher = None
    if args.kv_events_config:
        from pagefleet.engine.kv_event_publisher import KVEventsConfig, ZmqEventPublisher

        events_config = KVEventsConfig.from_json(args.kv_events_config)
        if events_config.enable_kv_cache_events and events_config.publisher == "zmq":
            publisher = ZmqEventPublisher(events_config, secret)
    engine = AsyncLLM.from_engine_args(
        engine_args_from(args),
        publisher.add if publisher else None,
        secret,
        args.client_stall_timeout,
    )
    if publisher is not None:
        engine.subscribe(publisher)  # one batch of events per step
    name = args.served_model_name or args.model
    app = build_app(
        engine,
        ServerConfig(
            name,
            args.api_key,
            args.max_waiting_requests,
            args.max_request_body_bytes,
            FieldSigner(secret) if secret else None,
            args.max_sequences_per_request,
            tools,
            chat_template_from(args.chat_template),
            lora_updates,
        ),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = DrainingServer(config, app)
    announced = f"serving {name} on http://{args.host}:{args.port}"
    try:
        asyncio.run(_serve(server, announced, banner, args.log_stats_interval))
    finally:
        engine.shutdown()
        if publisher is not None:
            publisher.shutdown()
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, but SIGTERM first fails readiness, then drains and exits 0 (uvicorn
    would re-raise the signal after draining, which makes the exit status 143)."""

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig, frame) -> None:
        self.app.state.server.draining = True
        if sig == signal.SIGTERM:
            logger.info("SIGTERM: draining in-flight requests, then exiting")
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


async def _serve(
    server: DrainingServer, announced: str, banner: str | None, log_stats_interval: float
) -> None:
    helpers = [asyncio.ensure_future(_announce(server, announced, banner))]
    if log_stats_interval > 0:
        helpers.append(asyncio.ensure_future(_log_stats(server.app, log_stats_interval)))
    try:
        await server.serve()
    finally:
        for task in helpers:
            task.cancel()


async def _announce(server: DrainingServer, announced: str, banner: str | None) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info(announced)
    if banner:
        print(banner, flush=True)


async def _log_stats(app, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        logger.info(app.state.server.metrics.log_line())
