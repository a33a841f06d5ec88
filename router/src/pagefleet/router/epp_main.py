"""`pagefleet epp`: flags, the gRPC server (ext_proc and gRPC health), the HTTP port for
/metrics and the kubelet's probes, and the core's background work (scraping, discovery, the
flow-control release loop). The picking core is built by the router's own `build_router`, from
the same flags."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal

from pagefleet.common.tokenizer import keep_model_stack_out
from pagefleet.router.main import add_picking_arguments, build_router

GRPC_PORT = 9002  # the Inference Extension's EPP port (its charts and examples use it)
METRICS_PORT = 9090
GRPC_HEADROOM = 1 << 20  # a gRPC message carries a whole buffered body, plus headers


def add_epp_parser(sub) -> None:
    p = sub.add_parser(
        "epp",
        help="Endpoint Picker for a Gateway (Gateway API Inference Extension, Envoy ext_proc): "
        "the router's picking, the gateway's proxy",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to bind (0.0.0.0)")
    p.add_argument(
        "--port",
        type=int,
        default=GRPC_PORT,
        help=f"gRPC port: envoy.service.ext_proc.v3.ExternalProcessor and grpc.health.v1 "
        f"({GRPC_PORT})",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=METRICS_PORT,
        help=f"HTTP port of /metrics, /livez and /health ({METRICS_PORT})",
    )
    p.add_argument(
        "--fallback-endpoints",
        type=int,
        default=0,
        help="endpoints listed after the pick, in the picker's order, for a proxy that "
        "retries down the list (Envoy's override_host policy); 0 for one that routes on a "
        "single ip:port (an ORIGINAL_DST cluster) (0)",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        default=1024,
        help="ext_proc streams (requests) served at once; beyond, RESOURCE_EXHAUSTED and the "
        "proxy's failure mode: each may buffer a body of --max-request-body-bytes (1024)",
    )
    add_picking_arguments(p)
    p.set_defaults(func=run_epp)


def run_epp(args: argparse.Namespace) -> int:
    keep_model_stack_out()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Every scrape would be an INFO line.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.fallback_endpoints < 0 or args.max_streams < 1:
        raise ValueError("--fallback-endpoints must be >= 0 and --max-streams >= 1")
    # The picker's own client reaches engines for scrapes and prefills only (each with its
    # own timeout); the gateway carries the requests.
    router, subscribers = build_router(args, 1 + args.fallback_endpoints, args.prefill_timeout)
    try:
        asyncio.run(serve(router, args))
    finally:
        for sub in subscribers:
            sub.stop()
    return 0


async def serve(router, args: argparse.Namespace) -> None:
    """Until SIGTERM or SIGINT: then stop taking streams and let those in flight finish."""
    import grpc
    import httpx

    from pagefleet.proto import envoy_ext_proc_pb2_grpc as pb_grpc
    from pagefleet.proto import grpc_health_pb2_grpc as health_grpc
    from pagefleet.router.core import release_loop
    from pagefleet.router.epp import EndpointPicker, Health
    from pagefleet.router.upstream import AiohttpTransport

    config = router.config
    loop = asyncio.get_running_loop()
    client = httpx.AsyncClient(
        transport=AiohttpTransport(),
        timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
    )
    host, port, metrics_port = args.host, args.port, args.metrics_port
    picker = EndpointPicker(router, client, args.fallback_endpoints)
    limit = config.max_body_bytes + GRPC_HEADROOM
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=args.max_streams)
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health_grpc.add_HealthServicer_to_server(Health(router), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    probes = await start_probes(router, host, metrics_port)
    discovery = None
    if router.discovery is not None:
        # Discovery runs on its own thread; pod sets are applied on this loop.
        discovery = router.discovery(
            functools.partial(loop.call_soon_threadsafe, router.registry.set_pods)
        ).start()
    background = [
        asyncio.ensure_future(router.registry.run(client)),
        asyncio.ensure_future(release_loop(router)),
    ]
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logging.getLogger("pagefleet.router").info(
        "endpoint picker on %s:%d (gRPC), metrics and probes on port %d", host, port, metrics_port
    )
    try:
        await stop.wait()
    finally:
        await server.stop(grace=5)
        for task in background:
            task.cancel()
        if discovery is not None:
            discovery.stop()
        await probes.cleanup()
        picker.tokenizing.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            await client.aclose()


async def start_probes(router, host: str, port: int):
    """/metrics, /livez (the process serves) and /health (requests can be taken) over HTTP,
    for Prometheus and the kubelet."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def livez(_request):
        return web.Response(status=200)

    async def health(_request):
        return web.Response(status=200 if router.accepting() else 503)

    async def metrics(_request):
        return web.Response(
            body=generate_latest(router.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    app = web.Application()
    app.router.add_get("/livez", livez)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
