"""Which adapters an engine knows, which are in memory, and which sit in the model's slots.

Three tiers, as vLLM's: the registry (every adapter a request may name: `--lora-modules` and
those loaded at run time), a CPU cache of read adapters (`--max-cpu-loras`, LRU) and the
resident slots (`--max-loras`, LRU) the layers compute from. The scheduler runs at most
`max_loras` distinct adapters in a step, so `activate` always finds them slots, evicting the
least recently used adapters the step does not run. Runs on the engine thread; under tensor
parallelism `on_install` tells the other ranks to install the same adapter in the same slot.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch

from pagefleet.engine.client import LoRAStats
from pagefleet.engine.lora.adapter import (
    AdapterWeights,
    LoRAWeight,
    Target,
    check_adapter,
    load_adapter,
)
from pagefleet.engine.lora.config import LoRAConfig
from pagefleet.engine.lora.layers import LoRAState, lora_targets, refuse_quantized, wrap_linears
from pagefleet.engine.lora.ops import LoRABatch, kernels_for
from pagefleet.engine.lora.request import LoRARequest, check_name

logger = logging.getLogger("pagefleet.engine")
# Adapters an engine knows at most (each costs a name and a path until it is read): clients
# with runtime loading must not grow the registry, or the metrics listing it, without bound.
MAX_ADAPTERS = 1024


@dataclass
class LoRACounters:
    """Adapter loads: from disk into the CPU cache, and into a resident slot."""

    disk_loads: int = 0
    slot_loads: int = 0


def split_by_layer(
    weights: AdapterWeights, targets: dict[str, Target]
) -> dict[str, dict[Hashable, LoRAWeight]]:
    """An adapter's projections grouped by the model layer that computes them, by part."""
    layers: dict[str, dict[Hashable, LoRAWeight]] = {}
    for projection, weight in weights.modules.items():
        target = targets[projection]
        layers.setdefault(target.module, {})[target.part] = weight
    return layers


def install(state: LoRAState, targets: dict[str, Target], slot: int, weights) -> None:
    """Every layer's share of `weights` (None: clear) into `slot`."""
    layers = split_by_layer(weights, targets) if weights is not None else {}
    for name, wrapper in state.wrappers.items():
        wrapper.install(slot, layers.get(name, {}))


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        state: LoRAState,
        targets: dict[str, Target],
        dtype: torch.dtype,
        base_model_name: str,
    ) -> None:
        self.config, self.state, self.targets = config, state, targets
        self.dtype, self.base_model_name = dtype, base_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._cpu: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident, least recent first
        self._free = list(range(config.max_loras))
        self.counters = LoRACounters()
        # Under tensor parallelism: (slot, adapter or None) for the other ranks.
        self.on_install: Callable[[int, LoRARequest | None], None] | None = None

    # ------------------------------------------------------------------ the registry

    def register(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter (config and tensor shapes against the model, rank) and make it
        nameable; ValueError if it cannot run here or the name is taken."""
        check_name(name)
        if name == self.base_model_name:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name")
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if len(self.adapters) >= MAX_ADAPTERS:
            raise ValueError(f"{MAX_ADAPTERS} LoRA adapters are loaded: unload one first")
        check_adapter(path, self.targets, self.config.max_lora_rank)
        request = LoRARequest(name, next(self._ids), str(path), base_model_name)
        self.adapters[name] = request
        return request

    def unregister(self, name: str) -> LoRARequest:
        """Forget an adapter and drop its weights (KeyError if unknown). The caller makes sure
        no request still runs with it."""
        request = self.adapters.pop(name)
        self._cpu.pop(name, None)
        slot = self._slots.pop(name, None)
        if slot is not None:
            self._install(slot, None)
            self._free.append(slot)
        return request

    def resolve(self, request: LoRARequest | None) -> LoRARequest | None:
        """The registered adapter a request names (an offline caller's new adapter is
        registered on the way, as vLLM's LLM.generate does); ValueError if unknown."""
        if request is None:
            return None
        known = self.adapters.get(request.lora_name)
        if known is None:
            if not request.lora_path:
                raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded")
            return self.register(request.lora_name, request.lora_path, request.base_model_name)
        if request.lora_path and request.lora_path != known.lora_path:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is loaded from another path "
                f"({known.lora_path}); unload it first"
            )
        return known

    # ------------------------------------------------------------------ residency

    def activate(self, names: Iterable[str]) -> dict[str, int]:
        """Slots for a step's adapters (at most max_loras of them), installing the missing
        ones over the least recently used adapters the step does not run."""
        wanted = set(names)
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, --max-loras is fewer")
        slots = {}
        for name in wanted:
            slot = self._slots.get(name)
            if slot is None:
                slot = self._free.pop() if self._free else self._evict(wanted)
                self._install(slot, self.adapters[name])
                self._slots[name] = slot
                self.counters.slot_loads += 1
            self._slots.move_to_end(name)
            slots[name] = slot
        return slots

    def _evict(self, keep: set[str]) -> int:
        victim = next(n for n in self._slots if n not in keep)
        return self._slots.pop(victim)

    def _install(self, slot: int, request: LoRARequest | None) -> None:
        if self.on_install is not None:  # the other ranks read theirs meanwhile
            self.on_install(slot, request)
        self.install_local(slot, request)

    def install_local(self, slot: int, request: LoRARequest | None) -> None:
        """This rank's share of `request`'s adapter (None: nothing) into `slot`."""
        weights = self._weights(request) if request is not None else None
        install(self.state, self.targets, slot, weights)

    def _weights(self, request: LoRARequest) -> AdapterWeights:
        """From the CPU cache, or read from disk into it (evicting its least recent)."""
        name = request.lora_name
        weights = self._cpu.get(name)
        if weights is None:
            weights = load_adapter(
                request.lora_path, self.targets, self.config.max_lora_rank, self.dtype
            )
            self.counters.disk_loads += 1
            if len(self._cpu) >= self.config.cpu_slots:
                self._cpu.popitem(last=False)
            self._cpu[name] = weights
        self._cpu.move_to_end(name)
        return weights

    def batch(self, row_slots: list[int], device: torch.device) -> LoRABatch | None:
        return LoRABatch.build(row_slots, device)

    @property
    def resident(self) -> list[str]:
        return list(self._slots)

    def stats(self, scheduler) -> LoRAStats:
        """Read from a scrape thread: the queues are copied first (tuple() of a deque runs
        without letting the engine thread in)."""
        running = {r.lora_name for r in tuple(scheduler.running)} - {None}
        waiting = {r.lora_name for r in tuple(scheduler.waiting)} - {None}
        c = self.counters
        return LoRAStats(
            tuple(sorted(running)),
            tuple(sorted(waiting)),
            self.config.max_loras,
            c.slot_loads,
            c.disk_loads,
        )

    def slot_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.state.wrappers.values())


