"""The NetworkPolicies the operator emits for each ModelDeployment: who may reach its router and
engines on which port, and where each of them may connect (ingress and egress for every role).
Pure: peers outside the ModelDeployment (the operator, Prometheus, clients, the API server, DNS)
come from the operator's flags, which the chart fills from its `networkPolicy` values."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# NetworkPolicyPeer of the chart's operator pods, whatever their namespace: what an operator
# started without --network-policy-peers lets scrape the engines' /metrics.
DEFAULT_OPERATOR_PEER = {
    "namespaceSelector": {},
    "podSelector": {
        "matchLabels": {
            "app.kubernetes.io/name": "pagefleet",
            "app.kubernetes.io/component": "operator",
        }
    },
}
# NetworkPolicyPeer of any Gateway's proxy pods, whatever their namespace: Gateway API
# implementations label them with the Gateway's name (Envoy Gateway, Istio, kgateway, NGINX
# Gateway Fabric). What may reach a ModelDeployment's Endpoint Picker and, through it, its
# engines when no --network-policy-peers gatewayFrom narrows it.
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"
DEFAULT_GATEWAY_PEER = {
    "namespaceSelector": {},
    "podSelector": {"matchExpressions": [{"key": GATEWAY_NAME_LABEL, "operator": "Exists"}]},
}
API_SERVER_PORTS = (443, 6443)  # the Service's port and the API server's own (after DNAT)
DNS_PORT = 53


class PeersError(ValueError):
    """--network-policy-peers is not what the operator can use."""


@dataclass(frozen=True)
class PolicyPeers:
    """Peers outside the ModelDeployment, as NetworkPolicyPeer objects. An empty `clients_from`
    means any source, an empty `api_server_to` or `dns_to` any destination (on their ports):
    a cluster's API server and DNS addresses differ, narrow them where they are known."""

    operator_from: tuple[dict, ...] = (DEFAULT_OPERATOR_PEER,)
    metrics_from: tuple[dict, ...] = ()
    clients_from: tuple[dict, ...] = ()
    api_server_to: tuple[dict, ...] = ()
    api_server_ports: tuple[int, ...] = API_SERVER_PORTS
    dns_to: tuple[dict, ...] = ()
    gateway_from: tuple[dict, ...] = (DEFAULT_GATEWAY_PEER,)

    @classmethod
    def from_json(cls, text: str) -> PolicyPeers:
        """`{"operatorFrom": [..], "metricsFrom": [..], "clientsFrom": [..], "gatewayFrom": [..],
        "apiServer": {"to": [..], "ports": [..]}, "dns": {"to": [..]}}`, every key optional."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise PeersError(f"--network-policy-peers is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise PeersError("--network-policy-peers must be a JSON object")
        keys = {"operatorFrom", "metricsFrom", "clientsFrom", "gatewayFrom", "apiServer", "dns"}
        _known(raw, keys, "")
        api = _object(raw.get("apiServer"), "apiServer")
        dns = _object(raw.get("dns"), "dns")
        _known(api, {"to", "ports"}, "apiServer.")
        _known(dns, {"to"}, "dns.")
        ports = api.get("ports", list(API_SERVER_PORTS))
        if not isinstance(ports, list) or not all(_is_port(p) for p in ports) or not ports:
            raise PeersError("apiServer.ports must be a list of TCP port numbers")
        return cls(
            operator_from=_peers(raw.get("operatorFrom", [DEFAULT_OPERATOR_PEER]), "operatorFrom"),
            metrics_from=_peers(raw.get("metricsFrom", []), "metricsFrom"),
            clients_from=_peers(raw.get("clientsFrom", []), "clientsFrom"),
            api_server_to=_peers(api.get("to", []), "apiServer.to"),
            api_server_ports=tuple(ports),
            dns_to=_peers(dns.get("to", []), "dns.to"),
            gateway_from=_peers(raw.get("gatewayFrom", [DEFAULT_GATEWAY_PEER]), "gatewayFrom"),
        )


def _known(raw: dict, keys: set[str], where: str) -> None:
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise PeersError(f"--network-policy-peers: unknown key(s) {where}{', '.join(unknown)}")


def _object(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PeersError(f"--network-policy-peers: {where} must be an object")
    return value


def _peers(value: Any, where: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not all(isinstance(p, dict) and p for p in value):
        raise PeersError(f"--network-policy-peers: {where} must be a list of NetworkPolicyPeers")
    return tuple(value)


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


@dataclass(frozen=True)
class PolicyInputs:
    """What one ModelDeployment's policies depend on (from its spec and the reconcile's
    constants): selectors of its pods, its ports, which pools and features it has."""

    name: str
    router_selector: dict[str, str]
    engines_selector: dict[str, str]
    pool_selectors: dict[str, dict[str, str]]  # pool name -> its pods' selector
    router_port: int
    engine_port: int
    events_ports: tuple[int, ...]  # empty: no KV events (approximate index)
    kv_transfer_port: int
    ucx_ports: tuple[int, int] | None  # NIXL's UCX TCP range between prefill and decode pods
    # hf:// models: the init containers download from the endpoint (and its CDN redirects) on
    # these ports, at addresses no policy can name in advance.
    download_ports: tuple[int, ...] = ()
    # Multi-node pools, whose pods (Ray head and workers, torch.distributed ranks) connect to
    # each other on these ports (NetworkPolicyPorts), both ways.
    group_pools: tuple[str, ...] = ()
    group_ports: tuple[dict, ...] = ()
    # The Endpoint Picker of an InferencePool (spec.inferencePool): its pods, its gRPC port
    # (the Gateway's proxies call it) and its /metrics port; a Gateway's proxies then reach
    # the pools named in `gateway_pools` directly. None: no picker.
    epp_selector: dict[str, str] | None = None
    epp_port: int = 0
    epp_metrics_port: int = 0
    gateway_pools: tuple[str, ...] = ()


def tcp(*ports: int) -> list[dict]:
    return [{"port": p, "protocol": "TCP"} for p in ports]


def tcp_range(ports: tuple[int, int]) -> dict:
    return {"port": ports[0], "endPort": ports[1], "protocol": "TCP"}


def pods(selector: dict[str, str]) -> dict:
    """A peer: pods of the policy's own namespace with these labels."""
    return {"podSelector": {"matchLabels": dict(selector)}}


