"""What a container runs, from its pod spec, as the kubelet computes it: the environment (service
variables, `env` with `$(VAR)` references and `valueFrom`, `envFrom`), the argv (command/args
over the image's entrypoint/cmd, expanded), and named ports. Pure functions over plain data."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


class ConfigError(Exception):
    """A reference the container needs is missing (CreateContainerConfigError)."""


@dataclass(frozen=True)
class Image:
    """What an image reference runs as in the lab (its config, as `docker inspect` shows it)."""

    env: dict[str, str] = field(default_factory=dict)
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    user: tuple[int, int] = (0, 0)
    workdir: str = "/"
    # Container path -> host path: the image's own files the lab provides (weights).
    files: dict[str, str] = field(default_factory=dict)
    # Host paths the image holds at the same place (this venv and its Python).
    expose: tuple[str, ...] = ()


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names are replaced, `$$` is a literal `$`, anything
    else (unknown names, an unclosed `$(`) stays as written."""
    out = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$" or i + 1 >= len(text):
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : close]
            out.append(env.get(name, f"$({name})"))
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


_FIELD_LABEL = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_value(pod: dict, path: str) -> str:
    """A downward-API `fieldRef.fieldPath` of the pod."""
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs", [])),
    }
    if path in simple:
        return simple[path] or ""
    m = _FIELD_LABEL.match(path)
    if m:
        return (meta.get(m[1]) or {}).get(m[2], "")
    raise ConfigError(f"unsupported fieldPath {path!r}")


# A lookup of (kind "ConfigMap" | "Secret", name) -> its data (secrets already decoded).
Lookup = Callable[[str, str], dict[str, str] | None]


def secret_data(secret: dict) -> dict[str, str]:
    decoded = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**decoded, **(secret.get("stringData") or {})}


def _key_ref(ref: dict, kind: str, lookup: Lookup) -> str | None:
    data = lookup(kind, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"{kind} {ref['name']!r} or its key {ref['key']!r} is missing")
    return data[ref["key"]]


def container_env(
    pod: dict, container: dict, service_env: Mapping[str, str], lookup: Lookup
) -> dict[str, str]:
    """The variables the kubelet sets (not the image's): service variables, then envFrom, then
    env in order, each value expanded against what was defined before it."""
    env: dict[str, str] = dict(service_env)
    for source in container.get("envFrom", []):
        kind, ref = (
            ("ConfigMap", source["configMapRef"])
            if "configMapRef" in source
            else ("Secret", source["secretRef"])
        )
        data = lookup(kind, ref["name"])
        if data is None and not ref.get("optional"):
            raise ConfigError(f"{kind} {ref['name']!r} is missing")
        prefix = source.get("prefix", "")
        env.update({prefix + k: v for k, v in (data or {}).items()})
    for var in container.get("env", []):
        if "valueFrom" not in var:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source:
            value = _key_ref(source["configMapKeyRef"], "ConfigMap", lookup)
        elif "secretKeyRef" in source:
            value = _key_ref(source["secretKeyRef"], "Secret", lookup)
        else:
            raise ConfigError(f"unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[var["name"]] = value
    return env


def container_argv(container: dict, image: Image, env: Mapping[str, str]) -> list[str]:
    """`command` replaces the image's entrypoint and `args` its cmd; both are expanded."""
    if "command" in container:
        command = [expand(c, env) for c in container["command"]]
        args = [expand(a, env) for a in container.get("args", [])]
    else:
        command = list(image.entrypoint)
        args = (
            [expand(a, env) for a in container["args"]] if "args" in container else list(image.cmd)
        )
    argv = command + args
    if not argv:
        raise ConfigError("no command: neither the container nor its image gives one")
    return argv


def process_env(image: Image, env: Mapping[str, str]) -> dict[str, str]:
    """What the process sees: the image's variables, overridden by the kubelet's."""
    return {**image.env, **env}


def resolve_port(port: int | str, container: dict) -> int:
    """A probe's or service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ConfigError(f"the container has no port named {port!r}")


def service_env(host: str, port: int) -> dict[str, str]:
    """The variables every container gets for the API server's `kubernetes` Service."""
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
    }
