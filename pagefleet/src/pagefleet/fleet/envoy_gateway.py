"""The Envoy configuration a Gateway implementation generates for an InferencePool, as a
bootstrap for the `envoy` binary: what tests, the cluster lab and the benchmarks put in front of
`pagefleet epp`, and a starting point for a user who runs Envoy without a Gateway controller.

Per listener (one HTTPRoute to one pool): the ext_proc filter calling the Endpoint Picker (the
request's headers and body, and the response, in FULL_DUPLEX_STREAMED mode as GIE gateways
configure it; the pool's `failureMode`: FailOpen lets requests through when the picker cannot be
reached, FailClose answers an error), then one of the two upstream shapes gateways use:

- `original_dst` (Envoy Gateway, kgateway): an ORIGINAL_DST cluster that connects to the
  `ip:port` in the `x-gateway-destination-endpoint` header. One endpoint, no fallbacks, and no
  load balancing of its own: with the picker unreachable there is nowhere to go, and a header
  the client set would be obeyed, so this shape is rendered FailClose only.
- `override_host` (Istio, GKE): a cluster of the pool's endpoints whose override_host policy
  takes the picker's ordered list from the `envoy.lb` metadata (never from a header a client
  could set), moves down it on retries, reports the endpoint that served in
  `envoy.lb`/`x-gateway-destination-endpoint-served`, and falls back to round robin when no
  list is given (FailOpen with the picker away).

Pure: plain dicts (JSON is YAML, so `json.dumps` of the result is a valid bootstrap).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SHAPES = ("original_dst", "override_host")
FAILURE_MODES = ("FailClose", "FailOpen")
# Retried on another endpoint of the picker's list: the pod never took the request.
RETRY_ON = "connect-failure,refused-stream,reset-before-request"
_TYPES = "type.googleapis.com/envoy"


@dataclass(frozen=True)
class PoolListener:
    """One listener routing every request to one InferencePool through its picker."""

    name: str
    port: int
    epp: tuple[str, int]  # the picker's gRPC address
    failure_mode: str = "FailClose"
    shape: str = "original_dst"
    endpoints: tuple[tuple[str, int], ...] = ()  # the pool's pods (override_host shape)
    retries: int = 0  # further endpoints tried after the first fails before answering
    # Envoy waits this long for each picker answer: above the picker's queue timeout (a
    # request is held while no engine can take it) plus a prefill's timeout.
    message_timeout_s: float = 200.0
    request_timeout_s: float = 600.0
    # Tests: a request header whose value (ip:port,...) becomes the subset hint, as a
    # gateway's own filters would set it.
    subset_header: str | None = None
    host: str = "127.0.0.1"
    # How bodies go to the picker: FULL_DUPLEX_STREAMED (GIE's) or BUFFERED; by default
    # BUFFERED for a FailOpen pool: Envoy (1.40) cannot fail open once it has streamed a body
    # to the picker (it answers 500, ext_proc_error_gRPC_error_14), while a buffered body is
    # still its own to send on.
    body_mode: str | None = None

    @property
    def bodies(self) -> str:
        if self.body_mode is not None:
            return self.body_mode
        return "BUFFERED" if self.failure_mode == "FailOpen" else "FULL_DUPLEX_STREAMED"

    def __post_init__(self) -> None:
        if self.shape not in SHAPES or self.failure_mode not in FAILURE_MODES:
            raise ValueError(f"shape must be one of {SHAPES}, failure mode of {FAILURE_MODES}")
        if self.shape == "original_dst" and self.failure_mode == "FailOpen":
            raise ValueError("an ORIGINAL_DST pool fails open to a client's own header: FailClose")
        if self.shape == "override_host" and not self.endpoints:
            raise ValueError("the override_host shape needs the pool's endpoints")


@dataclass
class Bootstrap:
    listeners: list[PoolListener]
    admin_port: int
    admin_host: str = "127.0.0.1"
    clusters: dict[str, dict] = field(default_factory=dict)

    def render(self) -> dict:
        listeners = [self._listener(p) for p in self.listeners]
        return {
            "admin": {"address": _address(self.admin_host, self.admin_port)},
            "static_resources": {"listeners": listeners, "clusters": list(self.clusters.values())},
        }

    def _listener(self, pool: PoolListener) -> dict:
        epp = f"{pool.name}-epp"
        self.clusters[epp] = _epp_cluster(epp, pool.epp)
        upstream = f"{pool.name}-pool"
        self.clusters[upstream] = _pool_cluster(upstream, pool)
        route: dict = {"cluster": upstream, "timeout": f"{pool.request_timeout_s:g}s"}
        if pool.retries:
            route["retry_policy"] = {"retry_on": RETRY_ON, "num_retries": pool.retries}
        filters = []
        if pool.subset_header:
            filters.append(_subset_filter(pool.subset_header))
        filters.append(_ext_proc(epp, pool))
        filters.append(
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{_TYPES}.extensions.filters.http.router.v3.Router"},
            }
        )
        manager = {
            "@type": f"{_TYPES}.extensions.filters.network.http_connection_manager.v3"
            ".HttpConnectionManager",
            "stat_prefix": pool.name,
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": pool.name,
                        "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"}, "route": route}],
                    }
                ]
            },
            "http_filters": filters,
        }
        return {
            "name": pool.name,
            "address": _address(pool.host, pool.port),
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": manager,
                        }
                    ]
                }
            ],
        }


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _ext_proc(cluster: str, pool: PoolListener) -> dict:
    body = pool.bodies
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_TYPES}.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
            "failure_mode_allow": pool.failure_mode == "FailOpen",
            "message_timeout": f"{pool.message_timeout_s:g}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": body,
                "response_body_mode": body,
                # Full-duplex bodies need the trailers sent (they may end the body).
                "request_trailer_mode": "SEND" if body == "FULL_DUPLEX_STREAMED" else "SKIP",
                "response_trailer_mode": "SEND" if body == "FULL_DUPLEX_STREAMED" else "SKIP",
            },
            # The subset hint goes to the picker, and the served endpoint with the response
            # (override_host writes it; the upstream address comes either way); the picker's
            # answer may write envoy.lb, where the override_host policy reads the pick.
            "metadata_options": {
                "forwarding_namespaces": {"untyped": ["envoy.lb", SUBSET_NAMESPACE]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
            "response_attributes": ["upstream.address"],
        },
    }


def _subset_filter(header: str) -> dict:
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": f"{_TYPES}.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [
                {
                    "header": header,
                    "on_header_present": {
                        "metadata_namespace": SUBSET_NAMESPACE,
                        "key": SUBSET_KEY,
                        "type": "STRING",
                    },
                    "remove": True,
                }
            ],
        },
    }


def _epp_cluster(name: str, address: tuple[str, int]) -> dict:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPES}.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": _assignment(name, [address]),
    }


def _assignment(name: str, endpoints) -> dict:
    return {
        "cluster_name": name,
        "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}
        ],
    }


def _metadata_key(key: str) -> dict:
    return {"key": "envoy.lb", "path": [{"key": key}]}


def _pool_cluster(name: str, pool: PoolListener) -> dict:
    if pool.shape == "original_dst":
        return {
            "name": name,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "2s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    override = {
        "@type": f"{_TYPES}.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [{"metadata": _metadata_key(DESTINATION)}],
        "selected_host_key": _metadata_key(SERVED),
        "fallback_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.round_robin",
                        "typed_config": {
                            "@type": f"{_TYPES}.extensions.load_balancing_policies.round_robin"
                            ".v3.RoundRobin"
                        },
                    }
                }
            ]
        },
    }
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": _assignment(name, pool.endpoints),
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": override,
                    }
                }
            ]
        },
    }
