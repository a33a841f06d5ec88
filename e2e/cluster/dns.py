"""The names a pod resolves in the lab, as cluster DNS and the kubelet give them: the kubelet's
/etc/hosts (the pod's own name; with a subdomain, its FQDN) plus, standing in for cluster DNS,
the records of headless Services that name pods: `<hostname>.<service>.<ns>.svc.cluster.local`
for each endpoint address with a hostname, and the shorter names a pod's DNS search path
(`<ns>.svc.cluster.local svc.cluster.local cluster.local`) completes to it. Pure functions."""

from __future__ import annotations

from dataclasses import dataclass

CLUSTER_DOMAIN = "cluster.local"
HOSTS_HEADER = "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost\n"


@dataclass(frozen=True)
class Record:
    """An A record of a pod behind a headless Service."""

    ip: str
    hostname: str
    service: str
    namespace: str

    def names(self, from_namespace: str) -> list[str]:
        """The names that resolve to it from a pod in `from_namespace`."""
        base = f"{self.hostname}.{self.service}.{self.namespace}"
        names = [f"{base}.svc.{CLUSTER_DOMAIN}", base]
        if from_namespace == self.namespace:
            names.append(f"{self.hostname}.{self.service}")
        return names


def records(endpoints: list[dict]) -> list[Record]:
    """Pod records of every Endpoints object: addresses (ready, or published not ready) that
    carry a hostname."""
    out = []
    for found in endpoints:
        meta = found["metadata"]
        for subset in found.get("subsets") or []:
            for address in subset.get("addresses") or []:
                if address.get("hostname"):
                    out.append(
                        Record(address["ip"], address["hostname"], meta["name"], meta["namespace"])
                    )
    return sorted(set(out), key=lambda r: (r.namespace, r.service, r.hostname, r.ip))


def hosts_file(pod: dict, ip: str, cluster: list[Record]) -> str:
    """The pod's /etc/hosts: its own entry as the kubelet writes it, then the cluster's."""
    spec, namespace = pod["spec"], pod["metadata"]["namespace"]
    hostname = pod_hostname(pod)
    own = [hostname]
    if spec.get("subdomain"):
        own.insert(0, f"{hostname}.{spec['subdomain']}.{namespace}.svc.{CLUSTER_DOMAIN}")
    lines = [HOSTS_HEADER, f"{ip}\t{' '.join(own)}\n"]
    lines += [f"{r.ip}\t{' '.join(r.names(namespace))}\n" for r in cluster]
    return "".join(lines)


def pod_hostname(pod: dict) -> str:
    """spec.hostname, else the pod's name (at most 63 characters, as a label)."""
    return (pod["spec"].get("hostname") or pod["metadata"]["name"])[:63]
