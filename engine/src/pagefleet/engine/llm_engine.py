"""The engine core: scheduler + model runner + sampler + detokeniser, one `step()` at a time.

`LLM` (offline) and `AsyncLLM` (the server's engine) are thin loops around it. A user request
with `n > 1` becomes n sequences; the siblings are admitted once the first has computed the
prompt, so they take its blocks from the prefix cache instead of computing them again.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagefleet.common.capacity import CapacityPlan
from pagefleet.common.fleet_auth import FleetSecret, load_fleet_secret
from pagefleet.common.kv_events import KVEventListener
from pagefleet.common.tokenizer import load_tokenizer
from pagefleet.engine.attention.backend import select_backend
from pagefleet.engine.client import (
    EngineLimits,
    EngineObserver,
    EngineStats,
    KVOffloadStats,
    KVTransferStats,
    StepStats,
)
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.detokenizer import Detokenizer
from pagefleet.engine.kv_sizing import (
    DraftPool,
    check_holds_one,
    kv_pool_blocks,
    kv_pool_plan_of,
    refuse_past_host_memory,
    state_slots_of,
)
from pagefleet.engine.lora.manager import remove_adapter, serving_lora, setup_lora
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.model.causal_lm import CausalLM
from pagefleet.engine.model.linear import weight_bytes as model_weight_bytes
from pagefleet.engine.model.loader import (
    kv_cache_format,
    load_model,
    read_config,
    resolve_dtype,
)
from pagefleet.engine.model.registry import model_config
from pagefleet.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.runner import ModelRunner, kv_bytes_per_block
from pagefleet.engine.sampler import Sampler
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import Scheduler
from pagefleet.engine.simulated import SimulatedRunner
from pagefleet.engine.spec_decode.config import SpeculativeConfig, refuse_recurrent_state
from pagefleet.engine.spec_decode.draft import DraftModelProposer
from pagefleet.engine.spec_decode.ngram import NgramProposer
from pagefleet.engine.spec_decode.stats import SpecDecodeCounters
from pagefleet.engine.spec_decode.verifier import StepTokens, propose, sample_with_drafts
from pagefleet.engine.structured import (
    GrammarCompiler,
    GrammarGate,
    advance_grammar,
    constrain_logits,
    trim_drafts,
)

FAILED_RANK_GRACE_S = 5.0
DRAFT_CPU_DISABLE_AT = 8  # see _spec_disable_at
logger = logging.getLogger("pagefleet.engine")
GiB = 1 << 30


@dataclass
class _Sequence:
    """One of a request's n samples: its scheduler request and what the user will see."""

    index: int
    request: Request
    detok: Detokenizer | None
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float | None
    stop_reason: int | str | None = None


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[_Sequence] = field(default_factory=list)
    pending: list[_Sequence] = field(default_factory=list)  # siblings waiting for the prompt
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens the first sample found cached
    kv_transfer_params: dict | None = None  # set when a prefill engine holds the blocks
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.request.status.finished for s in self.sequences)


