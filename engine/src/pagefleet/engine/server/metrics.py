"""Prometheus metrics under vLLM's names and units, label `model_name`, one registry per app.

Gauges and cumulative counters are read from the engine when scraped (a collector); latency
histograms are observed as request outputs arrive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagefleet.engine.client import (
    EngineClient,
    EngineObserver,
    KVOffloadStats,
    LoRAStats,
    StepStats,
)
from pagefleet.engine.model.expert_load import ExpertLoadStats
from pagefleet.engine.outputs import PoolingRequestOutput, RequestOutput
from pagefleet.engine.server.protocol import KNOWN_IGNORED_FIELDS
from pagefleet.engine.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger("pagefleet.server")
IGNORED_FIELDS_LOG_INTERVAL_S = 10.0

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector:
    """Reads the engine's stats snapshot at scrape time."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        limits = self.engine.limits
        name = [self.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        yield gauge(
            "vllm:num_requests_running", "Requests in the running batch.", stats.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks (and a hybrid model's state slots) held by live requests "
            "(1 = full).",
            stats.kv_cache_usage,
        )
        yield gauge(
            "pagefleet:kv_cache_cached_free_blocks",
            "Free KV blocks that still hold reusable prefixes.",
            stats.num_cached_free_blocks,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            labels=[
                "model_name",
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "cache_dtype",
            ],
        )
        info.add_metric(
            [
                self.model_name,
                str(limits.block_size),
                str(limits.num_gpu_blocks),
                str(limits.enable_prefix_caching),
                limits.kv_cache_dtype,
            ],
            1.0,
        )
        yield info
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits,
        )
        yield counter("vllm:num_preemptions", "Preemptions by recompute.", stats.num_preemptions)
        yield gauge(
            "pagefleet:kv_transfer_held_blocks",
            "KV blocks a prefill engine holds for decode engines to read.",
            stats.num_held_blocks,
        )
        transfer = stats.kv_transfer
        if transfer is not None:
            for metric, doc, value in (
                ("bytes", "KV bytes pulled from prefill engines.", transfer.bytes),
                ("transfers", "KV pulls finished (either way).", transfer.transfers),
                ("failures", "KV pulls that failed.", transfer.failures),
                (
                    "fallbacks",
                    "Requests that computed their prompt after a failed pull.",
                    transfer.fallbacks,
                ),
            ):
                yield counter(f"pagefleet:kv_transfer_{metric}", doc, value)
        if stats.kv_offload is not None:
            yield from _offload_metrics(stats.kv_offload, gauge, counter)
        if stats.spec_decode is not None:
            yield from _spec_decode_metrics(stats.spec_decode, counter, name)
        if stats.lora is not None:
            yield from _lora_metrics(stats.lora, counter)
        if stats.expert_load is not None:
            yield from _expert_load_metrics(stats.expert_load, name)


# Adapters named in one label of vllm:lora_requests_info at most (running ones are at most
# --max-loras anyway; waiting ones could be every adapter loaded).
MAX_LISTED_ADAPTERS = 64


def _lora_metrics(lora: LoRAStats, counter: Callable):
    """vLLM's vllm:lora_requests_info, as it exports it (labels max_lora, waiting and running
    adapters, comma-joined; the value the time of the scrape, which readers of vLLM's use to
    pick its newest series) but always one series: vLLM leaves a series behind for every
    combination it ever reported. Then pagefleet's adapter-load counters."""
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on LoRA requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    info.add_metric(
        [
            str(lora.max_loras),
            ",".join(lora.waiting[:MAX_LISTED_ADAPTERS]),
            ",".join(lora.running[:MAX_LISTED_ADAPTERS]),
        ],
        time.time(),
    )
    yield info
    yield counter(
        "pagefleet:lora_adapter_loads",
        "LoRA adapters installed into a resident slot (each one a slot miss).",
        lora.slot_loads,
    )
    yield counter(
        "pagefleet:lora_adapter_disk_loads",
        "LoRA adapters read from disk into the host-memory cache.",
        lora.disk_loads,
    )


def _expert_load_metrics(load: ExpertLoadStats, name: list[str]):
    """A mixture-of-experts model's routing, one series per sparse layer (bounded by the
    model's depth, not by its experts): assignments routed, and the busiest expert's against
    the mean expert's; under expert parallelism the same for ranks (the step waits for the
    busiest rank)."""
    families = {
        "routed": CounterMetricFamily(
            "pagefleet:moe_routed_tokens",
            "Tokens routed to experts, counted once per expert each goes to (tokens x "
            "num_experts_per_tok), by sparse layer.",
            labels=["model_name", "layer"],
        ),
        "max_expert": GaugeMetricFamily(
            "pagefleet:moe_expert_load_max",
            "Tokens the busiest expert of the layer was routed since start.",
            labels=["model_name", "layer"],
        ),
        "mean_expert": GaugeMetricFamily(
            "pagefleet:moe_expert_load_mean",
            "Tokens an expert of the layer was routed since start, on average (max / mean is "
            "the layer's imbalance).",
            labels=["model_name", "layer"],
        ),
        "max_rank": GaugeMetricFamily(
            "pagefleet:moe_rank_load_max",
            "Expert parallelism: tokens routed to the experts of the busiest rank since start.",
            labels=["model_name", "layer"],
        ),
        "mean_rank": GaugeMetricFamily(
            "pagefleet:moe_rank_load_mean",
            "Expert parallelism: tokens routed to a rank's experts since start, on average.",
            labels=["model_name", "layer"],
        ),
    }
    for layer in load.layers:
        for field, family in families.items():
            value = getattr(layer, field)
            if value is not None:
                family.add_metric([*name, str(layer.layer)], value)
    for family in families.values():
        if family.samples:
            yield family


def _spec_decode_metrics(spec: SpecDecodeStats, counter: Callable, name: list[str]):
    """Speculative decoding's acceptance counters, by vLLM's names."""
    for metric, doc, value in (
        ("num_drafts", "Verifications of drafts (one per request and step).", spec.num_drafts),
        ("num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
    ):
        yield counter(f"vllm:spec_decode_{metric}", doc, value)
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([*name, str(pos)], value)
    yield per_pos


def _offload_metrics(tier: KVOffloadStats, gauge: Callable, counter: Callable):
    """The CPU offload tier: vLLM's external prefix-cache counters (tokens found outside the
    device pool), and pagefleet:kv_offload_* for its blocks and bytes."""
    tokens = tier.block_size
    yield counter(
        "vllm:external_prefix_cache_queries",
        "Prompt tokens looked up in the CPU offload tier after a device-pool miss.",
        tier.queried_blocks * tokens,
    )
    yield counter(
        "vllm:external_prefix_cache_hits",
        "Prompt tokens found in the CPU offload tier (loaded back, not recomputed).",
        tier.hit_blocks * tokens,
    )
    yield gauge(
        "pagefleet:kv_offload_blocks", "Blocks held in the CPU offload tier.", tier.held_blocks
    )
    for metric, doc, value in (
        ("hit_blocks", "Blocks found in the tier after a device-pool miss.", tier.hit_blocks),
        ("loaded_blocks", "Blocks copied from the tier to the device pool.", tier.loaded_blocks),
        ("stored_blocks", "Blocks copied from the device pool to the tier.", tier.stored_blocks),
        ("evicted_blocks", "Blocks dropped from the tier to make room.", tier.evicted_blocks),
        ("loads", "Requests whose prefix was loaded back from the tier.", tier.loads),
        ("bytes", "Bytes copied between the device pool and the tier, both ways.", tier.bytes),
    ):
        yield counter(f"pagefleet:kv_offload_{metric}", doc, value)


class EngineMetrics(EngineObserver):
    """The server's metrics registry; subscribed to the engine's steps, pulls and stalls."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        # process_start_time_seconds tells the router a pod restarted (its cache is empty).
        ProcessCollector(registry=reg)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Request latency, end to end.", _LATENCY_BUCKETS
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Time waiting before scheduling.", _LATENCY_BUCKETS
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "Time in prefill.", _LATENCY_BUCKETS
        )
        self.decode = hist("vllm:request_decode_time_seconds", "Time in decode.", _LATENCY_BUCKETS)
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Tokens per engine step.", _TOKEN_BUCKETS
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens computed.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.stall_aborts = Counter(
            "pagefleet:client_stall_aborts",
            "Requests aborted because their client left output unread too long.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.transfer_seconds = hist(
            "pagefleet:kv_transfer_duration_seconds",
            "Time to pull one request's KV blocks (handshake, transfer, release).",
            _ITL_BUCKETS,
        )
        self.transfer_pulls = Counter(
            "pagefleet:kv_transfer_pulls",
            "KV pulls that succeeded, by the data path that moved the blocks (nixl, tcp).",
            ["model_name", "path"],
            registry=reg,
        )
        for path in ("nixl", "tcp"):
            self.transfer_pulls.labels(model_name, path)
        self.ignored_fields = Counter(
            "pagefleet:ignored_request_fields",
            "Request fields the server neither implements nor refuses (names outside a small "
            'fixed set count as "other").',
            ["model_name", "field"],
            registry=reg,
        )
        self._warned_ignored_at = -IGNORED_FIELDS_LOG_INTERVAL_S
        reg.register(_EngineCollector(engine, model_name))
        engine.subscribe(self)
        # For the periodic log line.
        self._logged_at = time.monotonic()
        self._logged_prompt = self._logged_generation = 0.0
        self._prompt_total = self._generation_total = 0.0
        self.engine = engine

    def on_kv_transfer(self, seconds: float, path: str | None) -> None:
        self.transfer_seconds.observe(seconds)
        if path is not None:
            self.transfer_pulls.labels(self.model_name, path).inc()

    def count_ignored(self, fields: list[str]) -> None:
        """Count a request's ignored fields; a warning line at most every few seconds (a
        client cannot flood the log), naming a few of them, cut short."""
        for name in fields:
            label = name if name in KNOWN_IGNORED_FIELDS else "other"
            self.ignored_fields.labels(self.model_name, label).inc()
        now = time.monotonic()
        if now - self._warned_ignored_at >= IGNORED_FIELDS_LOG_INTERVAL_S:
            self._warned_ignored_at = now
            shown = ", ".join(repr(name[:40]) for name in fields[:5])
            logger.warning("request fields ignored (not implemented, not refused): %s", shown)

    def on_stall_abort(self) -> None:
        self.stall_aborts.inc()

    def on_step(self, stats: StepStats) -> None:
        self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self._prompt_total += stats.num_prompt_tokens
        self._generation_total += stats.num_generation_tokens

    def observe(self, previous: RequestOutput | None, output: RequestOutput) -> None:
        """Latency metrics from successive outputs of one request."""
        m = output.metrics
        if m is None:
            return
        had = sum(len(c.token_ids) for c in previous.outputs) if previous else 0
        has = sum(len(c.token_ids) for c in output.outputs)
        if had == 0 and has > 0 and m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        elif has > had and previous is not None and previous.metrics.last_token_time:
            gap = (m.last_token_time - previous.metrics.last_token_time) / max(has - had, 1)
            for _ in range(has - had):
                self.itl.observe(gap)
        if output.finished:
            end = m.finished_time or time.time()
            self.e2e.observe(end - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
                if m.first_token_time is not None:
                    self.prefill.observe(m.first_token_time - m.first_scheduled_time)
                    self.decode.observe(end - m.first_token_time)
            for c in output.outputs:
                self.success.labels(self.model_name, c.finish_reason or "abort").inc()

    def observe_pooled(self, output: PoolingRequestOutput) -> None:
        """A pooling request's end: its latency end to end, queued and computing its prompt
        (vLLM's prefill time), and its finish reason."""
        m = output.metrics
        end = m.finished_time or time.time()
        self.e2e.observe(end - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.prefill.observe(end - m.first_scheduled_time)
        self.success.labels(self.model_name, output.finish_reason).inc()

    def count_abort(self, n: int) -> None:
        """A request that ended without finishing (the client left)."""
        self.success.labels(self.model_name, "abort").inc(n)

    def log_line(self) -> str:
        now = time.monotonic()
        span = max(now - self._logged_at, 1e-9)
        prompt_rate = (self._prompt_total - self._logged_prompt) / span
        gen_rate = (self._generation_total - self._logged_generation) / span
        self._logged_at, self._logged_prompt = now, self._prompt_total
        self._logged_generation = self._generation_total
        stats = self.engine.stats()
        queries = stats.prefix_cache_queries
        hit = stats.prefix_cache_hits / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation throughput: "
            f"{gen_rate:.1f} tokens/s, Running: {stats.num_running} reqs, Waiting: "
            f"{stats.num_waiting} reqs, KV cache usage: {stats.kv_cache_usage:.1%}, "
            f"Prefix cache hit rate: {hit:.1%}{_spec_decode_line(stats.spec_decode)}"
        )


def _spec_decode_line(spec: SpecDecodeStats | None) -> str:
    if spec is None:
        return ""
    return (
        f", Spec decode acceptance rate: {spec.acceptance_rate:.1%}, "
        f"Mean accepted length: {spec.mean_accepted_length:.2f}"
    )
