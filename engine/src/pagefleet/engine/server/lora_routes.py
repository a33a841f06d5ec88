"""LoRA adapters on the engine's API: `model: <adapter>` selects one, `/v1/models` lists them
with their parent, and `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` change them at run
time, behind an explicit flag.

Run-time loading makes the server read files a client names, so it is off unless the operator
starts the engine with `--allow-runtime-lora-updating` (a flag, not vLLM's environment variable
VLLM_ALLOW_RUNTIME_LORA_UPDATING: it shows in `--help` and in the pod's arguments, where the
rest of the engine's surface is reviewed) and `--lora-root DIR`: a path must lead, once every
symlink is followed, into DIR, and is refused before anything about its existence is said.
The API key guards these endpoints as every other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from pagefleet.common.http_errors import APIError
from pagefleet.engine.lora.adapter import (
    AdapterNotFound,
    AdapterOutsideRoot,
    resolve_under_root,
)
from pagefleet.engine.lora.request import LoRARequest, check_name

MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class LoRAUpdates:
    """Run-time adapter loading is on: adapters load from under `root` only."""

    root: Path


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(max_length=256)
    lora_path: str = Field(max_length=MAX_PATH_CHARS)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(max_length=256)
    lora_int_id: int | None = None


def adapter_of(engine, served_model_name: str, name: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model), else 404."""
    if name is None or name == served_model_name:
        return None
    if engine.limits.max_loras:
        for adapter in engine.list_loras():
            if adapter.lora_name == name:
                return adapter
    raise APIError(
        404,
        f"model {name!r} does not exist; this server serves {served_model_name!r}"
        + (" and its LoRA adapters (GET /v1/models)" if engine.limits.max_loras else ""),
        "not_found_error",
        "model",
    )


def adapter_cards(engine, served_model_name: str, max_model_len: int) -> list[dict]:
    """/v1/models entries of the adapters: each names the base model as its parent (their
    paths stay on the server)."""
    if not engine.limits.max_loras:
        return []
    return [
        {
            "id": a.lora_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pagefleet",
            "root": a.lora_name,
            "parent": served_model_name,
            "max_model_len": max_model_len,
        }
        for a in engine.list_loras()
    ]


def _updates(request: Request) -> tuple[object, LoRAUpdates]:
    state = request.app.state.server
    updates = state.config.lora_updates
    if updates is None:
        raise APIError(
            404,
            "run-time LoRA adapter loading is off (start the engine with "
            "--allow-runtime-lora-updating and --lora-root)",
            "not_found_error",
        )
    return state, updates


async def load_lora_adapter(req: LoadLoRAAdapterRequest, request: Request):
    state, updates = _updates(request)
    if req.load_inplace:
        raise APIError(
            400, "load_inplace is not supported: unload the adapter first", param="load_inplace"
        )
    try:
        name = check_name(req.lora_name)
        if name == state.config.served_model_name:
            raise ValueError(f"{name!r} is the base model's name")
        folder = resolve_under_root(updates.root, req.lora_path)
    except AdapterOutsideRoot as e:
        raise APIError(403, str(e), "permission_error", "lora_path") from None
    except AdapterNotFound as e:
        raise APIError(404, str(e), "not_found_error", "lora_path") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    try:
        await state.engine.add_lora(LoRARequest(name, 0, str(folder)))
    except AdapterNotFound as e:  # the folder changed since it was resolved
        raise APIError(404, str(e), "not_found_error", "lora_path") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return {"message": f"Success: LoRA adapter {name!r} added successfully."}


async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, request: Request):
    state, _ = _updates(request)
    try:
        await state.engine.remove_lora(req.lora_name)
    except KeyError:
        raise APIError(
            404, f"LoRA adapter {req.lora_name!r} is not loaded", "not_found_error", "lora_name"
        ) from None
    except ValueError as e:
        raise APIError(409, str(e), "conflict_error", "lora_name") from None
    return {"message": f"Success: LoRA adapter {req.lora_name!r} removed successfully."}


LORA_ROUTES = (
    ("POST", "/v1/load_lora_adapter", load_lora_adapter),
    ("POST", "/v1/unload_lora_adapter", unload_lora_adapter),
)
