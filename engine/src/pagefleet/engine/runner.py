"""Model runner: turns a scheduler step into tensors, runs the forward pass over the paged
KV pool, and returns the logits rows to sample from.

The KV pool is one tensor [layers, 2, kv_heads, num_blocks, block_size, head_dim], so it can
be registered for transfer as a single memory region (layout: see attention/torch_ref.py).
Under tensor parallelism each rank's pool holds its own KV heads of the same blocks. A hybrid
model's linear-attention layers keep their per-sequence state in a state pool beside it
(linear_attn/state.py), moved around each forward pass as the KV manager decided.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagefleet.common import capacity
from pagefleet.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKV,
    PrefillChunk,
    single_groups,
)
from pagefleet.engine.cuda_graph import DecodeGraphs
from pagefleet.engine.kv_cache.fp8 import check_fp8_backend
from pagefleet.engine.kv_cache.pool_memory import zeroed
from pagefleet.engine.kv_cache.state_cache import StateConfig
from pagefleet.engine.linear_attn.kernels import select_kernels
from pagefleet.engine.linear_attn.state import StatePool, blocks_for_state, step_states
from pagefleet.engine.lora.ops import LoRABatch
from pagefleet.engine.model.causal_lm import CausalLM
from pagefleet.engine.model.expert_load import ExpertLoadStats
from pagefleet.engine.outputs import TokenLogprobs
from pagefleet.engine.request import Request
from pagefleet.engine.sampler import top_logprobs
from pagefleet.engine.scheduler import SchedulerOutput

logger = logging.getLogger("pagefleet.engine")
MiB = 1 << 20


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Rows whose logits are sampled (a request's last row once its prompt is done; all
    # 1 + k rows of a request verifying k drafts), in the scheduler's batch order (rows
    # themselves are laid out in another order, see prepare), with each row's request.
    sample_rows: list[int]
    sample_requests: list[Request]
    # Requests asking for prompt logprobs: (request, first row, first position, rows).
    prompt_logprob_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # Each row's LoRA adapter slot (None: no row runs an adapter, or LoRA is off).
    lora: LoRABatch | None = None
    # Each scheduled request's first row, in batch order: its n rows follow it (all but a
    # verification's, whose 1 + k single rows may be apart); the pooling runner reads these.
    first_rows: list[int] = field(default_factory=list)


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V in this model's (or rank's) pool, by the capacity module's
    arithmetic (`pagefleet plan` and the operator use the same); the dtype's element size is
    its bytes per value (1 for fp8)."""
    cfg = model.config
    return capacity.kv_bytes_per_token(
        cfg.num_kv_layers,
        cfg.num_kv_heads,  # the checkpoint's: split (or replicated) over the TP ranks
        cfg.head_dim,
        torch.empty((), dtype=dtype).element_size(),
        model.tp.layout.size if model.tp else 1,
    )


