"""LoRA's engine flags, as vLLM names them: --enable-lora, --lora-modules, --max-loras,
--max-lora-rank, --max-cpu-loras (parsed and checked here; no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.engine.json_flag import parse_json_object
from pagefleet.engine.lora.request import check_name

MAX_LORA_RANK = 512  # vLLM's largest


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: `name=path`, or JSON with `base_model_name`."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, raw: str | dict) -> LoRAModulePath:
        if isinstance(raw, LoRAModulePath):
            return raw
        if isinstance(raw, dict) or raw.lstrip().startswith("{"):
            fields = parse_json_object("--lora-modules", raw, ("name", "path", "base_model_name"))
            name, path = fields.get("name"), fields.get("path")
            base = fields.get("base_model_name")
            if not isinstance(path, str) or not path or not isinstance(base, str | None):
                raise ValueError('--lora-modules JSON needs "name" and "path" strings')
            return cls(check_name(name), path, base)
        name, sep, path = raw.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora-modules {raw!r}: give name=path or a JSON object")
        return cls(check_name(name), path)


@dataclass(frozen=True)
class LoRAConfig:
    """Adapters resident per step (`max_loras`, the model's slots), their largest rank, and
    adapters kept in host memory (`max_cpu_loras`, at least max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_loras <= 256:
            raise ValueError(f"--max-loras {self.max_loras}: must be 1..256")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"--max-lora-rank {self.max_lora_rank}: must be 1..{MAX_LORA_RANK}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras {self.max_cpu_loras} must be >= --max-loras {self.max_loras}"
            )

    @property
    def cpu_slots(self) -> int:
        return self.max_cpu_loras or self.max_loras


def parse_lora_modules(raw) -> tuple[LoRAModulePath, ...]:
    """The --lora-modules entries (strings, dicts or parsed), names unique."""
    if raw is None:
        return ()
    if isinstance(raw, str | dict):
        raw = [raw]
    modules = tuple(LoRAModulePath.parse(item) for item in raw)
    names = [m.name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules names {duplicates} more than one adapter")
    return modules