class LLMEngine:
    lm_head = True  # the pooling engine (pooling/engine.py) loads its model without one

    def __init__(
        self,
        args: EngineArgs,
        kv_event_listener: KVEventListener | None = None,
        fleet_secret: FleetSecret | None = None,
    ):
        """`fleet_secret` (default: $PAGEFLEET_FLEET_SECRET[_FILE]) authenticates KV-transfer
        peers; an engine with --kv-transfer-config needs one."""
        self.args = args
        # Why a tensor-parallel rank is gone (the engine then fails: health answers 503).
        self.failure: str | None = None
        self._supervision = None
        self.device = _resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        hf_config = read_config(args.model)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        max_positions = hf_config.get("max_position_embeddings", 4096)
        self.max_model_len = args.max_model_len or max_positions
        if self.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len={self.max_model_len} is more than the model's "
                f"max_position_embeddings={max_positions} (--max-model-len)"
            )
        window = self._sliding_window(hf_config)
        if window is not None and self.max_model_len > window:
            raise ValueError(
                f"the model uses sliding-window attention ({window} tokens), which pagefleet "
                f"does not implement; set --max-model-len {window} or less"
            )
        self.draft_model: CausalLM | None = None
        self.lora = None  # the LoRAManager with --enable-lora (lora/manager.py)
        if args.simulate is not None:
            self.model_config = model_config(hf_config)
            num_blocks = args.num_gpu_blocks_override or args.simulate.num_gpu_blocks
            self._log_kv_size(num_blocks, None)
            runner = SimulatedRunner(args.simulate, self.model_config.vocab_size)
        else:
            # The draft first: its weights and pool come out of the memory the KV's does.
            self.draft_model = self._load_draft()
            runner, num_blocks = self._load_model_runner()
        self.runner = runner
        self.proposer, self.spec_counters = self._speculation()
        self.spec_disable_at = self._spec_disable_at()
        if self.spec_disable_at is not None:
            logger.info("Speculation pauses while %d or more requests run", self.spec_disable_at)
        self.tier_copier = self._offload_tier()
        num_host_blocks = self.tier_copier.host_blocks.shape[0] if self.tier_copier else 0
        self.scheduler = Scheduler.create(
            args.scheduler_config(self.max_model_len),
            args.cache_config(num_blocks, num_host_blocks, self.runner.state_config()),
            kv_event_listener,
            self.model_config.vocab_size,
        )
        self.connector = self._kv_connector(hf_config, fleet_secret)
        self.sampler = Sampler(args.seed, self.device)
        self.eos_token_ids = _eos_ids(hf_config, self.tokenizer, args.model)
        self.groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}  # scheduler request id -> user request id
        self._ids = itertools.count()
        # Constrained requests wait there for their grammar (compiled on first use).
        self.grammars = GrammarGate(
            lambda: GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
            )
        )
        self._failures: list[tuple[str, Exception]] = []  # requests failed off the step path
        # Told of every step and KV pull, on the engine's thread (metrics, event flushing).
        self.observers: list[EngineObserver] = []
        self.limits = EngineLimits(
            self.scheduler.rules,
            args.max_num_seqs,
            args.enable_prefix_caching,
            self.runner.kv_cache_dtype,
            args.max_loras if self.lora is not None else 0,
        )

    def subscribe(self, observer: EngineObserver) -> None:
        self.observers.append(observer)

    def stats(self) -> EngineStats:
        sched = self.scheduler
        kv = sched.kv_cache
        transfer = None
        if self.connector is not None:
            t = self.connector.stats
            transfer = KVTransferStats(t.bytes, t.transfers, t.failures, t.fallbacks)
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_cache_usage=kv.usage,
            num_cached_free_blocks=kv.num_cached_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            num_held_blocks=sched.num_held_blocks,
            kv_transfer=transfer,
            kv_offload=self._offload_stats(),
            spec_decode=self.spec_counters.snapshot() if self.spec_counters else None,
            lora=self.lora.stats(sched) if self.lora is not None else None,
            expert_load=self.runner.expert_load(),
        )

    def _offload_stats(self) -> KVOffloadStats | None:
        tier = self.scheduler.kv_cache.host_tier
        if tier is None:
            return None
        t = tier.stats
        return KVOffloadStats(
            len(tier),
            t.queried_blocks,
            t.hit_blocks,
            t.loaded_blocks,
            t.stored_blocks,
            t.evicted_blocks,
            t.loads,
            self.tier_copier.bytes_moved,
            tier.block_size,
        )

    # ------------------------------------------------------------------ set-up

    def _speculation(
        self,
    ) -> tuple[NgramProposer | DraftModelProposer | None, SpecDecodeCounters | None]:
        """The proposer and acceptance counters of --speculative-config, or (None, None)."""
        config = self.args.speculative_config
        if config is None:
            return None, None
        if _prefill_only(self.args.kv_transfer_config):
            logger.info("Speculative decoding off: a prefill engine (kv_producer) decodes nothing")
            return None, None
        if config.method == "draft_model":
            proposer = self._draft_proposer(config)
            logger.info(
                "Speculative decoding: draft_model %s, %d speculative tokens",
                config.model,
                config.num_speculative_tokens,
            )
            return proposer, SpecDecodeCounters(config.num_speculative_tokens)
        logger.info(
            "Speculative decoding: %s, %d speculative tokens, prompt lookup %d..%d",
            config.method,
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
        )
        proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        return proposer, SpecDecodeCounters(config.num_speculative_tokens)

    def _spec_disable_at(self) -> int | None:
        """Running requests at which speculation stops: disable_by_batch_size if given; else,
        for a draft model on CPU, DRAFT_CPU_DISABLE_AT (benchmarks/spec_decode.py: there its
        draft forwards cost more than they save at 8 running requests; see
        docs/benchmarks.md). n-gram drafts cost almost nothing to propose, and a GPU stays
        memory-bound to far larger batches: no default there."""
        config = self.args.speculative_config
        if config is None:
            return None
        if config.disable_by_batch_size is not None:
            return config.disable_by_batch_size
        if config.method == "draft_model" and self.device.type == "cpu":
            return DRAFT_CPU_DISABLE_AT
        return None

    def _load_draft(self) -> CausalLM | None:
        """The draft checkpoint of --speculative-config draft_model (same tokenizer as the
        target), on the target's device and dtype; None without one, or on a prefill engine."""
        config = self.args.speculative_config
        if config is None or config.method != "draft_model":
            return None
        if _prefill_only(self.args.kv_transfer_config):
            return None
        path = config.model
        try:
            draft_config = read_config(path)
        except FileNotFoundError as e:
            raise ValueError(f"--speculative-config model: cannot load the draft: {e}") from e
        target_config = read_config(self.args.model)
        vocab, target_vocab = draft_config.get("vocab_size"), target_config.get("vocab_size")
        if vocab != target_vocab:
            raise ValueError(
                f"--speculative-config model {path!r}: vocab_size {vocab} is not the target's "
                f"{target_vocab} (the draft must share the target's tokenizer)"
            )
        target_eos = _eos_ids(target_config, self.tokenizer, self.args.model)
        draft_eos = _eos_ids(draft_config, self.tokenizer, path)
        if draft_eos != target_eos:
            raise ValueError(
                f"--speculative-config model {path!r}: eos token ids {sorted(draft_eos)} are "
                f"not the target's {sorted(target_eos)} (the draft must share its tokenizer)"
            )
        if draft_config.get("max_position_embeddings", 4096) < self.max_model_len:
            raise ValueError(
                f"--speculative-config model {path!r}: max_position_embeddings "
                f"{draft_config.get('max_position_embeddings')} < max_model_len "
                f"{self.max_model_len}"
            )
        refuse_recurrent_state(model_config(draft_config), path)
        return load_model(
            path, self.dtype, self.device, self.max_model_len, linear_path=self.args.linear_path
        )

    def _draft_pool(self) -> DraftPool | None:
        """The draft's pool as the KV sizing must pay for it, or None."""
        if self.draft_model is None:
            return None
        args = self.args
        k = args.speculative_config.num_speculative_tokens
        return DraftPool(  # the draft's pool keeps the model's dtype (see _draft_proposer)
            kv_bytes_per_block(self.draft_model, args.block_size, self.dtype),
            DraftModelProposer.scratch_blocks(args.max_num_seqs, k, args.block_size),
        )

    def _draft_proposer(self, config: SpeculativeConfig) -> DraftModelProposer:
        """The draft's own pool, with the target's block ids plus scratch blocks, on the
        same device (its memory was set aside when the target's pool was sized)."""
        model = self.draft_model
        num_blocks = self.runner.kv_pool.shape[3]
        scratch = self._draft_pool().scratch_blocks  # as the KV sizing paid for them
        runner = ModelRunner(
            model,
            self.args.block_size,
            num_blocks + scratch,
            self.runner.backend,
            self.device,
            self.dtype,
        )
        logger.info(
            "Draft model: %d layers, KV pool of %d + %d scratch blocks (%.2f GiB, %s)",
            model.config.num_layers,
            num_blocks,
            scratch,
            runner.kv_pool.numel() * runner.kv_pool.element_size() / GiB,
            runner.kv_cache_dtype,
        )
        return DraftModelProposer(runner, num_blocks, config.num_speculative_tokens)

    def _offload_tier(self):
        """The CPU offload tier's host pool (--kv-offloading-size GiB), or None."""
        size = self.args.kv_offloading_size
        if not size:
            return None
        from pagefleet.engine.kv_cache.tier_copier import TierCopier

        pool = self.runner.kv_pool
        per_block = kv_bytes_per_block(self.runner.model, self.args.block_size, pool.dtype)
        refuse_past_host_memory("--kv-offloading-size", size)
        num_slots = int(size * GiB) // per_block
        if num_slots < 1:
            raise ValueError(
                f"--kv-offloading-size {size} GiB holds no KV block ({per_block} bytes each)"
            )
        logger.info(
            "KV offloading (native): %d blocks (%d tokens, %.2f GiB) in host memory%s",
            num_slots,
            num_slots * self.args.block_size,
            num_slots * per_block / GiB,
            " (pinned)" if pool.device.type == "cuda" else "",
        )
        return TierCopier(pool, num_slots)

    def _tier_tick(self) -> None:
        """Requests whose blocks landed from the offload tier join the batch (engine thread,
        before scheduling)."""
        tier = self.scheduler.kv_cache.host_tier
        for load in self.tier_copier.finished():
            self.scheduler.finish_tier_load(load.request_id)
            tier.load_done(load)

    def _tier_copies(self, out) -> None:
        """This step's evicted blocks to the host pool now, then its loads in the background
        (a load may target a block whose old contents a store is saving)."""
        if out.tier_stores:
            self.tier_copier.store(out.tier_stores)
        for load in out.tier_loads:
            self.tier_copier.start_load(load)

    def _kv_connector(self, hf_config: dict, fleet_secret: FleetSecret | None):
        if not self.args.kv_transfer_config:
            return None
        fleet_secret = fleet_secret or load_fleet_secret()
        if fleet_secret is None:
            raise ValueError(
                "--kv-transfer-config needs the fleet secret its peers and router share: "
                "--fleet-secret-file, $PAGEFLEET_FLEET_SECRET_FILE or $PAGEFLEET_FLEET_SECRET"
            )
        import uuid

        from pagefleet.engine.kv_transfer.connector import KVConnector, KVTransferConfig
        from pagefleet.engine.kv_transfer.layout import CompatRecord

        config = KVTransferConfig.parse(
            self.args.kv_transfer_config, hold_timeout=self.args.kv_hold_timeout
        )
        if self.args.simulate is not None:
            raise ValueError("--kv-transfer-config needs real weights (not --simulate)")
        pool = self.runner.kv_pool  # rank 0's shard under tensor parallelism
        tp = self.args.tensor_parallel_size
        compat = CompatRecord.from_pool_shape(
            self.args.served_model_name or hf_config.get("_name_or_path") or self.args.model,
            str(self.dtype).removeprefix("torch."),
            self.runner.kv_cache_dtype,
            pool.shape,
            tensor_parallel_size=tp,
        )
        ranks = self.runner.kv_ranks() if tp > 1 else None
        engine_id = uuid.uuid4().hex[:12]
        connector = KVConnector(config, pool, compat, engine_id, fleet_secret, ranks)
        logger.info(
            "KV transfer: %s %s, engine id %s%s",
            config.kv_connector,
            config.kv_role,
            connector.engine_id,
            f", serving blocks on {config.kv_ip}:{connector.port}" if connector.port else "",
        )
        return connector

    def close(self) -> None:
        """Stop the KV transfer service, the tensor-parallel ranks and their workers (the engine
        is unusable after)."""
        self.grammars.close()
        if self.connector is not None:
            self.connector.close()
        if self.tier_copier is not None:
            self.tier_copier.close()
        self._stop_supervision()
        close_ranks = getattr(self.runner, "close", None)
        if close_ranks is not None:
            close_ranks()

    def _load_model_runner(self) -> tuple[ModelRunner, int]:
        args = self.args
        if args.tensor_parallel_size > 1:
            return self._load_parallel_runner()
        start = time.perf_counter()
        model = load_model(
            args.model,
            self.dtype,
            self.device,
            self.max_model_len,
            quantization=args.quantization,
            lm_head=self.lm_head,
            linear_path=args.linear_path,
        )
        self._log_weights(model, start)
        self.model_config = model.config
        self.lora = setup_lora(args, model, self.dtype, self.device)
        kv_dtype, kv_scales = self._kv_format()
        num_blocks = self._size_kv_pool(model, kv_dtype)
        backend = select_backend(
            args.attention_backend, self.device, model.decode_shape(args.block_size, kv_dtype)
        )
        slots = state_slots_of(args, model)
        runner = ModelRunner(
            model, args.block_size, num_blocks, backend, self.device, kv_dtype, kv_scales, slots
        )
        runner.lora = self.lora
        # A captured decode step would not see the step's adapter slots: LoRA runs eagerly.
        if self.device.type == "cuda" and not args.enforce_eager and self.lora is None:
            runner.capture_decode_graphs(self._max_decode_rows(), self.max_model_len)
        return runner, num_blocks

    def _max_decode_rows(self) -> int:
        """Rows of the largest decode-only step: a verification is 1 + k single rows per
        request, so with speculation the graphs cover verify steps too (larger ones, or ones
        mixed with prefill chunks, run eagerly)."""
        args = self.args
        spec = args.speculative_config
        if spec is None:
            return args.max_num_seqs
        rows = args.max_num_seqs * (1 + spec.num_speculative_tokens)
        return min(rows, args.max_num_batched_tokens)

    def _load_parallel_runner(self) -> tuple[ModelRunner, int]:
        """Start ranks 1..N-1, load rank 0's shard and size the pool with them. No CUDA graphs
        (a captured decode step would have to capture its collectives too)."""
        from pagefleet.engine.distributed import tp_runner
        from pagefleet.engine.distributed.executor import (
            choose_backend,
            make_executor,
            node_device_count,
        )

        args = self.args
        tp_runner.check_tensor_parallel(args, read_config(args.model))
        job = tp_runner.ShardJob(args, self.max_model_len, self.device.type)
        backend = choose_backend(
            args.distributed_executor_backend,
            args.tensor_parallel_size,
            node_device_count(self.device.type),
        )
        executor = make_executor(backend)
        group = None
        try:
            group = tp_runner.start_rank_zero(
                job, executor, executor.master_addr(), on_started=self._supervise
            )
            self.device = group.device
            for place in getattr(executor, "placements", list)():
                logger.info(
                    "tensor-parallel rank %d runs on Ray node %s (%s, pid %d)",
                    *(place.rank, place.node_id, place.node_ip, place.pid),
                )
            start = time.perf_counter()
            model = tp_runner.load_shard(job, group)
            self._log_weights(model, start)
            self.model_config = model.config
            self.lora = setup_lora(args, model, self.dtype, self.device)
            kv_dtype, kv_scales = self._kv_format()
            num_blocks = self._size_kv_pool(model, kv_dtype, group)
            shape = model.decode_shape(args.block_size, kv_dtype)
            backend = select_backend(args.attention_backend, self.device, shape)
            runner = tp_runner.ParallelModelRunner(
                *(model, args.block_size, num_blocks, backend, kv_dtype, group, executor),
                *(kv_scales, state_slots_of(args, model)),
            )
            runner.attach_lora(self.lora)
        except BaseException:
            self._stop_supervision()
            executor.shutdown(timeout_s=0.0)
            if group is not None:
                group.close()
            raise
        return runner, num_blocks

    def _supervise(self, executor) -> None:
        """Watch the worker ranks from the moment they start: one that dies fails the engine
        (health 503, then the process exits non-zero) instead of hanging a collective."""
        from pagefleet.engine.distributed.supervisor import fail_engine, watch

        # A few seconds of 503 before the exit: probes and routers see the engine go first.
        on_failure = functools.partial(
            fail_engine,
            mark_unhealthy=self._mark_failed,
            grace_s=FAILED_RANK_GRACE_S,
            cleanup=executor.shutdown,
        )
        self._supervision = watch(executor, on_failure)
        # A script that ends without closing the engine: at exit, multiprocessing terminates
        # the worker ranks (SIGTERM); the watch must stop first, or that planned end would
        # read as a failure (and delay the exit). Registered after multiprocessing's own
        # handler, so it runs before it.
        atexit.register(self._stop_supervision)

    def _mark_failed(self, reason: str) -> None:
        self.failure = reason

    def _stop_supervision(self) -> None:
        """Before a planned stop, so ranks leaving on purpose are not taken for a failure."""
        if self._supervision is not None:
            atexit.unregister(self._stop_supervision)
            self._supervision.stop()
            self._supervision = None

    def _kv_format(self) -> tuple[torch.dtype, list[tuple[float, float]] | None]:
        """The pool's dtype, and an fp8 pool's per-layer scales (logged: they change values)."""
        kv_dtype, scales = kv_cache_format(
            self.args.kv_cache_dtype, self.dtype, self.device, self.args.model
        )
        if scales is not None:
            calibrated = sum(s != (1.0, 1.0) for s in scales)
            logger.info(
                "KV cache dtype fp8 (e4m3): %d of %d layers have calibrated k/v scales from "
                "the checkpoint, the others 1.0",
                calibrated,
                len(scales),
            )
        return kv_dtype, scales

    def _log_weights(self, model, start: float) -> None:
        weight_bytes = model_weight_bytes(model)
        tp = self.args.tensor_parallel_size
        logger.info(
            "Loading weights took %.2f s; model weights take %.2f GiB (%s)%s",
            time.perf_counter() - start,
            weight_bytes / GiB,
            model.weights_format,
            f" per rank (tensor-parallel size {tp})" if tp > 1 else "",
        )

    @staticmethod
    def _sliding_window(hf_config: dict) -> int | None:
        window = hf_config.get("sliding_window")
        if not window:
            return None
        if "use_sliding_window" in hf_config and not hf_config["use_sliding_window"]:
            return None  # Qwen2/Qwen3 carry a window they do not use
        return int(window)

    def _size_kv_pool(self, model, kv_dtype: torch.dtype, group=None) -> int:
        args = self.args
        num_blocks = kv_pool_blocks(
            args, model, kv_dtype, self.device, self.max_model_len, group, self._draft_pool()
        )
        per_block = kv_bytes_per_block(model, args.block_size, kv_dtype)
        plan = kv_pool_plan_of(args, model, kv_dtype, num_blocks * per_block)
        self._log_kv_size(plan.kv_blocks, plan, model.num_kv_heads)
        check_holds_one(plan, self.max_model_len, self.device)
        return num_blocks

    def _log_kv_size(
        self, num_blocks: int, plan: CapacityPlan | None, kv_heads: int | None = None
    ) -> None:
        """The pool's figures at startup (`plan` None: a simulated engine, no bytes)."""
        tokens = num_blocks * self.args.block_size
        tp = self.args.tensor_parallel_size
        per_rank = " per rank" if tp > 1 else ""
        size = ""
        if plan is not None:
            size = f", {plan.kv_bytes / GiB:.2f} GiB{per_rank}"
            logger.info(
                "KV cache: %d bytes per token, %d per block%s (%s)",
                plan.bytes_per_token,
                plan.bytes_per_block,
                per_rank,
                plan.kv_format,
            )
        if tp > 1 and kv_heads is not None:
            size += f", {kv_heads} KV heads per rank, tensor-parallel size {tp}"
        logger.info("KV cache size: %d tokens (%d blocks%s)", tokens, num_blocks, size)
        logger.info(
            "Maximum concurrency for %d tokens per request: %.2fx",
            self.max_model_len,
            tokens / self.max_model_len,
        )

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request (text or token ids), for the base model or `lora_request`'s
        adapter; returns its id. Raises ValueError if it cannot run (the scheduler's rules,
        see validation.py; a duplicate id; kv_transfer_params this engine cannot act on; an
        adapter this engine cannot load)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups or request_id in self._group_of:
            raise ValueError(f"duplicate request id {request_id!r}")
        lora = serving_lora(self.lora).resolve(lora_request) if lora_request is not None else None
        hold, source = self._kv_transfer_role(params, lora)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        arrival = arrival_time or time.time()
        group = _Group(
            request_id, text, token_ids, params, arrival, metrics=RequestMetrics(arrival)
        )
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(token_ids)
        for i in range(params.n):
            seq_params = params
            if params.n > 1 and params.seed is not None:
                seq_params = dataclasses.replace(params, seed=params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            if rid in self._group_of:
                raise ValueError(f"duplicate request id {rid!r}")
            req = Request(
                rid,
                token_ids,
                seq_params,
                eos_token_id=self.eos_token_ids,
                block_size=self.args.block_size,
                arrival_time=group.arrival_time,
                lora_request=lora,
            )
            req.hold_blocks, req.remote_source = hold, source
            detok = Detokenizer(
                self.tokenizer,
                token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            seq = _Sequence(
                i,
                req,
                detok,
                [] if params.logprobs is not None else None,
                0.0 if params.logprobs is not None else None,
            )
            group.sequences.append(seq)
        # Validates the request (its siblings share its prompt and parameters); a grammar
        # raises GrammarError (a ValueError) if it cannot compile.
        first = group.sequences[0].request
        constraint = params.structured_outputs
        if constraint is None:
            self.scheduler.add_request(first)
        else:
            self.scheduler.check_request(first)
            requests = [seq.request for seq in group.sequences]
            if self.grammars.admit(request_id, constraint, requests):
                self.scheduler.add_request(first)
        group.pending = group.sequences[1:]
        self.groups[request_id] = group
        for seq in group.sequences:
            self._group_of[seq.request.request_id] = request_id
        return request_id

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Make an adapter nameable by requests (vLLM's add_lora); ValueError if it cannot
        run here (engine thread)."""
        r = lora_request
        return serving_lora(self.lora).register(r.lora_name, r.lora_path, r.base_model_name)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter no request runs with (engine thread; lora.manager.remove_adapter)."""
        requests = (s.request for g in self.groups.values() for s in g.sequences)
        remove_adapter(self.lora, self.scheduler.kv_cache, requests, name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.lora.adapters.values()) if self.lora is not None else []

    def _admit_compiled(self) -> None:
        """Queue the groups whose grammar is now ready; fail the ones whose compile failed."""
        ready, failed = self.grammars.take_ready()
        for request_id in ready:
            self.scheduler.add_request(self.groups[request_id].sequences[0].request)
        for request_id, error in failed:
            self.abort_request(request_id)
            self._failures.append((request_id, error))

    def take_failures(self) -> list[tuple[str, Exception]]:
        """Requests that failed after add_request accepted them (a grammar that failed to
        compile): (request id, error), each reported once."""
        failures, self._failures = self._failures, []
        return failures

    def _advance_grammar(self, seq: _Sequence, start: int) -> None:
        ended = advance_grammar(seq.request, start)
        if ended is not None:
            self.scheduler.finish(seq.request, ended)
            if ended is RequestStatus.FINISHED_STOPPED and seq.detok:
                seq.detok.flush()

    def _kv_transfer_role(self, params: SamplingParams, lora: LoRARequest | None = None):
        """(hold blocks when done?, remote source to pull from) for this request."""
        kv = params.kv_transfer_params
        if not kv or not (kv.get("do_remote_decode") or kv.get("do_remote_prefill")):
            return False, None
        config = self.connector.config if self.connector is not None else None
        if params.n != 1:
            raise ValueError("kv_transfer_params needs n=1")
        if kv.get("do_remote_decode"):
            if config is None or not config.produces:
                raise ValueError(
                    "do_remote_decode: this engine is not a KV producer (--kv-transfer-config "
                    'with "kv_role": "kv_producer" or "kv_both")'
                )
            return True, None
        if config is None or not config.consumes:
            raise ValueError(
                "do_remote_prefill: this engine is not a KV consumer (--kv-transfer-config "
                'with "kv_role": "kv_consumer" or "kv_both")'
            )
        from pagefleet.engine.kv_transfer.connector import RemoteSource

        return False, RemoteSource.from_params(kv).checked_for(lora)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.grammars.discard(request_id)
        group.pending = []
        group.metrics.finished_time = time.time()
        for seq in group.sequences:
            if not seq.request.status.finished:
                self.scheduler.finish(seq.request, RequestStatus.FINISHED_ABORTED)
        self._forget(group)
        return self._output(group)

    def _forget(self, group: _Group) -> None:
        self.groups.pop(group.request_id, None)
        for seq in group.sequences:
            self._group_of.pop(seq.request.request_id, None)
            self.sampler.forget(seq.request.request_id)

    def has_unfinished_requests(self) -> bool:
        sched = self.scheduler
        return bool(self.groups) or bool(sched.loading) or bool(sched.tier_loading)

    @property
    def holds_blocks(self) -> bool:
        """Blocks held for decode engines: the loop must keep ticking to release them."""
        return bool(self.scheduler.held)

    def _kv_transfer_tick(self) -> list[RequestOutput]:
        """Apply finished pulls and due releases (engine thread, before scheduling); returns
        the outputs of requests it aborted."""
        connector, sched = self.connector, self.scheduler
        connector.drive_ranks()
        aborted = []
        for result in connector.finished_loads():
            if result.quarantined:  # NIXL may still write its blocks: never reuse them
                sched.quarantine_remote_load(result.request_id)
                output = self.abort_request(self._group_of.get(result.request_id, ""))
                aborted += [output] if output is not None else []
            req = sched.finish_remote_load(result.request_id, result.ok)
            stats = connector.stats
            stats.transfers += 1
            stats.bytes += result.num_bytes
            for observer in self.observers:
                observer.on_kv_transfer(result.seconds, result.path if result.ok else None)
            if not result.ok:
                stats.failures += 1
                if req is not None and not req.status.finished:
                    stats.fallbacks += 1
        for request_id in connector.due_releases(time.monotonic()):
            sched.release_held(request_id)
        return aborted

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns the outputs of the requests it advanced."""
        aborted = self._kv_transfer_tick() if self.connector is not None else []
        if aborted:
            return aborted
        if self.tier_copier is not None:
            self._tier_tick()
        if self.grammars.waiting:
            self._admit_compiled()
        out = self.scheduler.schedule()
        if self.tier_copier is not None:
            self._tier_copies(out)
        for req in out.kv_loads:
            first = req.num_cached_blocks  # blocks found in our own prefix cache stay
            blocks = req.transfer_block_ids  # the prompt's (and a hybrid's state's)
            self.connector.start_load(req.request_id, req.remote_source, blocks, first)
        if not out.scheduled:
            if self.scheduler.loading:  # only transfers in flight: wait for one, don't spin
                self.connector.wait_for_results(0.005)
            if self.scheduler.tier_loading:
                self.tier_copier.wait(0.005)
            if self.grammars.waiting:  # only grammars compiling: wait for one, don't spin
                self.grammars.wait(0.005)
            return []
        now = time.time()
        num_prompt = 0
        for req, n in out.scheduled:
            group = self.groups.get(self._group_of.get(req.request_id, ""))
            if group is not None and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            if req.num_computed_tokens < req.num_prompt_tokens:
                num_prompt += min(n, req.num_prompt_tokens - req.num_computed_tokens)
        # Sampled rows come back in batch order, as update_from_output takes them.
        logits, sample_reqs, prompt_logprobs = self.runner.execute(out)
        step = self._sample(out, logits, sample_reqs)
        starts = [req.num_tokens for req in step.requests]
        self.scheduler.update_from_output(out, _scheduler_tokens(out, step))
        touched: dict[str, _Group] = {}
        for rid, (start, entries) in prompt_logprobs.items():
            group = self.groups[self._group_of[rid]]
            group.prompt_logprobs[start + 1 : start + 1 + len(entries)] = entries
        num_generated = 0
        for req, tokens, logprobs, start in zip(
            step.requests, step.token_ids, step.logprobs, starts, strict=True
        ):
            group = self.groups.get(self._group_of.get(req.request_id, ""))
            if group is None:
                continue
            num_generated += self._record_tokens(group, req, tokens, logprobs, start)
            if req.grammar is not None and not req.status.finished:
                self._advance_grammar(next(s for s in group.sequences if s.request is req), start)
            if req.hold_blocks and req.request_id in self.scheduler.held:
                group.kv_transfer_params = self.connector.hold(
                    req.request_id, req.transfer_block_ids, time.monotonic(), req.lora_name
                )
            touched[group.request_id] = group
        now = time.time()
        outputs = []
        for group in touched.values():
            metrics = group.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if group.finished:
                metrics.finished_time = now
            self._admit_siblings(group)
            outputs.append(self._output(group))
            if group.finished:
                self._forget(group)
        if self.proposer is not None:
            running = RequestStatus.RUNNING
            limit = self.spec_disable_at
            enabled = limit is None or len(self.scheduler.running) < limit
            propose(self.proposer, [r for r in step.requests if r.status is running], enabled)
            trim_drafts(step.requests)
        stats = StepStats(num_prompt, num_generated, len(out.preempted))
        for observer in self.observers:
            observer.on_step(stats)
        return outputs

    def _sample(self, out, logits: torch.Tensor, sample_reqs: list[Request]) -> StepTokens:
        """Each sampled request's new tokens: one, or a verification's (spec_decode/).
        Grammar masks and logit_bias apply first, so every sampling path sees them."""
        logits = constrain_logits(logits, sample_reqs, out.spec_token_ids)
        if out.spec_token_ids:
            return sample_with_drafts(
                self.sampler, logits, sample_reqs, out.spec_token_ids, self.spec_counters
            )
        sampled = self.sampler.sample(logits, sample_reqs)
        return StepTokens(
            sample_reqs, [[t] for t in sampled.token_ids], [[lp] for lp in sampled.logprobs]
        )

    def _record_tokens(
        self, group: _Group, req: Request, tokens: list[int], logprobs: list, start: int
    ) -> int:
        """Record the tokens the scheduler appended after `start` (a stop token or max_len may
        have cut `tokens`); a stop string inside them ends the request there and drops the
        rest. Returns how many tokens the request kept."""
        num_appended = req.num_tokens - start
        for j in range(num_appended):
            final = j == num_appended - 1
            if self._record_token(group, req, tokens[j], logprobs[j], final) and not final:
                del req.all_token_ids[start + j + 1 :]
                return j + 1
        return num_appended

    def _record_token(
        self, group: _Group, req: Request, token: int, logprobs, final: bool = True
    ) -> bool:
        """Record one new token (`final`: the last the step appended, the one the request's
        status speaks of); True if a stop string ended the request on it."""
        seq = next(s for s in group.sequences if s.request is req)
        if group.num_cached_tokens is None:
            group.num_cached_tokens = req.num_cached_tokens
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        params = req.sampling_params
        stopped_by_token = final and req.status is RequestStatus.FINISHED_STOPPED
        # Like vLLM: a stop token's text is left out unless asked for, and stop strings only
        # count once min_tokens are out.
        stop_str = None
        if seq.detok and not (stopped_by_token and not params.include_stop_str_in_output):
            may_stop = req.num_output_tokens >= params.min_tokens
            stop_str = seq.detok.add_token(token, check_stop=may_stop)
        if stop_str is not None:
            # "stop" also when max_tokens ended it in the same step.
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            seq.stop_reason = stop_str
            return True
        if final and req.status.finished:
            if stopped_by_token and seq.stop_reason is None:
                seq.stop_reason = token if token in params.stop_token_ids else None
            if seq.detok:
                seq.detok.flush()
        return False

    def _admit_siblings(self, group: _Group) -> None:
        """Admit the other n-1 samples once the first has its prompt's blocks cached."""
        if group.pending:
            for seq in group.pending:
                self.scheduler.add_request(seq.request)
            group.pending = []

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for seq in group.sequences:
            req = seq.request
            text = seq.detok.stream_text(req.status.finished) if seq.detok else ""
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=req.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=req.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            prompt_logprobs=group.prompt_logprobs,
            finished=group.finished,
            num_cached_tokens=group.num_cached_tokens or 0,
            metrics=dataclasses.replace(group.metrics),
            kv_transfer_params=group.kv_transfer_params,
        )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _prefill_only(kv_transfer_config: str | None) -> bool:
    """Whether --kv-transfer-config makes this a prefill engine (it computes prompts and one
    token each for decode engines: nothing to speculate on)."""
    if not kv_transfer_config:
        return False
    from pagefleet.engine.kv_transfer.connector import KVTransferConfig

    return KVTransferConfig.parse(kv_transfer_config).kv_role == "kv_producer"


def _eos_ids(hf_config: dict, tokenizer, model_path: str) -> frozenset[int]:
    """EOS ids from config.json, generation_config.json (instruct models often list their
    end-of-turn token only there) and the tokenizer."""
    ids: set[int] = set()
    gen_file = Path(model_path) / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    for eos in (hf_config.get("eos_token_id"), gen.get("eos_token_id")):
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _scheduler_tokens(out, step: StepTokens) -> list:
    """The step's tokens as update_from_output takes them: one per sampled request, a list for
    a request that verified drafts (a plain step skips the per-request look-up)."""
    spec = out.spec_token_ids
    if not spec:
        return [tokens[0] for tokens in step.token_ids]
    return [
        tokens if req.request_id in spec else tokens[0]
        for req, tokens in zip(step.requests, step.token_ids, strict=True)
    ]
