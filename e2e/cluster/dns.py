"""Names in the lab, as the kubelet and cluster DNS give them to pods: the kubelet's /etc/hosts
(the pod's own name; with a subdomain, its FQDN), a resolv.conf for dnsPolicy ClusterFirst (the
node's DNS server, the search path `<ns>.svc.cluster.local svc.cluster.local cluster.local`,
ndots:5), and the DNS server itself (UDP on the node): A records of pods behind headless
Services, `<hostname>.<service>.<ns>.svc.cluster.local`, and of headless Services' ready
addresses, `<service>.<ns>.svc.cluster.local`; every other name is NXDOMAIN (nothing outside
the lab is reachable). Resolvers that skip /etc/hosts (gRPC's c-ares, so Ray's GCS client)
resolve pods' names here as on a cluster.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Callable

CLUSTER_DOMAIN = "cluster.local"
HOSTS_HEADER = "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost\n"
TTL_S = 5
TYPE_A, CLASS_IN = 1, 1
NOERROR, FORMERR, NXDOMAIN, NOTIMP = 0, 1, 3, 4
MAX_NAME = 255


def hosts_file(pod: dict, ip: str) -> str:
    """The pod's /etc/hosts as the kubelet writes it."""
    spec, namespace = pod["spec"], pod["metadata"]["namespace"]
    hostname = pod_hostname(pod)
    own = [hostname]
    if spec.get("subdomain"):
        own.insert(0, f"{hostname}.{spec['subdomain']}.{namespace}.svc.{CLUSTER_DOMAIN}")
    return f"{HOSTS_HEADER}{ip}\t{' '.join(own)}\n"


def resolv_conf(namespace: str, nameserver: str) -> str:
    search = f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
    return f"nameserver {nameserver}\nsearch {search}\noptions ndots:5\n"


def pod_hostname(pod: dict) -> str:
    """spec.hostname, else the pod's name (at most 63 characters, as a label)."""
    return (pod["spec"].get("hostname") or pod["metadata"]["name"])[:63]


def records(endpoints: list[dict], headless: set[tuple[str, str]]) -> dict[str, list[str]]:
    """Name -> addresses, from the Endpoints of headless Services ((namespace, name) in
    `headless`): each address with a hostname by its own name, all of them by the Service's."""
    out: dict[str, list[str]] = {}
    for found in endpoints:
        meta = found["metadata"]
        if (meta["namespace"], meta["name"]) not in headless:
            continue
        service = f"{meta['name']}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}"
        for subset in found.get("subsets") or []:
            for address in subset.get("addresses") or []:
                out.setdefault(service, []).append(address["ip"])
                if address.get("hostname"):
                    out.setdefault(f"{address['hostname']}.{service}", []).append(address["ip"])
    return {name: sorted(set(ips)) for name, ips in out.items()}


def _question(query: bytes) -> tuple[str, int, int, int] | None:
    """(name, type, class, end offset) of the one question; None if it is malformed."""
    labels, at = [], 12
    while True:
        if at >= len(query):
            return None
        size = query[at]
        if size == 0:
            at += 1
            break
        if size > 63 or at + 1 + size > len(query):  # pointers (0xC0..) have no place here
            return None
        labels.append(query[at + 1 : at + 1 + size].decode("ascii", "replace").lower())
        at += 1 + size
    if at + 4 > len(query) or sum(len(label) + 1 for label in labels) > MAX_NAME:
        return None
    qtype, qclass = struct.unpack("!HH", query[at : at + 4])
    return ".".join(labels), qtype, qclass, at + 4


def answer(query: bytes, lookup: Callable[[str], list[str] | None]) -> bytes | None:
    """The response to one DNS query (None: not worth answering, as a server drops it)."""
    if len(query) < 12 or len(query) > 512:
        return None
    ident, flags, questions = struct.unpack("!HHH", query[:6])
    if flags & 0x8000:  # a response, not a query
        return None
    recursion = flags & 0x0100
    question = _question(query) if questions == 1 else None
    if question is None:
        return struct.pack("!HHHHHH", ident, 0x8000 | recursion | FORMERR, 0, 0, 0, 0)
    name, qtype, qclass, end = question
    opcode = (flags >> 11) & 0xF
    addresses = lookup(name) if opcode == 0 and qclass == CLASS_IN else None
    rcode = NOTIMP if opcode != 0 else NXDOMAIN if addresses is None else NOERROR
    answers = [ip for ip in addresses or [] if qtype == TYPE_A]
    header = struct.pack(
        "!HHHHHH", ident, 0x8000 | 0x0400 | recursion | 0x0080 | rcode, 1, len(answers), 0, 0
    )
    body = b"".join(
        struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL_S, 4) + ipaddress.IPv4Address(ip).packed
        for ip in answers
    )
    return header + query[12:end] + body


class DnsServer(asyncio.DatagramProtocol):
    """Cluster DNS on the node: answers from `lookup` (called on the serving loop)."""

    def __init__(self, lookup: Callable[[str], list[str] | None]) -> None:
        self.lookup = lookup
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        response = answer(data, self.lookup)
        if response is not None and self.transport is not None:
            self.transport.sendto(response, addr)
