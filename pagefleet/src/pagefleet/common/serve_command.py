"""The `pagefleet serve` command line of one engine, built in one place for every launcher: the
operator's engine pods and `pagefleet up`'s engine processes. Pure (no I/O, no torch): a
launcher says where the engine listens and which role it plays, this module says how the
engine is told."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EngineArg = str | int | float | bool
JsonConfig = dict[str, Any]
# Engine flags whose value is a JSON object: a launcher sets some of their keys, and a user's
# keys merge over them (rather than replacing the whole object).
JSON_ENGINE_ARGS = ("kv-events-config", "kv-transfer-config", "pooler-config")
# vLLM's NixlConnector roles: prefill produces KV blocks, decode consumes them.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def kv_events_config(host: str, port: int) -> JsonConfig:
    """KV events published on host:port; a router that starts (or restarts) late replays what
    it missed from port + 1."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{host}:{port}",
        "replay_endpoint": f"tcp://{host}:{port + 1}",
    }


def kv_transfer_config(connector: str, role: str, ip: str, port: int) -> JsonConfig:
    """A prefill or decode engine's KV-transfer settings: it advertises `ip` to its peers and
    binds there too (kv_bind_host defaults to kv_ip)."""
    return {"kv_connector": connector, "kv_role": KV_ROLES[role], "kv_ip": ip, "kv_port": port}


def merge_json_configs(*layers: Mapping[str, Mapping[str, Any]]) -> dict[str, JsonConfig]:
    """Per JSON-valued flag, each layer's keys merged over the earlier layers' keys."""
    merged: dict[str, JsonConfig] = {}
    for layer in layers:
        for key, config in layer.items():
            merged[key] = {**merged.get(key, {}), **config}
    return merged


def engine_flags(args: Mapping[str, EngineArg]) -> list[str]:
    """vLLM-style flags: `--key value`, bools as `--key` / `--no-key`."""
    flags: list[str] = []
    for key, value in args.items():
        if value is True:
            flags.append(f"--{key}")
        elif value is False:
            flags.append(f"--no-{key}")
        else:
            flags.extend([f"--{key}", str(value)])
    return flags


@dataclass(frozen=True)
class ServeCommand:
    """One engine's command line, as a launcher decides it."""

    program: str  # `pagefleet`, or its path
    model: str
    host: str
    port: int
    served_model_name: str
    device: str | None = None  # None: the engine's own choice (auto)
    fleet_secret_file: str | None = None
    # The JSON-valued flags (JSON_ENGINE_ARGS), user keys already merged.
    json_args: Mapping[str, JsonConfig] = field(default_factory=dict)
    simulate: bool = False
    # The user's flags, last: argparse keeps the last value, so any launcher default above
    # can be overridden.
    user_flags: Sequence[str] = ()


def serve_argv(command: ServeCommand) -> list[str]:
    argv = [command.program, "serve", command.model, "--host", command.host]
    argv += ["--port", str(command.port), "--served-model-name", command.served_model_name]
    if command.device:
        argv += ["--device", command.device]
    if command.fleet_secret_file:
        argv += ["--fleet-secret-file", command.fleet_secret_file]
    for key, config in command.json_args.items():
        argv += [f"--{key}", json.dumps(config, separators=(",", ":"))]
    if command.simulate:
        argv.append("--simulate")
    return argv + list(command.user_flags)