def forget_start_up_routing(model: CausalLM) -> None:
    """Zero a mixture-of-experts model's routing counts after start-up's dry runs (memory
    profiling, graph capture), so the load metrics count only requests' tokens."""
    reset = getattr(model, "reset_expert_load", None)
    if reset is not None:
        reset()


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block in this model's (or rank's) pool."""
    return block_size * kv_bytes_per_token(model, dtype)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        num_blocks: int,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        kv_scales: list[tuple[float, float]] | None = None,
        num_state_slots: int = 1,
    ) -> None:
        """`kv_scales`: per layer (k_scale, v_scale) of an fp8 pool (kv_cache/fp8.py).
        `num_state_slots`: a hybrid model's state pool (running sequences and snapshots)."""
        cfg = model.config
        if kv_scales is not None:
            on_cuda = device.type == "cuda"
            check_fp8_backend(
                backend.name, torch.cuda.get_device_capability(device) if on_cuda else None
            )
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.device = device
        pool_shape = (
            cfg.num_kv_layers,
            2,
            model.num_kv_heads,
            num_blocks,
            block_size,
            cfg.head_dim,
        )
        self.kv_pool = zeroed(pool_shape, dtype, device)
        self.kv_scales = kv_scales
        self.kv_caches = [
            LayerKV(self.kv_pool[i, 0], self.kv_pool[i, 1], kv_scales[i] if kv_scales else None)
            for i in range(cfg.num_kv_layers)
        ]
        self.kv_cache_dtype = str(dtype).removeprefix("torch.")
        self.decode_graphs: DecodeGraphs | None = None  # see capture_decode_graphs
        self.lora = None  # the LoRAManager of a model with LoRA layers (lora/manager.py)
        self.state_pool: StatePool | None = None
        shape = cfg.state_shape(model.tp.layout.size if model.tp else 1)
        if shape is not None:
            state_dtype = model.embed_tokens.weight.dtype  # the model's, as the capacity module
            self.state_pool = StatePool(shape, max(num_state_slots, 1), state_dtype, device)
            self.state_kernels = select_kernels(backend.name)
            pool = self.state_pool
            logger.info(
                "Linear-attention state: %d slots (running sequences + prefix snapshots) of "
                "%d bytes, %.1f MiB%s, for %d of %d layers (%s kernels)",
                pool.num_slots,
                pool.bytes_per_slot,
                pool.num_slots * pool.bytes_per_slot / MiB,
                " per rank" if model.tp else "",
                shape.num_layers,
                cfg.num_layers,
                self.state_kernels.name,
            )

    def state_config(self) -> StateConfig | None:
        """The state pool as the KV manager sees it (None: the model keeps only KV)."""
        pool = self.state_pool
        if pool is None:
            return None
        block = self.kv_pool[:, :, :, 0].numel() * self.kv_pool.element_size()
        transfer = blocks_for_state(pool.bytes_per_slot, block)
        return StateConfig(pool.num_slots, transfer, pool.bytes_per_slot / block)

    def expert_load(self) -> ExpertLoadStats | None:
        """A mixture-of-experts model's routing counts per layer (None for a dense model)."""
        load = getattr(self.model, "expert_load", None)
        return load() if load is not None else None

    def capture_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, use_graphs: bool = True
    ) -> bool:
        """Serve decode-only steps from CUDA graphs (use_graphs=False: the same static-buffer
        path, run eagerly, for CPU tests). False when the backend cannot be captured."""
        if not getattr(self.backend, "supports_cuda_graphs", False) or self.state_pool:
            return False  # (graphs do not carry a hybrid's state slots)
        graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_caches,
            max_num_seqs,
            max_model_len,
            self.block_size,
            self.device,
            use_graphs,
        )
        if use_graphs:
            graphs.capture()
            forget_start_up_routing(self.model)
        self.decode_graphs = graphs
        return True

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, list[Request], dict[str, tuple[int, list[TokenLogprobs]]]]:
        """Run one step; returns (logits of the sampled rows, their requests, in batch order as
        `out.samples()`, and prompt logprobs by request id). A request verifying drafts has
        all its 1 + k rows there, one after another, and appears once per row."""
        inputs = self.prepare(out)
        hidden = self.hidden_states(inputs)
        rows = torch.tensor(inputs.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows]) if inputs.sample_rows else hidden[:0]
        prompt_logprobs = self._prompt_logprobs(hidden, inputs)
        return logits, inputs.sample_requests, prompt_logprobs

    @torch.inference_mode()
    def hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass: final hidden states, one row per input row."""
        if self.lora is not None:
            self.lora.state.batch = inputs.lora
        hidden = None
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        if hidden is None:
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)
        return hidden

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward pass, with a hybrid's state moves before and after it."""
        states = meta.states
        if states is not None:
            states.pool, states.kernels = self.state_pool, self.state_kernels
            self.state_pool.apply(states.before, self.kv_pool)
        hidden = self.model(input_ids, positions, self.backend, self.kv_caches, meta)
        if states is not None:
            self.state_pool.apply(states.after, self.kv_pool)
        return hidden

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        # Single-token rows sorted by context length, so attention groups pad little; each
        # entry keeps its place k in the batch, so sampled rows come back in batch order.
        # A request verifying drafts is 1 + k single rows (positions in order): the pool
        # takes every row's keys and values before any row attends, so each reads the rows
        # before it as a decode row would, batched with the decodes.
        # (A hybrid's linear-attention layers read a verification's rows in order, as one
        # short chunk: its rows stay together, requests ordered by their first position.)
        order = _position if self.state_pool is None else _request_then_position
        singles = sorted(_single_rows(out), key=order)
        chunks = [
            (k, r, n)
            for k, (r, n) in enumerate(out.scheduled)
            if n > 1 and r.request_id not in out.spec_token_ids
        ]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        skipped: list[int] = []  # rows whose keys/values are already in a shared block
        tables: list[list[int]] = []
        context_lens: list[int] = []
        sample_row_of: list[list[int] | None] = [None] * len(out.scheduled)  # by batch place
        first_rows = [-1] * len(out.scheduled)
        prompt_rows: list[tuple[Request, int, int, int]] = []

        for row, (k, req, pos, token) in enumerate(singles):
            ids = req.block_ids
            input_ids.append(token)
            positions.append(pos)
            if pos < req.num_cached_tokens:
                skipped.append(row)
            else:
                slots.append(ids[pos // bs] * bs + pos % bs)
            num_blocks = pos // bs + 1
            tables.append(ids[:num_blocks])
            context_lens.append(pos + 1)
            if first_rows[k] < 0:
                first_rows[k] = row
            self._note_rows(req, k, row, pos, 1, sample_row_of, prompt_rows)

        prefills: list[PrefillChunk] = []
        chunk_slots: list[torch.Tensor] = []
        chunk_positions: list[torch.Tensor] = []
        chunk_rows: list[tuple[Request, int, int]] = []
        row = len(singles)
        for k, req, n in chunks:
            chunk_rows.append((req, row, n))
            start = req.num_computed_tokens
            input_ids.extend(req.all_token_ids[start : start + n])
            pos = torch.arange(start, start + n)
            chunk_positions.append(pos)
            block_ids = torch.tensor(req.block_ids[: (start + n + bs - 1) // bs])
            chunk_slots.append(block_ids[pos // bs] * bs + pos % bs)
            prefills.append(PrefillChunk(row, n, start, block_ids.to(self.device)))
            first_rows[k] = row
            self._note_rows(req, k, row, start, n, sample_row_of, prompt_rows)
            row += n
        sample_rows = [r for rows in sample_row_of if rows is not None for r in rows]
        sample_requests = [
            out.scheduled[k][0]
            for k, rows in enumerate(sample_row_of)
            if rows is not None
            for _ in rows
        ]

        num_single = len(singles)
        dev = self.device
        single_lens = torch.tensor(context_lens, dtype=torch.int64)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        if chunk_slots:
            slot_mapping = torch.cat([slot_mapping, *chunk_slots])
        write_rows = None
        if skipped:
            keep = torch.ones(row, dtype=torch.bool)
            keep[skipped] = False
            write_rows = keep.nonzero().squeeze(1).to(dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            write_rows=write_rows,
            num_single=num_single,
            single_groups=single_groups(tables, single_lens, self.block_size, dev),
            prefills=prefills,
        )
        lora = self._lora_rows(out, singles, chunks) if self.lora is not None else None
        if self.state_pool is not None:
            single_reqs = [req for _, req, _, _ in singles]
            meta.states = step_states(out.state, single_reqs, chunk_rows, dev)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.cat([torch.tensor(positions, dtype=torch.int64), *chunk_positions]).to(
                dev
            ),
            meta=meta,
            sample_rows=sample_rows,
            sample_requests=sample_requests,
            prompt_logprob_rows=prompt_rows,
            lora=lora,
            first_rows=first_rows,
        )

    def _lora_rows(self, out: SchedulerOutput, singles, chunks) -> LoRABatch | None:
        """Slots for the step's adapters (installed now if not resident) and each row's slot,
        in the rows' order: the single rows, then each chunk's."""
        names = {r.lora_name for r, _ in out.scheduled if r.lora_name is not None}
        if not names:
            return None
        slots = self.lora.activate(names)
        row_slots = [slots.get(req.lora_name, -1) for _, req, _, _ in singles]
        for _, req, n in chunks:
            row_slots += [slots.get(req.lora_name, -1)] * n
        return LoRABatch.build(row_slots, self.device)

    @staticmethod
    def _note_rows(req, k, row, start, n, sample_row_of, prompt_rows) -> None:
        end = start + n
        if end >= req.num_tokens:
            # A verification's rows come one at a time, in position order.
            sample_row_of[k] = [*(sample_row_of[k] or ()), row + n - 1]
        if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
            # Rows at positions p < prompt_len - 1 predict prompt token p + 1.
            count = min(end, req.num_prompt_tokens - 1) - start
            prompt_rows.append((req, row, start, count))

    def _prompt_logprobs(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Per request: (first position, logprobs of the prompt tokens that follow each row)."""
        result: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        for req, row, start, count in inputs.prompt_logprob_rows:
            logits = self.model.compute_logits(hidden[row : row + count])
            result[req.request_id] = (start, prompt_logprob_entries(req, start, logits))
        return result


def _position(row: tuple) -> int:
    return row[2]


def _request_then_position(row: tuple) -> tuple[int, int, int]:
    return row[1].num_computed_tokens, row[0], row[2]


def _single_rows(out: SchedulerOutput):
    """(batch place, request, position, input token) of every single-token row: decodes,
    one-token recomputes, and each row of a verification (last token, then the drafts)."""
    for k, (req, n) in enumerate(out.scheduled):
        drafts = out.spec_token_ids.get(req.request_id)
        start = req.num_computed_tokens
        if drafts:
            for i, token in enumerate([req.all_token_ids[start], *drafts]):
                yield k, req, start + i, token
        elif n == 1:
            yield k, req, start, req.all_token_ids[start]


def prompt_logprob_entries(req: Request, start: int, logits: torch.Tensor) -> list[TokenLogprobs]:
    """Logprobs of the prompt tokens after positions start.. (one logits row each)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    k = req.sampling_params.prompt_logprobs
    targets = req.all_token_ids[start + 1 : start + 1 + len(logits)]
    return [top_logprobs(logprobs[i], t, k) for i, t in enumerate(targets)]
