"""The Prometheus pieces tests share: the project's scripts (scripts/install_prometheus.py,
scripts/check_promql.py) loaded by path, and the installed `promtool`."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (scripts/ is no package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


check_promql = load_script("check_promql")


@cache
def prometheus_binaries() -> dict[str, Path]:
    """{"prometheus": path, "promtool": path} in this virtualenv, installed by the project's
    script if missing (no network when they are there)."""
    script = load_script("install_prometheus")
    return script.install_prometheus(Path(sys.executable).parent, script.default_cache())


# prometheus-operator's PrometheusRule (monitoring.coreos.com/v1), the fields the chart uses,
# closed so that a misspelt field fails; the rules themselves go through promtool.
_DURATION = {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": _DURATION,
                                        "labels": _STRINGS,
                                        "annotations": _STRINGS,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        }
    },
}


def validate_prometheus_rule(obj: dict) -> None:
    """The object's fields (closed schema), then its rules through `promtool check rules`."""
    import jsonschema

    jsonschema.Draft7Validator(PROMETHEUS_RULE_SCHEMA).validate(obj)
    out = check_promql.check_rules(prometheus_binaries()["promtool"], obj["spec"]["groups"])
    assert out.returncode == 0, out.stdout + out.stderr
