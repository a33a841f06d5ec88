"""`pagefleet router`: flags, static discovery, KV-event subscriptions, the uvicorn server.

The flags that shape the picking core (discovery, prefix index, scorers, P/D, flow control) and
`build_router`, which builds it from them, are shared with `pagefleet epp` (epp_main.py): the two
front doors pick alike because they are built alike."""

from __future__ import annotations

import argparse
import logging
import os
from urllib.parse import urlparse

from pagefleet.common.tokenizer import keep_model_stack_out
from pagefleet.router.scoring import Pod


def add_router_parser(sub) -> None:
    p = sub.add_parser("router", help="cache-aware OpenAI-compatible router in front of engines")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (0.0.0.0)")
    p.add_argument("--port", type=int, default=8080, help="port to bind (8080)")
    p.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="pods tried per request before the first byte (3)",
    )
    p.add_argument("--read-timeout", type=float, default=600.0, help="seconds (600)")
    p.add_argument("--uvicorn-log-level", default="warning")
    add_picking_arguments(p)
    p.set_defaults(func=run_router)


def add_picking_arguments(p) -> None:
    """The flags of the picking core, shared by `pagefleet router` and `pagefleet epp`."""
    p.add_argument(
        "--endpoints",
        default=None,
        help="engine base URLs, comma separated (http://a:8000,http://b:8000); "
        "a '@prefill' or '@decode' suffix sets a pod's role",
    )
    p.add_argument(
        "--kubernetes-namespace",
        default=None,
        help="discover engines as ready Pods in this namespace (instead of "
        "--endpoints), watched through the Kubernetes API",
    )
    p.add_argument(
        "--selector",
        default="pagefleet.io/model",
        help="label selector of engine Pods, key=value[,key=value]",
    )
    p.add_argument("--engine-port", type=int, default=8000, help="engines' HTTP port (8000)")
    p.add_argument(
        "--kubernetes-api",
        default=None,
        help="API server URL (default: in-cluster config, else ~/.kube/config)",
    )
    p.add_argument("--model", default=None, help="served model name to accept (default: any)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="checkpoint dir whose tokenizer the engines use (exact prefix hashes); "
        "without it the router hashes character chunks",
    )
    p.add_argument(
        "--prefix-index",
        choices=["precise", "approximate"],
        default="approximate",
        help="precise: follow engines' KV events; approximate: remember what was "
        "sent where (approximate)",
    )
    p.add_argument(
        "--kv-events-endpoints",
        default=None,
        help="precise mode: each engine's ZMQ event endpoint, in --endpoints order "
        "(tcp://a:5557,tcp://b:5557); replay sockets are taken as port + 1",
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML: {filters: [healthy, model, role], scorers: {prefix: 3, "
        "queue: 2, kv-usage: 2, inflight: 1}, picker: max-score (or random)}",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=5557,
        help="precise mode with Kubernetes discovery: each pod's KV-event port (5557; "
        "replay on the next port)",
    )
    p.add_argument("--scrape-interval", type=float, default=0.075, help="seconds (0.075)")
    p.add_argument(
        "--pd-threshold-tokens",
        type=int,
        default=None,
        help="with prefill and decode pods: use a prefill pod when at least this many prompt "
        "tokens are not cached on the chosen decode pod (512; YAML pd_threshold_tokens)",
    )
    p.add_argument(
        "--prefill-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a prefill pod before the decode pod prefills itself (60)",
    )
    p.add_argument("--connect-timeout", type=float, default=2.0, help="seconds (2)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEFLEET_API_KEY"),
        help="clients must send this bearer key (or PAGEFLEET_API_KEY)",
    )
    p.add_argument(
        "--upstream-api-key",
        default=os.environ.get("PAGEFLEET_UPSTREAM_API_KEY"),
        help="bearer key the router sends to engines",
    )
    p.add_argument(
        "--fleet-secret-file",
        default=None,
        help="file holding the secret the fleet's engines share (or PAGEFLEET_FLEET_SECRET_FILE "
        "or PAGEFLEET_FLEET_SECRET): signs kv_transfer_params for disaggregated prefill/decode "
        "and opens the engines' encrypted KV events; without it no request is disaggregated",
    )
    p.add_argument(
        "--kv-events-plain",
        action="store_true",
        help="subscribe to KV events in plain text even with a fleet secret (stock vLLM pods)",
    )
    p.add_argument(
        "--deployment",
        default=None,
        help="Kubernetes discovery: only pods of this ModelDeployment (pagefleet.io/deployment)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 << 20,
        help="answer 413 beyond this request body size, before reading it (4 MiB)",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=256,
        help="requests held per model while no engine can take them (none ready, or all "
        "saturated); beyond it 503 + Retry-After; 0: never hold, 503 at once (256)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=120.0,
        help="seconds a request may be held before a 503 + Retry-After (120)",
    )
    p.add_argument(
        "--saturation-waiting",
        type=float,
        default=None,
        help="an engine with at least this many waiting requests (vllm:num_requests_waiting) "
        "counts as saturated: requests are held while every engine is (default: off)",
    )
    p.add_argument(
        "--saturation-kv",
        type=float,
        default=None,
        help="an engine whose KV cache use (vllm:kv_cache_usage_perc, 0-1) is at least this "
        "counts as saturated (default: off)",
    )
    p.add_argument(
        "--tenant-header",
        default="x-tenant-id",
        help="held requests are released round robin across tenants named by this header; "
        "without it, by bearer token, else one shared tenant (x-tenant-id)",
    )
    p.add_argument("--seed", type=int, default=0, help="tie-break seed (0)")


def static_pods(endpoints: str) -> list[Pod]:
    pods = []
    for raw in filter(None, (e.strip() for e in endpoints.split(","))):
        url, _, role = raw.partition("@")
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--endpoints: {raw!r} is not an http(s) URL")
        if role and role not in ("prefill", "decode", "both"):
            raise ValueError(f"--endpoints: role {role!r} must be prefill, decode or both")
        pods.append(Pod(name=parsed.netloc, url=url.rstrip("/"), role=role or "both"))
    if not pods:
        raise ValueError("--endpoints: give at least one engine URL")
    return pods


def make_discovery(args: argparse.Namespace):
    """Kubernetes discovery through the official client; the callback is attached later."""
    from kubernetes import client, config

    from pagefleet.router.discovery import KubernetesDiscovery

    if args.kubernetes_api:
        configuration = client.Configuration()
        configuration.host = args.kubernetes_api.rstrip("/")
        api_client = client.ApiClient(configuration)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api_client = client.ApiClient()
    return lambda on_change: KubernetesDiscovery(
        client.CoreV1Api(api_client),
        args.kubernetes_namespace,
        args.selector,
        args.engine_port,
        on_change,
        deployment=args.deployment,
    )


def _pd_threshold(args: argparse.Namespace, config: dict) -> int:
    value = args.pd_threshold_tokens
    if value is None:
        value = config.get("pd_threshold_tokens", 512)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"pd_threshold_tokens must be an integer >= 0, not {value!r}")
    return value


