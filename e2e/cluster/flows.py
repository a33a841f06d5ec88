"""Which connections the lab's pods hold, and whether the namespace's NetworkPolicies allow each
one. The lab does not enforce NetworkPolicy (no CNI); this checks that the policies our objects
carry would let through what the fleet really does (P/D, KV events, discovery), so that turning
enforcement on cannot break it. Pure evaluation over plain data, plus `observed_connections`,
which reads sockets with `ss` inside each pod's network namespace.

The evaluation follows networking.k8s.io/v1 semantics for what our policies use: pod and
namespace selectors (matchLabels, matchExpressions), ipBlock, TCP ports and port ranges; a pod
selected by a policy of a direction is isolated in it, and then only a rule of some selecting
policy allows a connection. Namespaces carry `kubernetes.io/metadata.name`, as the API server
sets it."""

from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass

from .labels import from_label_selector, matches

NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Connection:
    """An established TCP connection: the pod that opened it, where to, on which port."""

    client: str  # pod name
    server: str  # pod name, or an address outside the namespace's pods (the node, the API)
    server_ip: str
    port: int


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector ({} selects everything)."""
    return matches(from_label_selector(selector), labels)


def _peer_matches(peer: dict, target: dict | None, ip: str, namespaces: dict[str, dict]) -> bool:
    """Whether a NetworkPolicyPeer names the target (a pod dict, or None for an address)."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(ip)
        inside = address in ipaddress.ip_network(block["cidr"])
        return inside and not any(
            address in ipaddress.ip_network(c) for c in block.get("except", [])
        )
    if target is None:
        return False  # pod and namespace selectors name pods only
    namespace = target["metadata"]["namespace"]
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespaces.get(namespace, {})):
            return False
    elif namespace != peer.get("_policy_namespace"):
        return False
    return selects(peer.get("podSelector") or {}, target["metadata"].get("labels") or {})


def _port_matches(rule_ports: list[dict] | None, port: int) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p or p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def allowed(
    policies: list[dict],
    pod: dict,
    direction: str,  # "Ingress" | "Egress"
    other: dict | None,
    other_ip: str,
    port: int,
    namespaces: dict[str, dict],
) -> bool:
    """Whether `pod` may accept (Ingress) or open (Egress) this connection."""
    labels = pod["metadata"].get("labels") or {}
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod["metadata"]["namespace"]
        and selects(p["spec"]["podSelector"], labels)
        and direction in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True  # not isolated in this direction
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in selecting:
        for rule in policy["spec"].get(rules_key) or []:
            if not _port_matches(rule.get("ports"), port):
                continue
            peers = rule.get(peers_key)
            if not peers:
                return True
            scoped = [{**p, "_policy_namespace": policy["metadata"]["namespace"]} for p in peers]
            if any(_peer_matches(p, other, other_ip, namespaces) for p in scoped):
                return True
    return False


def violations(
    connections: list[Connection],
    pods: list[dict],
    policies: list[dict],
    namespaces: dict[str, dict],
) -> list[str]:
    """Each connection a policy would drop: egress of its client, ingress of a server pod."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    found = []
    for c in connections:
        client, server = by_name[c.client], by_name.get(c.server)
        if not allowed(policies, client, "Egress", server, c.server_ip, c.port, namespaces):
            found.append(f"egress {c.client} -> {c.server}:{c.port}")
        client_ip = client["status"]["podIP"]
        if server is not None and not allowed(
            policies, server, "Ingress", client, client_ip, c.port, namespaces
        ):
            found.append(f"ingress {c.client} -> {c.server}:{c.port}")
    return found


def namespace_labels(namespace: dict) -> dict[str, str]:
    name = namespace["metadata"]["name"]
    return {**(namespace["metadata"].get("labels") or {}), NAME_LABEL: name}


# -- reading sockets


def _sockets(netns: str, *args: str) -> list[tuple[str, int, str, int]]:
    """(local ip, port, peer ip, port) of `ss -Htn ARGS` in a network namespace."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "ss", "-Htn", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = []
    for line in out.splitlines():
        local, peer = line.split()[-2:]
        found.append((*_address(local), *_address(peer)))
    return found


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    host = host.strip("[]").removeprefix("::ffff:")
    return host, int(port) if port.isdigit() else 0


def observed_connections(pods: list[dict], netns_of: dict[str, str]) -> list[Connection]:
    """The established connections pods opened, to other pods or to anything else (the API
    server on the node). Connections a pod accepted from the node (probes, test clients) and a
    pod's connections to itself are left out."""
    by_ip = {p["status"]["podIP"]: p["metadata"]["name"] for p in pods if p["status"].get("podIP")}
    found: set[Connection] = set()
    for pod in pods:
        netns = netns_of.get(pod["metadata"]["uid"])
        ip = pod["status"].get("podIP")
        if netns is None or not ip:
            continue
        listening = {port for _, port, _, _ in _sockets(netns, "-l")}
        for local_ip, local_port, peer_ip, peer_port in _sockets(netns, "state", "established"):
            if peer_ip in (ip, local_ip) or peer_ip.startswith("127."):
                continue
            if local_port in listening:  # accepted here: the client side records it
                continue
            name = pod["metadata"]["name"]
            found.add(Connection(name, by_ip.get(peer_ip, peer_ip), peer_ip, peer_port))
    return sorted(found, key=lambda c: (c.client, c.server, c.port))