def _rule(direction: str, peers: tuple[dict, ...] | list[dict], ports: list[dict]) -> dict:
    """An ingress (`from`) or egress (`to`) rule; no peers means any peer on these ports."""
    rule: dict[str, Any] = {"ports": ports}
    if peers:
        rule[direction] = list(peers)
    return rule


def _infrastructure(peers: PolicyPeers, api_server: bool) -> list[dict]:
    """Egress every pod needs (DNS), and the API server for pods that use it."""
    rules = [_rule("to", peers.dns_to, [*tcp(DNS_PORT), {"port": DNS_PORT, "protocol": "UDP"}])]
    if api_server:
        rules.append(_rule("to", peers.api_server_to, tcp(*peers.api_server_ports)))
    return rules


def router_policy(inputs: PolicyInputs, peers: PolicyPeers) -> dict:
    """Clients (and Prometheus) in on the router's port; out to this ModelDeployment's engines
    (HTTP, KV events, the prefill pods' KV-transfer port for releases), the API server
    (discovery) and DNS."""
    clients = (*peers.clients_from, *peers.metrics_from) if peers.clients_from else ()
    return {
        "podSelector": {"matchLabels": dict(inputs.router_selector)},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [_rule("from", clients, tcp(inputs.router_port))],
        "egress": _picker_egress(inputs, peers),
    }