def attach_lora(
    model,
    config: LoRAConfig,
    dtype: torch.dtype,
    device: torch.device,
    base_model_name: str,
    kernels: str | None = None,
) -> LoRAManager:
    """Wrap the model's targetable linear layers for `config.max_loras` adapters (a quantized
    one refused) and return the manager of their slots (`kernels`: ops.KERNELS' name, or
    triton; default: by device)."""
    state = LoRAState(config.max_loras, config.max_lora_rank, kernels_for(device, kernels))
    targets = lora_targets(model, model.config)
    refuse_quantized(model, targets)
    wrap_linears(model, {t.module for t in targets.values()}, state, dtype, device)
    return LoRAManager(config, state, targets, dtype, base_model_name)


def setup_lora(args, model, dtype: torch.dtype, device: torch.device) -> LoRAManager | None:
    """With --enable-lora: the model's LoRA layers and their manager, every --lora-modules
    adapter checked and registered (a bad one fails the start); else None."""
    config = args.lora_config()
    if config is None:
        return None
    manager = attach_lora(model, config, dtype, device, args.served_model_name or args.model)
    for module in args.lora_modules:
        try:
            manager.register(module.name, module.path, module.base_model_name)
        except ValueError as e:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e}") from None
    logger.info(
        "LoRA: %d adapter slots of rank <= %d (%.1f MiB, %s kernels), %d adapters kept in host "
        "memory; adapters: %s",
        config.max_loras,
        config.max_lora_rank,
        manager.slot_bytes() / (1 << 20),
        manager.state.kernels.name,
        config.cpu_slots,
        ", ".join(manager.adapters) or "none yet",
    )
    return manager


def serving_lora(manager: LoRAManager | None) -> LoRAManager:
    """The engine's manager, or ValueError for an engine started without --enable-lora."""
    if manager is None:
        raise ValueError("this engine serves no LoRA adapters (--enable-lora)")
    return manager


def remove_adapter(manager: LoRAManager | None, kv_cache, requests: Iterable, name: str) -> None:
    """Unload an adapter (KeyError if unknown, or LoRA is off; ValueError while a request runs
    with it). The prefix cache is dropped with it: its blocks are keyed by its name, which a
    later adapter may take (vLLM keeps them, and serves the old adapter's KV to the new one)."""
    if manager is None or name not in manager.adapters:
        raise KeyError(name)
    users = sum(1 for r in requests if r.lora_name == name and not r.status.finished)
    if users:
        raise ValueError(
            f"LoRA adapter {name!r} has {users} request(s) in flight; unload it once they end"
        )
    manager.unregister(name)
    kv_cache.reset_prefix_cache()