def build_router(args: argparse.Namespace, max_attempts: int, read_timeout: float):
    """The picking core the flags describe, and the KV-event subscribers it started (the
    caller stops them); Kubernetes discovery is attached, to be started by the front door."""
    import yaml

    from pagefleet.common.fleet_auth import curve_keys, load_fleet_secret
    from pagefleet.router.core import Router, RouterConfig
    from pagefleet.router.flow_control import FlowConfig
    from pagefleet.router.kv_subscriber import KVEventSubscriber
    from pagefleet.router.pods import PodRegistry
    from pagefleet.router.prefix_index import PrefixIndex
    from pagefleet.router.scoring import Pipeline

    if bool(args.endpoints) == bool(args.kubernetes_namespace):
        raise ValueError("give exactly one of --endpoints and --kubernetes-namespace")
    pods = static_pods(args.endpoints) if args.endpoints else []
    secret = load_fleet_secret(args.fleet_secret_file)
    if secret is None and any(p.role == "prefill" for p in pods):
        logging.getLogger("pagefleet.router").warning(
            "prefill pods but no fleet secret (--fleet-secret-file): no request is disaggregated"
        )
    curve = curve_keys(secret) if secret is not None and not args.kv_events_plain else None
    config = {}
    if args.config:
        with open(args.config) as f:
            config = yaml.safe_load(f) or {}
    pipeline = Pipeline.from_config(config)
    index = PrefixIndex(args.prefix_index)
    registry = PodRegistry(interval=args.scrape_interval, api_key=args.upstream_api_key)
    registry.set_pods(pods)
    registry.on_lost = index.remove_pod
    registry.on_capacity = index.set_capacity
    tokenizer = None
    if args.tokenizer:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from pagefleet.common.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    subscribers = []
    if args.prefix_index == "precise" and args.kubernetes_namespace:
        from pagefleet.router.kv_subscriber import SubscriberSet

        discovered = SubscriberSet(args.kv_events_port, index.apply, index.remove_pod, curve)
        registry.on_pods = discovered.sync
        subscribers.append(discovered)
    elif args.prefix_index == "precise":
        if not args.kv_events_endpoints:
            raise ValueError("--prefix-index precise needs --kv-events-endpoints")
        endpoints = [e.strip() for e in args.kv_events_endpoints.split(",")]
        if len(endpoints) != len(pods):
            raise ValueError("--kv-events-endpoints must list one endpoint per --endpoints URL")
        for pod, endpoint in zip(pods, endpoints, strict=True):
            host, _, port = endpoint.rpartition(":")
            replay = f"{host}:{int(port) + 1}"
            sub = KVEventSubscriber(
                pod.name, endpoint, index.apply, index.remove_pod, replay, curve
            )
            subscribers.append(sub.start(catch_up_ms=200))
    router = Router(
        registry,
        index,
        pipeline,
        RouterConfig(
            args.model,
            args.api_key,
            args.upstream_api_key,
            max_attempts,
            args.connect_timeout,
            read_timeout,
            _pd_threshold(args, config),
            args.prefill_timeout,
            secret,
            args.max_request_body_bytes,
            flow=FlowConfig(
                args.queue_size,
                args.queue_timeout,
                args.saturation_waiting,
                args.saturation_kv,
                args.tenant_header.lower(),
            ),
        ),
        tokenizer,
        seed=args.seed,
    )
    if args.kubernetes_namespace:
        router.discovery = make_discovery(args)
    return router, subscribers


def run_router(args: argparse.Namespace) -> int:
    keep_model_stack_out()
    import uvicorn

    from pagefleet.router.app import build_router_app

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    router, subscribers = build_router(args, args.max_attempts, args.read_timeout)
    app = build_router_app(router)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        for sub in subscribers:
            sub.stop()
    return 0
