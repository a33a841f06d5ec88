"""Engine configuration, named and meant as vLLM's engine args.

`EngineArgs` is the one set of defaults: `pagefleet serve`'s flags take theirs from it, and
it builds the scheduler's and the cache's configs (whose defaults are its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagefleet.common.weight_formats import canonical_quantization
from pagefleet.engine.kv_cache.state_cache import StateConfig
from pagefleet.engine.lora.config import LoRAConfig, LoRAModulePath, parse_lora_modules
from pagefleet.engine.pooling.config import CONVERTS, RUNNERS
from pagefleet.engine.spec_decode.config import SpeculativeConfig

LINEAR_PATHS = ("auto", "packed", "plain")  # --linear-path

if TYPE_CHECKING:
    from pagefleet.engine.simulated import SimulationProfile


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid ({_flag(name)}): {rule}")


# --kv-cache-dtype: auto = the model's dtype; fp8 = e4m3 with per-layer scales (fp8_e4m3 is
# vLLM's other name for it; e5m2 is not stored). See kv_cache/fp8.py.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES, "float32", "bfloat16", "float16")
# --all2all-backend: how MoE tokens meet experts placed on ranks (model/expert_parallel.py);
# vLLM's GPU-library backends are named so their refusal says why.
ALL2ALL_BACKENDS = ("allgather_reducescatter", "alltoall")
ALL2ALL_NOT_BUILT = (
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "flashinfer_all2allv",
)


@dataclass
class EngineArgs:
    """Engine arguments, named as vLLM's (`LLM(model=..., **engine_args)`)."""

    model: str  # a checkpoint folder or a .gguf file
    tokenizer: str | None = None  # a folder with an HF tokenizer (default: the model's own)
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Requests whose prompt is split over several steps at once (vLLM's name and default).
    max_num_partial_prefills: int = 1
    # Most prompt tokens one request may compute in one step; 0 means no cap beyond the budget.
    long_prefill_token_threshold: int = 0
    dtype: str = "auto"
    # Weight format (vLLM's names: fp8, compressed-tensors, awq, gptq, gguf); None: the
    # checkpoint's quantization_config. fp8 on a float checkpoint quantizes it at load.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    kv_cache_memory: float = 4.0  # GiB for the KV pool on CPU (VLLM_CPU_KVCACHE_SPACE)
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.92
    device: str = "auto"  # auto = cuda if available, else cpu
    # auto = triton on CUDA; on CPU torch or numba by measurement (attention/cpu_auto.py)
    attention_backend: str = "auto"
    # float32 CPU linears: oneDNN-packed, plain, or auto (per weight shape, measured once per
    # CPU model: model/linear_plan.py).
    linear_path: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    served_model_name: str | None = None
    # Run the real scheduler and cache with a time model instead of the weights.
    simulate: SimulationProfile | None = None
    # Disaggregated prefill/decode: vLLM's --kv-transfer-config JSON (parsed by the engine).
    kv_transfer_config: str | None = None
    kv_hold_timeout: float = 120.0  # seconds a prefill engine keeps blocks for a decode engine
    # Ranks the weights and the KV heads are split over (one device each); rank 0 is this
    # process, the others run under the executor backend (mp: local processes, ray: actors).
    tensor_parallel_size: int = 1
    # None: mp while the ranks fit on this node's devices, ray when they do not.
    distributed_executor_backend: str | None = None
    # Mixture-of-experts models: whole experts per rank (else every expert split over ranks).
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"
    # CPU offload tier: GiB of host memory for blocks evicted from the device pool (0: none).
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    # Speculative decoding: vLLM's --speculative-config JSON (or its dict, or the parsed
    # config, which it becomes here); see spec_decode/.
    speculative_config: str | dict[str, Any] | SpeculativeConfig | None = None
    # Multi-LoRA (engine/lora/): adapters by name (`name=path` or JSON, parsed into
    # LoRAModulePath), slots per step, their largest rank, adapters kept in host memory.
    enable_lora: bool = False
    lora_modules: list[str | dict] | tuple[LoRAModulePath, ...] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Hybrid models: prefix-cache state snapshots kept beside the running sequences' state
    # (None: max_num_seqs with prefix caching, else 1); see capacity.num_state_slots.
    num_state_snapshots: int | None = None
    # Pooling models (pooling/): vLLM's --runner (auto: pooling for a checkpoint that declares
    # it), --convert (embed: pool a *ForCausalLM's hidden states) and --pooler-config JSON.
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _require(self.kv_cache_memory > 0, "kv_cache_memory", self.kv_cache_memory, "must be > 0")
        if self.quantization is not None:
            try:
                canonical_quantization(self.quantization)
            except ValueError as e:
                raise ValueError(f"quantization={self.quantization!r} is invalid: {e}") from None
        _require(self.runner in RUNNERS, "runner", self.runner, f"one of {', '.join(RUNNERS)}")
        _require(self.convert in CONVERTS, "convert", self.convert, f"one of {', '.join(CONVERTS)}")
        self.lora_modules = parse_lora_modules(self.lora_modules)
        self.lora_config()  # checks the LoRA flags
        self._check_offloading()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None:
            self._check_speculation()
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"must be one of {', '.join(KV_CACHE_DTYPES)} (fp8 is e4m3; e5m2 is not supported)",
        )
        _require(
            self.linear_path in LINEAR_PATHS,
            "linear_path",
            self.linear_path,
            f"must be one of {', '.join(LINEAR_PATHS)}",
        )
        _require(
            self.attention_backend in ("auto", "torch", "numba", "triton"),
            "attention_backend",
            self.attention_backend,
            "must be auto, torch, numba or triton",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )
        _require(
            self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            "must be >= 1",
        )
        _require(
            self.distributed_executor_backend in (None, "mp", "ray"),
            "distributed_executor_backend",
            self.distributed_executor_backend,
            "must be mp or ray",
        )
        if self.num_state_snapshots is not None:
            _require(
                self.num_state_snapshots >= 0,
                "num_state_snapshots",
                self.num_state_snapshots,
                "must be >= 0",
            )
        _require(
            self.all2all_backend not in ALL2ALL_NOT_BUILT,
            "all2all_backend",
            self.all2all_backend,
            "that backend needs a GPU communication library pagefleet does not build; choose "
            + " or ".join(ALL2ALL_BACKENDS),
        )
        _require(
            self.all2all_backend in ALL2ALL_BACKENDS,
            "all2all_backend",
            self.all2all_backend,
            "must be one of " + ", ".join(ALL2ALL_BACKENDS),
        )
        if self.num_gpu_blocks_override is not None:
            _require(
                self.num_gpu_blocks_override >= 1,
                "num_gpu_blocks_override",
                self.num_gpu_blocks_override,
                "must be >= 1",
            )

    def _check_speculation(self) -> None:
        """Combinations this slice of speculative decoding does not build (see spec_decode/)."""
        rules = (
            (self.simulate is None, "--simulate (it needs real weights)"),
            (
                self.speculative_config.method != "draft_model" or self.tensor_parallel_size == 1,
                "a draft model under --tensor-parallel-size > 1",
            ),
        )
        for ok, what in rules:
            _require(
                ok,
                "speculative_config",
                self.speculative_config,
                f"speculative decoding does not run with {what} yet",
            )

    def _check_offloading(self) -> None:
        _require(
            math.isfinite(self.kv_offloading_size) and self.kv_offloading_size >= 0,
            "kv_offloading_size",
            self.kv_offloading_size,
            "must be a finite number >= 0 (GiB of host memory)",
        )
        _require(
            self.kv_offloading_backend != "lmcache",
            "kv_offloading_backend",
            self.kv_offloading_backend,
            "lmcache is not built into pagefleet; use native",
        )
        _require(
            self.kv_offloading_backend == "native",
            "kv_offloading_backend",
            self.kv_offloading_backend,
            "must be native",
        )
        if self.kv_offloading_size:
            _require(
                self.tensor_parallel_size == 1,
                "kv_offloading_size",
                self.kv_offloading_size,
                "the CPU offload tier does not run under tensor parallelism yet "
                "(--tensor-parallel-size 1, or no --kv-offloading-size)",
            )
            _require(
                self.enable_prefix_caching,
                "kv_offloading_size",
                self.kv_offloading_size,
                "the CPU offload tier keeps prefix-cached blocks: it needs prefix caching",
            )
            _require(
                self.simulate is None,
                "kv_offloading_size",
                self.kv_offloading_size,
                "the CPU offload tier needs real weights (not --simulate)",
            )

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA settings with --enable-lora, else None (ValueError for flags that need
        it, or values out of range)."""
        if not self.enable_lora:
            _require(
                not self.lora_modules, "lora_modules", self.lora_modules, "needs --enable-lora"
            )
            return None
        _require(self.simulate is None, "enable_lora", True, "LoRA needs real weights")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's limits, with max_model_len resolved against the checkpoint."""
        return SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_partial_prefills=self.max_num_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_loras=self.max_loras if self.enable_lora else 0,
        )

    def cache_config(
        self, num_gpu_blocks: int, num_host_blocks: int = 0, state: StateConfig | None = None
    ) -> CacheConfig:
        """The cache's shape, with the pool's size as measured (or overridden), the offload
        tier's in blocks and a hybrid model's state slots."""
        return CacheConfig(
            self.block_size, num_gpu_blocks, self.enable_prefix_caching, num_host_blocks, state
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = EngineArgs.block_size
    num_gpu_blocks: int = 0  # the pool's size; sized from memory by the runner when 0
    enable_prefix_caching: bool = EngineArgs.enable_prefix_caching
    num_host_blocks: int = 0  # the CPU offload tier's size (--kv-offloading-size); 0: none
    state: StateConfig | None = None  # a hybrid model's state slots (kv_cache/state_cache.py)

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(bs >= 1 and bs & (bs - 1) == 0, "block_size", bs, "must be a power of two")
        _require(self.num_gpu_blocks >= 0, "num_gpu_blocks", self.num_gpu_blocks, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # resolved by the engine (EngineArgs' default is the checkpoint's)
    max_num_seqs: int = EngineArgs.max_num_seqs
    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    max_num_partial_prefills: int = EngineArgs.max_num_partial_prefills
    long_prefill_token_threshold: int = EngineArgs.long_prefill_token_threshold
    max_loras: int = 0  # distinct LoRA adapters in one step; 0: LoRA is off

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be >= 1",
        )
        _require(self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
        _require(
            self.max_num_partial_prefills >= 1,
            "max_num_partial_prefills",
            self.max_num_partial_prefills,
            "must be >= 1",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            "must be >= 0",
        )
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f"must be >= max_num_seqs ({self.max_num_seqs}), or running requests starve",
        )
        if not self.enable_chunked_prefill:
            _require(
                self.long_prefill_token_threshold == 0,
                "long_prefill_token_threshold",
                self.long_prefill_token_threshold,
                "splits prompts, which needs chunked prefill (--enable-chunked-prefill)",
            )
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= max_model_len ({self.max_model_len}) without chunked prefill",
            )
