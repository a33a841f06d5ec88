"""Where a ModelDeployment's weights come from, as pod pieces: the `model` volume, the init
containers that fill it (copy from a weights image, download from Hugging Face) and the path
the engine (and the router's tokenizer) reads; the same for its LoRA adapters (spec.adapters:
hf:// ones downloaded into the pod's `adapters` volume, pvc:// ones mounted read-only)."""

from __future__ import annotations

from typing import Any

from pagefleet.common.model_download import cache_path
from pagefleet.operator.spec import Adapter, Model, SecretKeyRef

MODEL_MOUNT = "/models"
ADAPTER_MOUNT = "/adapters"  # hf:// adapters' download cache (the pod's own)
ADAPTER_CLAIMS_MOUNT = "/adapter-claims"  # pvc:// adapters, one folder each
# The router reads only the tokenizer: from a weights image, copy its small files, not the weights.
TOKENIZER_COPY = (
    'cd "$SOURCE" && for f in *.json *.txt *.model *.tiktoken *.jinja; '
    'do if [ -f "$f" ]; then cp "$f" /models/; fi; done'
)


def model_path(model: Model) -> str:
    """The checkpoint folder as the engine and the router see it."""
    if model.source == "pvc" and model.path:
        return f"{MODEL_MOUNT}/{model.path.strip('/')}"
    if model.source == "hf" and model.hf is not None:
        return str(cache_path(MODEL_MOUNT, model.hf))
    return MODEL_MOUNT


def _secret_env(name: str, ref: SecretKeyRef) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _download(
    model: Model,
    image: str,
    security: dict[str, Any],
    tokenizer_only: bool,
    volume: str = "model",
    mount: str = MODEL_MOUNT,
    name: str | None = None,
) -> dict:
    """`pagefleet download` into the model volume (or an adapter into `volume` at `mount`);
    the token only ever reaches this container."""
    assert model.hf is not None
    revision = f"@{model.hf.revision}"
    command = ["pagefleet", "download", f"hf://{model.hf.repo}{revision}"]
    command += ["--cache-dir", mount]
    if tokenizer_only:
        command.append("--tokenizer-only")
    env = [{"name": "HF_HUB_OFFLINE", "value": "0"}, {"name": "HOME", "value": "/tmp"}]
    if model.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": model.endpoint})
    if model.token_secret is not None:
        env.append(_secret_env("HF_TOKEN", model.token_secret))
    return {
        "name": name or ("download-tokenizer" if tokenizer_only else "download-model"),
        "image": image,
        "command": command,
        "env": env,
        "volumeMounts": [
            {"name": volume, "mountPath": mount},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": security,
        # `kubectl describe pod` shows why a download failed (gated, missing, unreachable).
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def engine_model_volume(
    model: Model, image: str, security: dict[str, Any]
) -> tuple[dict, list[dict]]:
    """The engines' `model` volume and the init containers that fill it."""
    if model.source == "pvc":
        claim = {"claimName": model.claim_name, "readOnly": True}
        return {"name": "model", "persistentVolumeClaim": claim}, []
    if model.source == "hostPath":
        return {"name": "model", "hostPath": {"path": model.path, "type": "Directory"}}, []
    if model.source == "hf":
        return _hf_volume(model), [_download(model, image, security, tokenizer_only=False)]
    copy = {
        "name": "copy-model",
        "image": model.image,
        # The weights image only has to hold files (and a shell): copy them into the pod.
        # Not `cp -a`: a non-root user may not set times or owners on the volume's root.
        "command": ["sh", "-c", 'cp -R "$SOURCE"/. /models/'],
        "env": [{"name": "SOURCE", "value": model.path or "/model"}],
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}],
        "securityContext": security,
    }
    return {"name": "model", "emptyDir": {}}, [copy]


def _hf_volume(model: Model) -> dict:
    """The download cache: a shared claim (replicas download once) or the pod's own."""
    if model.claim_name:
        return {"name": "model", "persistentVolumeClaim": {"claimName": model.claim_name}}
    return {"name": "model", "emptyDir": {}}


def router_model_volume(
    model: Model, image: str, security: dict[str, Any]
) -> tuple[dict, list[dict]]:
    """The router's view of the checkpoint (it reads the tokenizer only): the engines' claim
    or host folder read-only; for an image, its tokenizer files copied; for hf://, the
    tokenizer downloaded into the pod's own volume (never waiting on an engine's download)."""
    if model.source == "hf":
        init = _download(model, image, security, tokenizer_only=True)
        return {"name": "model", "emptyDir": {}}, [init]
    volume, init_containers = engine_model_volume(model, image, security)
    return volume, [
        {**c, "name": "copy-tokenizer", "command": ["sh", "-c", TOKENIZER_COPY]}
        for c in init_containers
    ]


def adapter_path(adapter: Adapter, index: int) -> str:
    """The adapter's PEFT folder as the engine sees it."""
    source = adapter.source
    if source.source == "hf" and source.hf is not None:
        return str(cache_path(ADAPTER_MOUNT, source.hf))
    path = f"{ADAPTER_CLAIMS_MOUNT}/{index}"
    return f"{path}/{source.path.strip('/')}" if source.path else path


def adapter_volumes(
    adapters: tuple[Adapter, ...], image: str, security: dict[str, Any]
) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, the engine's mounts, init containers) that put every adapter where
    adapter_path says: one download per hf:// adapter into a shared emptyDir, one read-only
    claim per pvc:// adapter."""
    volumes, mounts, inits = [], [], []
    if any(a.source.source == "hf" for a in adapters):
        volumes.append({"name": "adapters", "emptyDir": {}})
        mounts.append({"name": "adapters", "mountPath": ADAPTER_MOUNT, "readOnly": True})
    for i, adapter in enumerate(adapters):
        source = adapter.source
        if source.source == "hf":
            name = f"download-adapter-{i}"
            inits.append(_download(source, image, security, False, "adapters", ADAPTER_MOUNT, name))
            continue
        claim = {"claimName": source.claim_name, "readOnly": True}
        volumes.append({"name": f"adapter-{i}", "persistentVolumeClaim": claim})
        mount = {"name": f"adapter-{i}", "mountPath": f"{ADAPTER_CLAIMS_MOUNT}/{i}"}
        mounts.append({**mount, "readOnly": True})
    return volumes, mounts, inits
