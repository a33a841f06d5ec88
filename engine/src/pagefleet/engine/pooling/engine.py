"""The pooling engine: `LLMEngine`'s set-up (model, KV pool, scheduler, metrics), a loop of its own.

Each request is prefill-only: the scheduler batches prompts by the token budget and chunks
long ones as for generation, and finishes a request once its prompt is computed; the runner's
final hidden states go to the pooler (pooler.py) instead of an LM head and a sampler. A
request's one output carries its vector. Features that only make sense for generated tokens
(speculative decoding, P/D transfer, the offload tier, tensor parallelism for now) are refused
at start-up, naming the flag.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from pagefleet.common.fleet_auth import FleetSecret
from pagefleet.common.kv_events import KVEventListener
from pagefleet.engine.client import StepStats
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.llm_engine import LLMEngine
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.model.checkpoint import read_config
from pagefleet.engine.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from pagefleet.engine.pooling.config import PoolingModel, resolve_pooling
from pagefleet.engine.pooling.params import PoolingParams
from pagefleet.engine.pooling.pooler import PoolState, Segment, finish_vectors, pool_step
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.sampling_params import SamplingParams

logger = logging.getLogger("pagefleet.engine")
# What a pooled request carries for the scheduler's generic checks: it never samples.
_NO_SAMPLING = SamplingParams(max_tokens=1)


@dataclass
class _Pooled:
    request: Request
    state: PoolState
    dimensions: int | None
    metrics: RequestMetrics


class PoolingEngine(LLMEngine):
    lm_head = False

    def __init__(
        self,
        args: EngineArgs,
        kv_event_listener: KVEventListener | None = None,
        fleet_secret: FleetSecret | None = None,
    ):
        self.pooling = resolve_pooling(args.model, read_config(args.model), args.pooler_config)
        super().__init__(pooling_args(args, self.pooling), kv_event_listener, fleet_secret)
        self.limits = dataclasses.replace(self.limits, pooling=self.pooling)
        self._pooled: dict[str, _Pooled] = {}
        pooler = self.pooling.pooler
        logger.info(
            "Pooling runner: %s pooling%s, %d-dimensional vectors",
            pooler.pooling_type,
            ", normalised" if pooler.normalize else "",
            self.pooling.hidden_size,
        )

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a prompt (text or token ids) to pool; returns its id. Raises ValueError if it
        cannot run (validation.check_prefill_only, dimensions the model cannot give, a LoRA
        adapter: they run with the generate runner only)."""
        if lora_request is not None:
            raise ValueError("LoRA adapters run with the generate runner only, not pooling")
        if not isinstance(params, PoolingParams):
            raise ValueError(
                "this engine runs the pooling runner (--runner pooling): it computes embeddings, "
                "it does not generate"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._pooled:
            raise ValueError(f"duplicate request id {request_id!r}")
        if params.dimensions is not None:
            self.pooling.check_dimensions(params.dimensions)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        token_ids = params.truncate(token_ids, self.max_model_len)
        arrival = arrival_time or time.time()
        req = Request(
            request_id,
            token_ids,
            _NO_SAMPLING,
            block_size=self.args.block_size,
            arrival_time=arrival,
            prefill_only=True,
        )
        self.scheduler.add_request(req)  # validates it
        dims = params.dimensions or self.pooling.pooler.dimensions
        self._pooled[request_id] = _Pooled(
            req, PoolState(len(token_ids)), dims, RequestMetrics(arrival)
        )
        return request_id

    def abort_request(self, request_id: str) -> PoolingRequestOutput | None:
        pooled = self._pooled.pop(request_id, None)
        if pooled is None:
            return None
        self.scheduler.finish(pooled.request, RequestStatus.FINISHED_ABORTED)
        pooled.metrics.finished_time = time.time()
        return _output(pooled, None, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._pooled)

    def step(self) -> list[PoolingRequestOutput]:
        """One forward pass over the scheduled prompt chunks; the outputs of the requests
        whose prompt it finished."""
        out = self.scheduler.schedule()
        for req in out.preempted:  # recomputed from the start: what it pooled is void
            self._pooled[req.request_id].state.restart()
        if not out.scheduled:
            return []
        now = time.time()
        inputs = self.runner.prepare(out)
        hidden = self.runner.hidden_states(inputs)
        segments = []
        for (req, n), row in zip(out.scheduled, inputs.first_rows, strict=True):
            pooled = self._pooled[req.request_id]
            if pooled.metrics.first_scheduled_time is None:
                pooled.metrics.first_scheduled_time = now
            segments.append(Segment(pooled.state, row, n, req.num_computed_tokens))
        vectors = pool_step(self.pooling.pooler, hidden, segments)
        self.scheduler.update_from_output(out, [])
        done = [
            (self._pooled.pop(req.request_id), vector)
            for (req, _), vector in zip(out.scheduled, vectors, strict=True)
            if vector is not None
        ]
        outputs = self._finish(done)
        stats = StepStats(sum(n for _, n in out.scheduled), 0, len(out.preempted))
        for observer in self.observers:
            observer.on_step(stats)
        return outputs

    def _finish(self, done: list[tuple[_Pooled, object]]) -> list[PoolingRequestOutput]:
        finished = finish_vectors(
            [vector for _, vector in done],
            [pooled.dimensions for pooled, _ in done],
            self.pooling.pooler.normalize,
        )
        now = time.time()
        outputs = []
        for (pooled, _), vector in zip(done, finished, strict=True):
            pooled.metrics.first_token_time = pooled.metrics.finished_time = now
            outputs.append(_output(pooled, vector, "stop"))
        return outputs


def _output(pooled: _Pooled, vector, reason: str) -> PoolingRequestOutput:
    req = pooled.request
    return PoolingRequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        outputs=PoolingOutput(vector),
        finish_reason=reason,
        metrics=dataclasses.replace(pooled.metrics),
    )


def pooling_args(args: EngineArgs, pooling: PoolingModel) -> EngineArgs:
    """The engine args a pooling engine runs with: what it cannot do refused by flag; prefix
    caching off for MEAN and CLS (as vLLM: a cache hit skips rows they pool); no CUDA graphs
    (they serve decode steps, and it decodes nothing); max_model_len capped by the
    sentence-transformers max_seq_length when not given."""
    refused = (
        (args.tensor_parallel_size > 1, "--tensor-parallel-size > 1"),
        (args.speculative_config is not None, "--speculative-config"),
        (bool(args.kv_transfer_config), "--kv-transfer-config (P/D: nothing to decode)"),
        (bool(args.kv_offloading_size), "--kv-offloading-size"),
        (args.simulate is not None, "--simulate"),
    )
    for bad, flag in refused:
        if bad:
            raise ValueError(f"the pooling runner does not run with {flag} yet")
    changes: dict = {"enforce_eager": True}
    if pooling.pooler.uses_every_row and args.enable_prefix_caching:
        logger.info(
            "Prefix caching off: %s pooling reads every prompt row, and a cache hit would skip "
            "some (vLLM likewise caches prefixes for LAST pooling only)",
            pooling.pooler.pooling_type,
        )
        changes["enable_prefix_caching"] = False
    if args.max_model_len is None and pooling.max_seq_length is not None:
        limit = read_config(args.model).get("max_position_embeddings", pooling.max_seq_length)
        changes["max_model_len"] = min(pooling.max_seq_length, limit)
    return dataclasses.replace(args, **changes)
