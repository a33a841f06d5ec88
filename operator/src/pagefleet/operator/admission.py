"""Capacity admission: before any object is applied, a GPU pool whose engine's KV pool cannot
hold one request of its max-model-len on its GPUs (or that sets no max-model-len) is refused,
with the numbers and the knobs that fix it; spec.capacity.admitAnyway deploys it anyway. A LoRA
adapter (spec.adapters) whose rank is above a pool's max-lora-rank is refused too, whatever
the pool's devices (its engines would refuse it at start): the rank comes from an hf://
adapter's adapter_config.json (fetched as a model's config.json is) or the spec's `rank`.

The sums are pagefleet.common.capacity's (the engine and `pagefleet plan` use the same). The
GPU type comes from spec.capacity or the pool's nodeSelector (GPU feature discovery's
nvidia.com/gpu.product label), the model's shape from spec.capacity.modelConfig or, for an
hf:// model, its config.json fetched from the model's endpoint (ModelConfigs, the one I/O
here). A check that cannot run says why in the condition and deploys; CPU pools are not
checked against GPU memory.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from pagefleet.common.capacity import (
    GB,
    Admission,
    GpuBudget,
    ModelShape,
    admit,
    gpu_key,
    gpu_memory_bytes,
    num_state_slots,
    plan_on_gpu,
)
from pagefleet.common.weight_formats import online_weights_format
from pagefleet.operator.spec import Adapter, CapacitySpec, Model, Pool, Spec, SpecError

CONDITION = "CapacityAdmitted"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
# The engine's defaults (pagefleet.engine.config.EngineArgs; the operator does not import the
# engine): what a pool that sets neither flag runs with.
ENGINE_GPU_MEMORY_UTILIZATION = 0.92
ENGINE_BLOCK_SIZE = 16
ENGINE_CUDA_DTYPE = "bfloat16"  # --dtype auto on a GPU
ENGINE_MAX_LORA_RANK = 16
# Fetching an hf:// model's config.json: a small file, a short wait, and a failure retried
# after a while rather than on every pass.
CONFIG_TIMEOUT_S = 5.0
MAX_CONFIG_BYTES = 1 << 20
RETRY_FAILED_S = 300.0
# Configs (up to MAX_CONFIG_BYTES each) and failures remembered at most: the newest are kept.
MAX_CACHED_CONFIGS = 64
MAX_REDIRECTS = 5
REDIRECT_CODES = (301, 302, 303, 307, 308)
OVERRIDE = "set spec.capacity.admitAnyway: true to deploy anyway"


class CapacityUnknown(Exception):
    """The check cannot run (the GPU type or the model's shape is not known); says why."""


@dataclass(frozen=True)
class CapacityVerdict:
    """The CapacityAdmitted condition of a ModelDeployment: "True" (every GPU pool fits),
    "False" (one does not: refused unless admitAnyway), or "Unknown" (the check could not
    run; the objects are applied)."""

    status: str
    reason: str
    message: str
    refused: bool = False


class CapacityRefused(SpecError):
    """A GPU pool cannot hold one request of max-model-len (or none is set): nothing is
    applied; the Degraded condition and a Warning event carry the verdict."""

    def __init__(self, verdict: CapacityVerdict) -> None:
        super().__init__(verdict.message)
        self.reason = verdict.reason
        self.verdict = verdict


# ---------------------------------------------------------------------------- one pool


def _engine_arg(spec: Spec, pool: Pool, name: str) -> Any:
    return {**spec.engine_args, **pool.engine_args}.get(name)


def _number_arg(spec: Spec, pool: Pool, name: str, kind: type, default: Any) -> Any:
    value = _engine_arg(spec, pool, name)
    if value is None:
        return default
    try:
        return kind(str(value))
    except ValueError:
        raise SpecError(
            f"spec.pools.{pool.name}: engine arg {name} {value!r} is not a number"
        ) from None


def _switch_arg(spec: Spec, pool: Pool, name: str) -> bool:
    """An on/off engine arg: true (or "true") is the flag given."""
    value = _engine_arg(spec, pool, name)
    return value is True or str(value).lower() == "true"


def max_model_len(spec: Spec, pool: Pool) -> int | None:
    length = _number_arg(spec, pool, "max-model-len", int, None)
    if length is not None and length < 1:
        raise SpecError(f"spec.pools.{pool.name}: max-model-len must be >= 1, not {length}")
    return length


def gpu_budget(pool: Pool, capacity: CapacitySpec) -> GpuBudget:
    """Memory per GPU of the pool's nodes: spec.capacity's, else the GPU product its
    nodeSelector asks for (CapacityUnknown when neither says)."""
    if capacity.gpu_memory_gb is not None:
        memory = int(capacity.gpu_memory_gb * GB)
    elif capacity.gpu is not None:
        memory = gpu_memory_bytes(capacity.gpu)
    else:
        product = pool.node_selector.get(GPU_PRODUCT_LABEL)
        if product is None:
            raise CapacityUnknown(
                f"the GPU type is not known: set spec.capacity.gpu (or gpuMemoryGB), or "
                f"nodeSelector {GPU_PRODUCT_LABEL} on pool {pool.name}"
            )
        if gpu_key(product) is None:
            raise CapacityUnknown(
                f"{GPU_PRODUCT_LABEL} {product!r} is not a GPU the operator knows: set "
                "spec.capacity.gpuMemoryGB"
            )
        memory = gpu_memory_bytes(product)
    return GpuBudget(memory, overhead_bytes=int(capacity.overhead_gb * GB))


def state_slots(spec: Spec, pool: Pool, shape: ModelShape) -> int:
    """A hybrid model's state slots, paid before the KV pool, for a pool that sets
    max-num-seqs (capacity.num_state_slots, as `pagefleet plan --max-num-seqs`); 0 otherwise:
    the published figures leave the state apart, and so does a pool that does not say."""
    seqs = _number_arg(spec, pool, "max-num-seqs", int, None)
    if seqs is None or not shape.linear_state_bytes_per_sequence:
        return 0
    snapshots = _number_arg(spec, pool, "num-state-snapshots", int, None)
    caching = _engine_arg(spec, pool, "enable-prefix-caching") not in (False, "false", "False")
    try:
        return num_state_slots(seqs, snapshots, caching)
    except ValueError as e:
        raise SpecError(f"spec.pools.{pool.name}: {e}") from None


def check_pool(spec: Spec, pool: Pool, shape: ModelShape, budget: GpuBudget) -> Admission:
    """Does one engine of `pool` hold one request of its max-model-len? (Pure.)"""
    dtype = _engine_arg(spec, pool, "dtype")
    engine_dtype = str(dtype) if dtype not in (None, "auto") else ENGINE_CUDA_DTYPE
    kv = _engine_arg(spec, pool, "kv-cache-dtype")
    utilization = _number_arg(
        spec, pool, "gpu-memory-utilization", float, ENGINE_GPU_MEMORY_UTILIZATION
    )
    try:
        plan = plan_on_gpu(
            shape,
            GpuBudget(budget.gpu_memory, utilization, budget.overhead_bytes),
            weights_format=weights_format(spec, pool, shape, engine_dtype),
            kv_format=str(kv) if kv not in (None, "auto") else engine_dtype,
            tensor_parallel_size=pool.tensor_parallel_size,
            block_size=_number_arg(spec, pool, "block-size", int, ENGINE_BLOCK_SIZE),
            num_parameters=spec.capacity.num_parameters,
            state_slots=state_slots(spec, pool, shape),
            expert_parallel=_switch_arg(spec, pool, "enable-expert-parallel"),
        )
    except ValueError as e:
        raise CapacityUnknown(f"the capacity cannot be computed: {e}") from e
    return admit(shape, plan, max_model_len(spec, pool))


def weights_format(spec: Spec, pool: Pool, shape: ModelShape, engine_dtype: str) -> str:
    """What the engine's weights will be: spec.capacity.weightsFormat, else what
    engineArgs.quantization makes of a float checkpoint (fp8 quantizes at load), else the
    checkpoint's own quantization (its config.json), else the engine's dtype."""
    quantization = _engine_arg(spec, pool, "quantization")
    try:
        online = online_weights_format(None if quantization is None else str(quantization))
    except ValueError as e:
        raise CapacityUnknown(str(e)) from e
    return (
        spec.capacity.weights_format
        or (shape.weights_format if shape.weights_format else online)
        or engine_dtype
    )


# ---------------------------------------------------------------------------- every pool


def judge(spec: Spec, shape_of: Callable[[], ModelShape], gpu_pools: list[Pool]) -> CapacityVerdict:
    """Every GPU pool's verdict in one condition. `shape_of` gives the model's shape or raises
    CapacityUnknown; it is only called for pools whose GPU is known."""
    refusals: list[tuple[str, str]] = []
    unknown: list[str] = []
    fits: list[str] = []
    for pool in gpu_pools:
        where = f"pool {pool.name}"
        try:
            budget = gpu_budget(pool, spec.capacity)  # before the shape: no fetch without it
            verdict = check_pool(spec, pool, shape_of(), budget)
        except CapacityUnknown as e:
            if max_model_len(spec, pool) is None:
                refusals.append(("NoMaxModelLen", f"{where}: {no_max_model_len(pool)}"))
            else:
                unknown.append(f"{where}: {e}")
            continue
        if verdict.admitted:
            fits.append(f"{where}: {verdict.message}")
        else:
            refusals.append((verdict.reason, f"{where}: {verdict.message}"))
    return _combine(spec.capacity, refusals, unknown, fits)


def no_max_model_len(pool: Pool) -> str:
    return (
        "no max-model-len is set, so the engine takes the model's native context, usually far "
        "more than one replica's KV pool holds. Set engineArgs.max-model-len (`pagefleet plan` "
        f"gives what fits on {pool.tensor_parallel_size} GPU(s))"
    )


def _combine(
    capacity: CapacitySpec, refusals: list[tuple[str, str]], unknown: list[str], fits: list[str]
) -> CapacityVerdict:
    if refusals:
        message = "; ".join(m for _, m in refusals)
        if capacity.admit_anyway:
            return CapacityVerdict(
                "False", refusals[0][0], f"{message} (deployed anyway: spec.capacity.admitAnyway)"
            )
        return CapacityVerdict("False", refusals[0][0], f"{message} ({OVERRIDE})", refused=True)
    if unknown:
        return CapacityVerdict(
            "Unknown", "CapacityUnknown", "the check could not run: " + "; ".join(unknown)
        )
    return CapacityVerdict("True", "CapacityOK", "; ".join(fits))


def check_capacity(
    spec: Spec, configs: ModelConfigs, token: Callable[[], str | None]
) -> CapacityVerdict | None:
    """The CapacityAdmitted verdict (None: no GPU pool, nothing checked). An hf:// model's
    config.json is fetched (with `token()` when the model names a token Secret) only when a
    pool's GPU is known and spec.capacity gives no modelConfig."""
    gpu_pools = [p for p in spec.pools if p.gpus > 0]
    if not gpu_pools:
        return None
    shapes: list[ModelShape] = []

    def shape_of() -> ModelShape:
        if not shapes:
            shapes.append(model_shape(spec.capacity, spec.model, configs, token))
        return shapes[0]

    return judge(spec, shape_of, gpu_pools)


def model_shape(
    capacity: CapacitySpec, model: Model, configs: ModelConfigs, token: Callable[[], str | None]
) -> ModelShape:
    if capacity.model_config is not None:
        config = capacity.model_config
    elif model.source == "hf" and model.hf is not None:
        config = configs.get(config_url(model), token())
    else:
        raise CapacityUnknown(
            f"the model's shape is not known ({model.source} source): set "
            "spec.capacity.modelConfig to its config.json"
        )
    try:
        return ModelShape.from_hf_config(config)
    except (KeyError, TypeError, ValueError) as e:
        raise CapacityUnknown(f"the model's config.json has no usable shape ({e})") from e


# ---------------------------------------------------------------------------- LoRA adapters


class AdapterRefused(SpecError):
    """An adapter's rank is above a pool's max-lora-rank: nothing is applied."""

    reason = "AdapterRankTooHigh"


def max_lora_rank(spec: Spec, pool: Pool) -> int:
    return _number_arg(spec, pool, "max-lora-rank", int, ENGINE_MAX_LORA_RANK)


def adapter_rank(
    adapter: Adapter, configs: ModelConfigs, token: Callable[[], str | None]
) -> int | None:
    """An hf:// adapter's rank from its adapter_config.json, else the spec's (None: not
    known here; the engines check it when they load it)."""
    source = adapter.source
    if source.source == "hf" and source.hf is not None:
        try:
            rank = configs.get(config_url(source, "adapter_config.json"), token()).get("r")
        except CapacityUnknown:
            rank = None
        if isinstance(rank, int) and not isinstance(rank, bool):
            return rank
    return adapter.rank


def check_adapters(
    spec: Spec,
    configs: ModelConfigs,
    token_of: Callable[[Adapter], Callable[[], str | None]],
) -> None:
    """Raise AdapterRefused naming every adapter whose rank is above a pool's max-lora-rank
    (engineArgs, the pool's over the spec's; the engine's 16 by default)."""
    problems = []
    for adapter in spec.adapters:
        rank = adapter_rank(adapter, configs, token_of(adapter))
        if rank is None:
            continue
        for pool in spec.pools:
            limit = max_lora_rank(spec, pool)
            if rank > limit:
                problems.append(
                    f"spec.adapters {adapter.name}: rank {rank} is above pool {pool.name}'s "
                    f"max-lora-rank {limit}: raise engineArgs.max-lora-rank to {rank} or more "
                    "(each adapter slot takes memory for that rank)"
                )
    if problems:
        raise AdapterRefused("; ".join(problems))


# ---------------------------------------------------------------------------- config.json


def config_url(model: Model, file: str = "config.json") -> str:
    """Where an hf:// model's (or adapter's) `file` is served."""
    assert model.hf is not None
    endpoint = (model.endpoint or DEFAULT_HF_ENDPOINT).rstrip("/")
    revision = quote(model.hf.revision, safe="")
    return f"{endpoint}/{model.hf.repo}/resolve/{revision}/{file}"


class _Deadline:
    """Shuts down the sockets of one fetch when its time is up: a socket timeout bounds each
    recv, not the fetch, and an endpoint trickling its headers or body a byte at a time
    would otherwise hold the reconcile for days."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def connect(self, *args: Any, **kwargs: Any) -> socket.socket:
        """http.client's socket.create_connection, watched."""
        sock = socket.create_connection(*args, **kwargs)
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                sock.shutdown(socket.SHUT_RDWR)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                with contextlib.suppress(OSError):  # already closed
                    sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


class _Watched:
    """An urllib handler whose connections open their sockets through a _Deadline."""

    deadline: _Deadline

    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(partial(_watched, http_class, self.deadline), req, **kwargs)  # type: ignore[misc]


def _watched(http_class: Any, deadline: _Deadline, host: str, **kwargs: Any) -> Any:
    connection = http_class(host, **kwargs)
    connection._create_connection = deadline.connect  # http.client opens its socket here
    return connection


class _WatchedHTTP(_Watched, urllib.request.HTTPHandler):
    pass


class _WatchedHTTPS(_Watched, urllib.request.HTTPSHandler):
    pass


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect comes back as an HTTPError, unread (urllib would read its whole body and
    follow ftp:// too): fetch_config follows it itself."""

    def http_error_302(self, req, fp, code, msg, headers):
        return None

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    handlers = []
    for kind in (_WatchedHTTP, _WatchedHTTPS):
        handler = kind()
        handler.deadline = deadline
        handlers.append(handler)
    return urllib.request.build_opener(*handlers, _NoRedirects)


def redirect_headers(origin: str, url: str, token: str | None) -> dict[str, str]:
    """The token goes only to the scheme, host and port it was given for (never to another
    host a redirect names, nor in clear text after https)."""
    same = urlsplit(origin)[:2] == urlsplit(url)[:2]
    return {"Authorization": f"Bearer {token}"} if token and same else {}


def fetch_config(url: str, token: str | None, timeout_s: float = CONFIG_TIMEOUT_S) -> dict:
    """GET a config.json of at most MAX_CONFIG_BYTES within timeout_s, following at most
    MAX_REDIRECTS http(s) redirects (CapacityUnknown otherwise). What a failure says names
    the status or the error's kind, never what the endpoint sent."""
    if token and not (token.isascii() and token.isprintable()):
        # http.client would refuse it with an error that quotes it into the condition.
        raise CapacityUnknown(f"the token for {url} is not a valid HTTP header value")
    deadline = _Deadline(timeout_s)
    try:
        body = _get(url, token, _opener(deadline), timeout_s)
    except CapacityUnknown:
        raise
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        if deadline.expired:
            raise CapacityUnknown(f"{url} took more than {timeout_s:g} s") from None
        raise CapacityUnknown(f"{url} could not be fetched ({_failure(e)})") from None
    finally:
        deadline.cancel()
    if deadline.expired:  # the body was cut short
        raise CapacityUnknown(f"{url} took more than {timeout_s:g} s")
    try:
        config = json.loads(bytes(body))
    except (ValueError, RecursionError):
        raise CapacityUnknown(f"{url} is not JSON (or nested too deeply)") from None
    if not isinstance(config, dict):
        raise CapacityUnknown(f"{url} is not a JSON object")
    return config


def _failure(e: Exception) -> str:
    """What went wrong, in words of this side: http.client's errors carry the server's
    bytes (a status line), so only their kind is said."""
    if isinstance(e, http.client.HTTPException):
        return f"a malformed HTTP answer: {type(e).__name__}"
    return str(getattr(e, "reason", e))[:200]


def _get(
    url: str, token: str | None, opener: urllib.request.OpenerDirector, timeout_s: float
) -> bytearray:
    where = url
    for _ in range(MAX_REDIRECTS + 1):
        if urlsplit(where).scheme not in ("http", "https"):
            raise CapacityUnknown(f"{url} redirects to a URL that is not http(s)")
        request = urllib.request.Request(where, headers=redirect_headers(url, where, token))
        try:
            with opener.open(request, timeout=timeout_s) as response:
                return _read_bounded(url, response)
        except urllib.error.HTTPError as e:
            e.close()
            location = e.headers.get("Location") if e.code in REDIRECT_CODES else None
            if location is None:
                hint = (
                    " (a gated model needs spec.model.hf.tokenSecret)"
                    if e.code in (401, 403)
                    else ""
                )
                raise CapacityUnknown(f"{url} answered HTTP {e.code}{hint}") from None
            where = urljoin(where, location)
    raise CapacityUnknown(f"{url} redirects more than {MAX_REDIRECTS} times")


def _read_bounded(url: str, response: Any) -> bytearray:
    body = bytearray()
    while chunk := response.read(64 * 1024):
        body += chunk
        if len(body) > MAX_CONFIG_BYTES:
            raise CapacityUnknown(f"{url} is larger than {MAX_CONFIG_BYTES} bytes")
    return body


@dataclass
class ModelConfigs:
    """config.json of hf:// models by URL, per operator: fetched once, a failure retried after
    RETRY_FAILED_S (a model's shape does not change under a revision, and a pass every few
    seconds must not wait on an unreachable endpoint each time)."""

    fetch: Callable[[str, str | None], dict] = fetch_config
    clock: Callable[[], float] = time.monotonic
    found: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, tuple[float, str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, url: str, token: str | None) -> dict:
        with self.lock:
            if url in self.found:
                self.found[url] = self.found.pop(url)  # the newest: kept longest
                return self.found[url]
            failure = self.failed.get(url)
            if failure is not None and self.clock() - failure[0] < RETRY_FAILED_S:
                raise CapacityUnknown(failure[1])
        try:
            config = self.fetch(url, token)
        except CapacityUnknown as e:
            with self.lock:
                _remember(self.failed, url, (self.clock(), str(e)))
            raise
        with self.lock:
            _remember(self.found, url, config)
            self.failed.pop(url, None)
        return config


def _remember(cache: dict, key: str, value: Any) -> None:
    """Insert `key` as the newest entry, dropping the oldest beyond MAX_CACHED_CONFIGS."""
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > MAX_CACHED_CONFIGS:
        del cache[next(iter(cache))]