def _picker_egress(inputs: PolicyInputs, peers: PolicyPeers) -> list[dict]:
    """Where the router and the Endpoint Picker connect: this ModelDeployment's engines (HTTP,
    KV events, the prefill pods' KV-transfer port for releases), the API server (discovery),
    DNS, and an hf:// model's endpoint (the tokenizer)."""
    egress = [
        _rule(
            "to",
            [pods(inputs.engines_selector)],
            tcp(inputs.engine_port, *inputs.events_ports),
        )
    ]
    if "prefill" in inputs.pool_selectors:
        egress.append(
            _rule("to", [pods(inputs.pool_selectors["prefill"])], tcp(inputs.kv_transfer_port))
        )
    return egress + _infrastructure(peers, api_server=True) + _downloads(inputs)


def epp_policy(inputs: PolicyInputs, peers: PolicyPeers) -> dict:
    """The Endpoint Picker's pods: only a Gateway's proxies on its gRPC port; the operator
    (whose autoscaler reads the queue it holds) and Prometheus on its /metrics port; out as
    the router goes."""
    assert inputs.epp_selector is not None
    return {
        "podSelector": {"matchLabels": dict(inputs.epp_selector)},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [
            _rule("from", peers.gateway_from, tcp(inputs.epp_port)),
            _rule(
                "from", [*peers.operator_from, *peers.metrics_from], tcp(inputs.epp_metrics_port)
            ),
        ],
        "egress": _picker_egress(inputs, peers),
    }


def _downloads(inputs: PolicyInputs) -> list[dict]:
    return [_rule("to", (), tcp(*inputs.download_ports))] if inputs.download_ports else []


def pool_policy(inputs: PolicyInputs, pool: str, peers: PolicyPeers) -> dict:
    """An engine pool's pods: HTTP from the router (and the Endpoint Picker), the operator (the
    builtin autoscaler reads /metrics), Prometheus and, for the pool an InferencePool selects,
    a Gateway's proxies; KV events from the router (and the picker) only; into prefill pods the
    KV-transfer port (decode pods read, the pickers release) and, from decode pods, NIXL's UCX
    ports (the decode side opens every connection: its READs are one-sided and it sends no
    notifications); out only to DNS and, for decode pods, to the prefill pods. A multi-node
    pool's pods also reach each other (and only each other) on Ray's pinned ports and the
    ephemeral range torch.distributed, gloo and NCCL listen on. The engines use no API (no
    token either)."""
    router = pods(inputs.router_selector)
    # Who picks for these pods: the router, and the Endpoint Picker if there is one.
    pickers = [router]
    if inputs.epp_selector is not None:
        pickers.append(pods(inputs.epp_selector))
    # A Gateway's proxies send requests to the pods the InferencePool selects.
    gateway = peers.gateway_from if pool in inputs.gateway_pools else ()
    ingress = [
        _rule(
            "from",
            [*pickers, *gateway, *peers.operator_from, *peers.metrics_from],
            tcp(inputs.engine_port),
        )
    ]
    if inputs.events_ports:
        ingress.append(_rule("from", pickers, tcp(*inputs.events_ports)))
    egress = _infrastructure(peers, api_server=False) + _downloads(inputs)
    selectors = inputs.pool_selectors
    if pool == "prefill":
        decode = pods(selectors["decode"])
        ingress.append(_rule("from", [decode, *pickers], tcp(inputs.kv_transfer_port)))
        if inputs.ucx_ports:
            ingress.append(_rule("from", [decode], [tcp_range(inputs.ucx_ports)]))
    elif pool == "decode":
        prefill = pods(selectors["prefill"])
        egress.append(_rule("to", [prefill], tcp(inputs.kv_transfer_port)))
        if inputs.ucx_ports:
            egress.append(_rule("to", [prefill], [tcp_range(inputs.ucx_ports)]))
    if pool in inputs.group_pools:
        group = pods(selectors[pool])
        ingress.append(_rule("from", [group], list(inputs.group_ports)))
        egress.append(_rule("to", [group], list(inputs.group_ports)))
    return {
        "podSelector": {"matchLabels": dict(selectors[pool])},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": ingress,
        "egress": egress,
    }
