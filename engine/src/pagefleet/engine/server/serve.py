"""`pagefleet serve MODEL`: flags (vLLM's names), the uvicorn server, graceful SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import uvicorn

from pagefleet.common.fleet_auth import FieldSigner, load_fleet_secret
from pagefleet.engine.config import EngineArgs

logger = logging.getLogger("pagefleet.server")


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve one model over an OpenAI-compatible HTTP API",
        description="Serve a local Hugging Face checkpoint with vLLM's API, metrics and flags.",
    )
    p.add_argument("model", help="path of a local Hugging Face checkpoint directory")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (8000)")
    p.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: the model path)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="most tokens (prompt + output) per request (default: the model's)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most running requests (256)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one engine step (2048)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of shared prefixes (on)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over steps (on)",
    )
    p.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=1,
        help="prompts split over steps at once (1)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="most prompt tokens per request per step; 0 = the budget (0)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.92,
        help="fraction of GPU memory for weights, activations and KV (0.92)",
    )
    p.add_argument("--kv-cache-memory", type=float, default=4.0, help="GiB of KV cache on CPU (4)")
    p.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV blocks in the pool, overriding the memory-based size",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weights and activations dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="KV cache dtype (auto: the model's)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (auto)")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "triton", "torch"],
        help="paged-attention kernels (auto: triton on CUDA, torch on CPU)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: run decode steps eagerly (graphs are captured at start-up)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling (0)")
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
    p.add_argument(
        "--kv-transfer-config",
        default=None,
        help="disaggregated prefill/decode; vLLM's JSON, e.g. "
        '{"kv_connector": "nixl", "kv_role": "kv_producer"} (kv_connector nixl or tcp; kv_role '
        "kv_producer, kv_consumer or kv_both; optional kv_ip (address peers use, 127.0.0.1), "
        "kv_port (14579), kv_bind_host, transfer_timeout (30 s))",
    )
    p.add_argument(
        "--kv-hold-timeout",
        type=float,
        default=120.0,
        help="seconds a prefill engine holds a request's blocks for its decode engine (120)",
    )
    p.set_defaults(func=run_serve)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_num_partial_prefills=args.max_num_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        kv_cache_memory=args.kv_cache_memory,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device=args.device,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        served_model_name=args.served_model_name,
        simulate=_simulation(args),
        kv_transfer_config=args.kv_transfer_config,
        kv_hold_timeout=args.kv_hold_timeout,
    )


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
        engine.engine.step_observers.append(lambda _: publisher.flush())
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

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        logger.info("serving %s on http://%s:%d", name, args.host, args.port)
        if banner:
            print(banner, flush=True)

    async def main() -> None:
        helpers = [asyncio.ensure_future(announce())]
        if args.log_stats_interval > 0:
            helpers.append(asyncio.ensure_future(_log_stats(app, args.log_stats_interval)))
        try:
            await server.serve()
        finally:
            for task in helpers:
                task.cancel()

    try:
        asyncio.run(main())
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
        self.app.state.draining = True
        if sig == signal.SIGTERM:
            logger.info("SIGTERM: draining in-flight requests, then exiting")
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


async def _log_stats(app, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        logger.info(app.state.metrics.log_line())
