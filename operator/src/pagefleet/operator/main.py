"""`pagefleet operator`: flags, `pagefleet operator crd`, and kopf's run loop (cluster login
through the usual in-cluster or kubeconfig lookup), behind leader election on a Lease so that
of several replicas only one acts."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagefleet.common.tokenizer import keep_model_stack_out


def add_operator_parser(sub) -> None:
    p = sub.add_parser(
        "operator", help="Kubernetes operator for ModelDeployment resources (kopf); `crd` prints it"
    )
    p.add_argument(
        "--namespace",
        action="append",
        default=None,
        help="watch this namespace (repeatable; default: the whole cluster)",
    )
    p.add_argument(
        "--prometheus-url",
        default=os.environ.get("PAGEFLEET_PROMETHEUS_URL"),
        help="read vllm:num_requests_waiting from this Prometheus instead of the pods' /metrics",
    )
    p.add_argument(
        "--image",
        default=None,
        help="CPU engine image for ModelDeployments that give none "
        "(default: ghcr.io/pagefleet/pagefleet:<version>)",
    )
    p.add_argument(
        "--gpu-image",
        default=None,
        help="CUDA engine image for pools that request nvidia.com/gpu and give no image "
        "(default: ghcr.io/pagefleet/pagefleet:<version>-cuda)",
    )
    p.add_argument(
        "--router-image",
        default=None,
        help="image of every router the operator runs "
        "(default: ghcr.io/pagefleet/pagefleet-router:<version>)",
    )
    p.add_argument(
        "--autoscale-interval",
        type=float,
        default=15.0,
        help="seconds between autoscaler evaluations and drift checks of owned objects (15)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8000,
        help="engine pods' /metrics port, scraped at each ready pod's status.podIP (8000)",
    )
    p.add_argument(
        "--kubernetes-api",
        default=None,
        help="API server URL, used without credentials (kubectl proxy, tests); "
        "default: in-cluster config, else ~/.kube/config",
    )
    p.add_argument(
        "--liveness-endpoint",
        default=None,
        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8081/healthz",
    )
    p.add_argument(
        "--metrics-bind-address",
        type=metrics_bind_address,
        default=None,
        metavar="HOST:PORT",
        help="serve the operator's own Prometheus metrics (pagefleet_operator:*) at "
        "http://HOST:PORT/metrics, leader or not, e.g. :8080 (default: not served)",
    )
    p.add_argument(
        "--allowed-host-paths",
        action="append",
        default=[],
        metavar="DIR[,DIR]",
        help="folders hostPath model sources may be under (repeatable; default: none, so "
        "hostPath sources are refused)",
    )
    p.add_argument(
        "--network-policies",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="emit NetworkPolicies (ingress and egress) for each ModelDeployment's router and "
        "engines (on)",
    )
    p.add_argument(
        "--network-policy-peers",
        default=None,
        metavar="JSON",
        help='peers outside a ModelDeployment: {"operatorFrom": [..], "metricsFrom": [..], '
        '"clientsFrom": [..], "apiServer": {"to": [..], "ports": [..]}, "dns": {"to": [..]}} '
        "(NetworkPolicyPeer lists; an empty list is any peer, except for operatorFrom and "
        "metricsFrom; default: the chart's operator pods, any client, API server and DNS)",
    )
    add_leader_election_flags(p)
    p.add_argument("--verbose", action="store_true", help="kopf debug logging")
    commands = p.add_subparsers(dest="operator_command", metavar="SUBCOMMAND")
    crd = commands.add_parser("crd", help="print the ModelDeployment CRD (YAML) and exit")
    crd.add_argument(
        "--apply",
        action="store_true",
        help="server-side apply it to the cluster instead (field manager pagefleet-crd), then "
        "wait until it is established; refused if it stops serving a version still stored",
    )
    # SUPPRESS: given before `crd`, the operator's own --kubernetes-api stays in effect.
    crd.add_argument("--kubernetes-api", default=argparse.SUPPRESS, help="as for the operator")
    crd.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for established (60)"
    )
    crd.set_defaults(func=print_crd)
    p.set_defaults(func=run_operator)


def add_leader_election_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="act only while holding a coordination.k8s.io Lease, so that replicas never act "
        "together; followers wait for it (on)",
    )
    p.add_argument(
        "--leader-election-namespace",
        default=None,
        help="namespace of the Lease (default: POD_NAMESPACE, else the service account's, "
        "else `default`)",
    )
    p.add_argument("--leader-election-id", default="pagefleet-operator", help="name of the Lease")
    p.add_argument(
        "--leader-election-lease-duration",
        type=int,
        default=15,
        metavar="SECONDS",
        help="a follower takes over a Lease nobody renewed for this long (15)",
    )
    p.add_argument(
        "--leader-election-renew-deadline",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a leader that could not renew for this long exits (10; under the lease duration)",
    )
    p.add_argument(
        "--leader-election-retry-period",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between renewals and between a follower's tries (2)",
    )


def print_crd(args: argparse.Namespace) -> int:
    from pagefleet.operator.crd import render_crd

    if args.apply:
        from pagefleet.operator.crd_apply import apply_command

        return apply_command(args.kubernetes_api, args.timeout)
    sys.stdout.write(render_crd())
    return 0


def metrics_bind_address(text: str) -> tuple[str, int]:
    from pagefleet.operator.metrics import parse_bind_address

    try:
        return parse_bind_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def allowed_host_paths(values: list[str]) -> tuple[str, ...]:
    paths = tuple(p.strip() for value in values for p in value.split(",") if p.strip())
    relative = [p for p in paths if not p.startswith("/")]
    if relative:
        raise ValueError(f"--allowed-host-paths: {', '.join(relative)} must be absolute")
    return paths


def network_policy_peers(args: argparse.Namespace):
    from pagefleet.operator.network_policy import PolicyPeers

    if not args.network_policies:
        if args.network_policy_peers:
            raise ValueError("--network-policy-peers needs --network-policies")
        return None
    return PolicyPeers.from_json(args.network_policy_peers or "{}")


def run_operator(args: argparse.Namespace) -> int:
    keep_model_stack_out()
    import asyncio

    import kopf

    from pagefleet.operator.handlers import (
        KubeClient,
        OperatorConfig,
        OperatorState,
        build_registry,
        configure,
    )
    from pagefleet.operator.leader import lead
    from pagefleet.operator.metrics import MetricsServer, OperatorMetrics
    from pagefleet.operator.reconcile import EngineImages
    from pagefleet.operator.spec import DEFAULT_ROUTER_IMAGE

    if args.verbose:
        logging.basicConfig(level=logging.DEBUG)
    else:
        logging.basicConfig(level=logging.INFO)

    config = OperatorConfig(
        images=EngineImages(args.image or EngineImages.cpu, args.gpu_image or EngineImages.cuda),
        router_image=args.router_image or DEFAULT_ROUTER_IMAGE,
        prometheus_url=args.prometheus_url,
        metrics_port=args.metrics_port,
        autoscale_interval=args.autoscale_interval,
        api_url=args.kubernetes_api,
        network_policy=network_policy_peers(args),
        allowed_host_paths=allowed_host_paths(args.allowed_host_paths),
    )
    metrics = OperatorMetrics()
    state = OperatorState(config, KubeClient(config.api_url), metrics=metrics)
    registry = build_registry(state)

    async def operate(stop: asyncio.Event | None = None, liveness: str | None = None) -> None:
        settings = configure(kopf.OperatorSettings())
        metrics.leader = True  # only the Lease's holder gets here
        try:
            await kopf.operator(
                registry=registry,
                settings=settings,
                clusterwide=not args.namespace,
                namespaces=args.namespace or [],
                standalone=True,
                liveness_endpoint=liveness,
                stop_flag=stop,
            )
        finally:
            metrics.leader = False
            await drain(settings)

    server = None
    if args.metrics_bind_address:
        server = MetricsServer(metrics, args.metrics_bind_address).start()
    try:
        if not args.leader_election:
            asyncio.run(operate(liveness=args.liveness_endpoint))
            return 0
        elector = leader_elector(args, KubeClient(config.api_url))
        asyncio.run(
            lead(
                elector,
                lambda stop: operate(stop, args.liveness_endpoint),
                exit_on_lost_lease,
                args.liveness_endpoint,
            )
        )
        return 0
    finally:
        if server is not None:
            server.close()


LOST_LEASE_EXIT = 3


async def drain(settings) -> None:
    """Wait for the reconciles still running in threads (kopf's handlers, the periodic pass):
    kopf has stopped, but a thread is not cancelled, and the Lease goes to a follower next."""
    import asyncio

    await asyncio.to_thread(settings.execution.executor.shutdown, wait=True)
    await asyncio.get_running_loop().shutdown_default_executor()


def leader_elector(args: argparse.Namespace, client):
    from pagefleet.operator.leader import (
        LeaseElector,
        Timing,
        default_identity,
        default_namespace,
    )

    timing = Timing(
        args.leader_election_lease_duration,
        args.leader_election_renew_deadline,
        args.leader_election_retry_period,
    )
    namespace = args.leader_election_namespace or default_namespace()
    return LeaseElector(client, namespace, args.leader_election_id, default_identity(), timing)


def exit_on_lost_lease(why: str) -> None:
    """Stop acting at once: a follower may hold the Lease already. The kubelet restarts the
    container, which then waits as a follower (client-go's rule: lost lease, exit)."""
    logging.getLogger("pagefleet.operator").error("lost the leader lease (%s): exiting", why)
    logging.shutdown()
    os._exit(LOST_LEASE_EXIT)
