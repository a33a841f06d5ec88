"""What the Prometheus Operator makes of a ServiceMonitor: one Prometheus scrape config per
endpoint, with the relabelings it generates (its pkg/prometheus/promcfg.go,
generateServiceMonitorConfig: role `endpoints`, the relabel selector mechanism, one shard, no
scrape class, no enforced namespace label), written by the tests for the lab's Prometheus.

It reads only the fields in READ and refuses a ServiceMonitor with any other: a field added to
the chart's ServiceMonitor fails here, rather than being silently left out of what the lab's
Prometheus scrapes."""

from __future__ import annotations

import re
from typing import Any

# The fields translated, per level. The chart's ServiceMonitor uses a subset of them.
READ = {
    "spec": {
        "selector",
        "namespaceSelector",
        "endpoints",
        "podTargetLabels",
        "targetLabels",
        "jobLabel",
    },
    "selector": {"matchLabels", "matchExpressions"},
    "namespaceSelector": {"any", "matchNames"},
    "endpoint": {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"},
}
# What the operator's config-reloader substitutes for $(SHARD) in the one shard's config.
SHARD = "0"


class UnsupportedField(ValueError):
    """A ServiceMonitor field this translator does not read."""


def sanitize(name: str) -> str:
    """A Kubernetes label name as a Prometheus label name (the operator's sanitizeLabelName)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _check(where: str, obj: dict, allowed: set[str]) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise UnsupportedField(f"{where}: {unknown} not translated (only {sorted(allowed)})")


def _service_label(key: str, prefix: str = "label") -> str:
    return f"__meta_kubernetes_service_{prefix}_{sanitize(key)}"


def selector_relabelings(selector: dict) -> list[dict]:
    """Keep (or drop) targets by their Service's labels, as the selector says."""
    _check("spec.selector", selector, READ["selector"])
    out = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        sources = [_service_label(key), _service_label(key, "labelpresent")]
        out.append({"action": "keep", "source_labels": sources, "regex": f"({value});true"})
    for expr in selector.get("matchExpressions") or []:
        key, op = expr["key"], expr["operator"]
        both = [_service_label(key), _service_label(key, "labelpresent")]
        present = [_service_label(key, "labelpresent")]
        values = "|".join(expr.get("values") or [])
        out.append(
            {
                "In": {"action": "keep", "source_labels": both, "regex": f"({values});true"},
                "NotIn": {"action": "drop", "source_labels": both, "regex": f"({values});true"},
                "Exists": {"action": "keep", "source_labels": present, "regex": "true"},
                "DoesNotExist": {"action": "drop", "source_labels": present, "regex": "true"},
            }[op]
        )
    return out


def target_relabelings(spec: dict, port: str) -> list[dict]:
    """The endpoint's port, then namespace/service/pod/container, then the Service's and the
    pod's labels copied onto the target, the job and the endpoint."""
    kind_name = [
        "__meta_kubernetes_endpoint_address_target_kind",
        "__meta_kubernetes_endpoint_address_target_name",
    ]
    out: list[dict] = [
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_endpoint_port_name"],
            "regex": port,
        },
        {
            "source_labels": list(kind_name),
            "separator": ";",
            "regex": "Node;(.*)",
            "replacement": "${1}",
            "target_label": "node",
        },
        {
            "source_labels": list(kind_name),
            "separator": ";",
            "regex": "Pod;(.*)",
            "replacement": "${1}",
            "target_label": "pod",
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        # Pods that finished are not scraped.
        {
            "action": "drop",
            "source_labels": ["__meta_kubernetes_pod_phase"],
            "regex": "(Failed|Succeeded)",
        },
    ]
    copied = [("service", label) for label in spec.get("targetLabels") or []]
    copied += [("pod", label) for label in spec.get("podTargetLabels") or []]
    for kind, label in copied:
        out.append(
            {
                "source_labels": [f"__meta_kubernetes_{kind}_label_{sanitize(label)}"],
                "target_label": sanitize(label),
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    out.append(
        {
            "source_labels": ["__meta_kubernetes_service_name"],
            "target_label": "job",
            "replacement": "${1}",
        }
    )
    if spec.get("jobLabel"):
        out.append(
            {
                "source_labels": [_service_label(spec["jobLabel"])],
                "target_label": "job",
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    out.append({"target_label": "endpoint", "replacement": port})
    return out


def sharding_relabelings() -> list[dict]:
    """One shard of one: every target hashes to shard 0 and is kept."""
    return [
        {
            "source_labels": ["__address__"],
            "target_label": "__tmp_hash",
            "modulus": 1,
            "action": "hashmod",
        },
        {"source_labels": ["__tmp_hash"], "regex": SHARD, "action": "keep"},
    ]


def namespaces(monitor: dict) -> list[str] | None:
    """The namespaces discovered: None for all (`any: true`), else the names listed, else the
    ServiceMonitor's own."""
    selector = monitor["spec"].get("namespaceSelector") or {}
    _check("spec.namespaceSelector", selector, READ["namespaceSelector"])
    if selector.get("any"):
        return None
    return list(selector.get("matchNames") or [monitor["metadata"]["namespace"]])


def scrape_configs(monitor: dict) -> list[dict[str, Any]]:
    """The scrape configs the Prometheus Operator generates from `monitor`."""
    spec = monitor["spec"]
    _check("spec", spec, READ["spec"])
    meta = monitor["metadata"]
    sd: dict[str, Any] = {"role": "endpoints"}
    names = namespaces(monitor)
    if names is not None:
        sd["namespaces"] = {"names": names}
    configs = []
    for i, endpoint in enumerate(spec["endpoints"]):
        _check(f"spec.endpoints[{i}]", endpoint, READ["endpoint"])
        if "port" not in endpoint:
            raise UnsupportedField(f"spec.endpoints[{i}]: only endpoints by port name")
        config: dict[str, Any] = {
            "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{i}",
            "honor_labels": bool(endpoint.get("honorLabels", False)),
            "kubernetes_sd_configs": [sd],
        }
        for field, key in (
            ("interval", "scrape_interval"),
            ("scrapeTimeout", "scrape_timeout"),
            ("path", "metrics_path"),
            ("scheme", "scheme"),
        ):
            if field in endpoint:
                config[key] = endpoint[field]
        config["relabel_configs"] = [
            # The job's configured name, kept for relabelings that want it.
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            *selector_relabelings(spec["selector"]),
            *target_relabelings(spec, endpoint["port"]),
            *sharding_relabelings(),
        ]
        configs.append(config)
    return configs
