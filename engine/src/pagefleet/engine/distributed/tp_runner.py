"""Tensor-parallel model running: rank 0's runner (in the engine process, after the scheduler)
and the worker ranks' loop, over one rank group.

Each step rank 0 prepares the inputs as on one rank, broadcasts them in one flat tensor
(step_codec.py), and every rank runs the forward on its shard of the weights and of every KV
block (the same block ids everywhere, so the scheduler and KV manager stay single, on rank 0).
The logits rows (sampled rows, then prompt-logprob rows) are gathered once, on rank 0, which
samples. A stop message ends the workers' loop. `worker_main` is the entry every executor
calls in ranks 1..N-1.

With LoRA, rank 0's adapter manager decides the slots: each adapter it installs is a command
(OP_LORA: slot, name and folder, JSON) after which every rank reads its own shard of the
adapter from the same folder; each step's row slots follow the step's body as a third
broadcast (the step codec stays as it is).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagefleet.engine.attention.backend import AttentionBackend, select_backend
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.distributed.executor import Executor, RankSpec, worker_device
from pagefleet.engine.distributed.group import (
    STORE_FILE_ENV,
    RankGroup,
    local_device,
    open_store,
)
from pagefleet.engine.distributed.kv_ranks import RankKVChannel, WorkerKV
from pagefleet.engine.distributed.step_codec import (
    HEAD_LEN,
    OP_KV,
    OP_STOP,
    decode_step,
    encode_step,
    stop_head,
)
from pagefleet.engine.kv_sizing import kv_pool_blocks, state_slots_of
from pagefleet.engine.lora.manager import LoRAManager, setup_lora
from pagefleet.engine.lora.ops import LoRABatch
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.model.causal_lm import CausalLM
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.loader import (
    kv_cache_format,
    load_model,
    read_config,
    resolve_dtype,
)
from pagefleet.engine.model.parallel import TPLayout
from pagefleet.engine.model.registry import model_config
from pagefleet.engine.outputs import TokenLogprobs
from pagefleet.engine.request import Request
from pagefleet.engine.runner import ModelRunner, prompt_logprob_entries
from pagefleet.engine.scheduler import SchedulerOutput

logger = logging.getLogger("pagefleet.engine")
OP_LORA = 3  # install an adapter (or clear a slot) on every rank: a uint8 JSON body
WORKER_ENTRY = "pagefleet.engine.distributed.tp_runner:worker_main"


@dataclass(frozen=True)
class ShardJob:
    """What every rank needs to build its shard (the pickled `RankSpec.payload`)."""

    args: EngineArgs
    max_model_len: int
    device_type: str  # cpu or cuda

    def kv_format(self, device: torch.device) -> tuple[torch.dtype, list | None]:
        """The pool's dtype and fp8 scales, as rank 0's (loader.kv_cache_format)."""
        dtype = resolve_dtype(self.args.dtype, device)
        return kv_cache_format(self.args.kv_cache_dtype, dtype, device, self.args.model)


def rank_spec(job: ShardJob, master_addr: str, master_port: int) -> RankSpec:
    """The spec the executor starts ranks 1..N-1 with."""
    return RankSpec(
        world_size=job.args.tensor_parallel_size,
        master_addr=master_addr,
        master_port=master_port,
        backend="nccl" if job.device_type == "cuda" else "gloo",
        entry=WORKER_ENTRY,
        payload=pickle.dumps(job),
    )


def check_tensor_parallel(args: EngineArgs, hf_config: dict) -> None:
    """Refuse, before any rank starts, what tensor parallelism cannot run."""
    if args.kv_transfer_config:
        from pagefleet.engine.kv_transfer.connector import KVTransferConfig

        connector = KVTransferConfig.parse(args.kv_transfer_config).kv_connector
        if connector != "nixl":
            # Every rank moves its own shard with its own agent; the TCP path serves one pool.
            raise ValueError(
                f'--tensor-parallel-size > 1 moves KV over NIXL only: "kv_connector": '
                f'"nixl" in --kv-transfer-config, not {connector!r}'
            )
    TPLayout.of(model_config(hf_config), 0, args.tensor_parallel_size, args.enable_expert_parallel)


def start_rank_zero(
    job: ShardJob,
    executor: Executor,
    master_addr: str = "127.0.0.1",
    on_started: Callable[[Executor], None] | None = None,
) -> RankGroup:
    """Open rank 0's store, start the worker ranks (then `on_started`: the supervisor watches
    before rank 0 waits for them, so a rank dying at the rendezvous fails the engine) and join
    the group with them (returns once every rank has joined)."""
    world = job.args.tensor_parallel_size
    store = open_store(master_addr, world)
    spec = rank_spec(job, master_addr, store.port)
    if store.file is not None:
        spec = dataclasses.replace(spec, env={**spec.env, STORE_FILE_ENV: store.file})
    executor.start(spec)
    if on_started is not None:
        on_started(executor)
    device = torch.device(executor.rank0_device(spec.backend))
    group = RankGroup(store.store, 0, world, spec.backend, device, master_addr)
    group.on_close = store.close
    return group


def load_shard(job: ShardJob, group: RankGroup) -> CausalLM:
    """This rank's shard of the model, on its device."""
    cfg = model_config(read_config(job.args.model))
    layout = TPLayout.of(cfg, group.rank, group.size, job.args.enable_expert_parallel)
    tp = TPParts(layout, group, job.args.all2all_backend)
    if layout.experts is not None:
        _log_experts(cfg, layout, job.args.all2all_backend)
    dtype = resolve_dtype(job.args.dtype, group.device)
    args = job.args
    return load_model(
        args.model,
        dtype,
        group.device,
        job.max_model_len,
        tp,
        quantization=args.quantization,
        linear_path=args.linear_path,
    )


def _log_experts(cfg, layout: TPLayout, backend: str) -> None:
    shard, spec = layout.experts, cfg.moe
    if layout.expert_parallel:
        logger.info(
            "rank %d: whole experts per rank (expert parallel, --all2all-backend %s): experts "
            "%d-%d of %d",
            *(layout.rank, backend, shard.first, shard.end - 1, spec.num_experts),
        )
    else:
        logger.info(
            "rank %d: every expert split over the ranks: columns %d-%d of %d of each of %d "
            "experts (--enable-expert-parallel places whole experts instead)",
            *(layout.rank, shard.column_start, shard.column_start + shard.columns - 1),
            *(spec.intermediate_size, spec.num_experts),
        )


class ParallelModelRunner(ModelRunner):
    """Rank 0's runner: prepares each step, sends it to the workers, runs its shard and returns
    the gathered logits. Owns the group and the executor (close() stops the workers)."""

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        num_blocks: int,
        backend: AttentionBackend,
        kv_dtype: torch.dtype,
        group: RankGroup,
        executor: Executor,
        kv_scales: list[tuple[float, float]] | None = None,
        num_state_slots: int = 1,
    ) -> None:
        super().__init__(
            *(model, block_size, num_blocks, backend, group.device, kv_dtype, kv_scales),
            num_state_slots,
        )
        self.group = group
        self.executor = executor
        self.closed = False

    def attach_lora(self, manager: LoRAManager | None) -> None:
        """Rank 0's adapter manager: every adapter it installs is installed on all ranks."""
        self.lora = manager
        if manager is not None:
            manager.on_install = self._install_on_ranks

    def _install_on_ranks(self, slot: int, request: LoRARequest | None) -> None:
        command = {"slot": slot, "adapter": None}
        if request is not None:
            command["adapter"] = [request.lora_name, request.lora_int_id, request.lora_path]
        data = json.dumps(command).encode()
        device = self.device
        self.group.broadcast(torch.tensor([OP_LORA, len(data), 0], device=device))
        self.group.broadcast(torch.tensor(list(data), dtype=torch.uint8, device=device))

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, list[Request], dict[str, tuple[int, list[TokenLogprobs]]]]:
        inputs = self.prepare(out)
        logit_rows = list(inputs.sample_rows)
        for _, row, _, count in inputs.prompt_logprob_rows:
            logit_rows.extend(range(row, row + count))
        head, body = encode_step(inputs.input_ids, inputs.positions, inputs.meta, logit_rows)
        self.group.broadcast(head)
        self.group.broadcast(body)
        if self.lora is not None:
            self.lora.state.batch = inputs.lora
            rows = len(inputs.input_ids)
            lora_rows = inputs.lora.row_slots if inputs.lora is not None else None
            self.group.broadcast(
                lora_rows if lora_rows is not None else torch.full((rows,), -1, device=self.device)
            )
        hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)
        if not logit_rows:
            return hidden[:0], inputs.sample_requests, {}
        rows = torch.tensor(logit_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        num_sampled = len(inputs.sample_rows)
        prompt_logprobs = {}
        at = num_sampled
        for req, _, start, count in inputs.prompt_logprob_rows:
            entries = prompt_logprob_entries(req, start, logits[at : at + count])
            prompt_logprobs[req.request_id] = (start, entries)
            at += count
        return logits[:num_sampled], inputs.sample_requests, prompt_logprobs

    def kv_ranks(self) -> RankKVChannel:
        """The worker ranks' side of KV transfer, for the engine's connector."""
        return RankKVChannel(self.group, self.model.tp.layout)

    def close(self) -> None:
        """Stop the workers' loop, leave the group and stop the executor's ranks."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.executor.failure() is None:
                self.group.broadcast(stop_head(self.device))
        finally:
            self.executor.shutdown()
            self.group.close()


def serve_steps(runner: ModelRunner, group: RankGroup, kv: WorkerKV | None = None) -> int:
    """A worker rank's loop: run each step rank 0 broadcasts (and each KV-transfer command,
    with `kv`, and each adapter install, with LoRA) until the stop message; returns the number
    of steps run."""
    head = torch.empty(HEAD_LEN, dtype=torch.int64, device=group.device)
    steps = 0
    while True:
        group.broadcast(head)
        op, length, desc_len = head.tolist()
        if op == OP_STOP:
            return steps
        if op == OP_KV:
            command = torch.empty(length, dtype=torch.uint8, device=group.device)
            group.broadcast(command)
            if kv is None:
                raise RuntimeError("a KV-transfer command reached a rank without KV transfer")
            kv.handle(group, command.cpu().numpy().tobytes())
            continue
        if op == OP_LORA:
            command = torch.empty(length, dtype=torch.uint8, device=group.device)
            group.broadcast(command)
            _install_adapter(runner.lora, json.loads(command.cpu().numpy().tobytes()))
            continue
        body = torch.empty(length, dtype=torch.int64, device=group.device)
        group.broadcast(body)
        input_ids, positions, meta, logit_rows = decode_step(body, desc_len, runner.block_size)
        if runner.lora is not None:
            lora_rows = torch.empty(len(input_ids), dtype=torch.int64, device=group.device)
            group.broadcast(lora_rows)
            runner.lora.state.batch = LoRABatch.build(lora_rows.tolist(), group.device)
        with torch.inference_mode():
            hidden = runner.forward(input_ids, positions, meta)
            if len(logit_rows):
                runner.model.compute_logits(hidden[logit_rows])
        steps += 1


def _install_adapter(manager: LoRAManager | None, command: dict) -> None:
    """A worker's side of OP_LORA: its shard of the adapter (read from the folder rank 0
    checked) into the slot, or the slot cleared."""
    if manager is None:
        raise RuntimeError("a LoRA command reached a rank without LoRA")
    adapter = command["adapter"]
    request = LoRARequest(*adapter) if adapter is not None else None
    manager.install_local(int(command["slot"]), request)


def build_worker(job: ShardJob, group: RankGroup) -> ModelRunner:
    """A worker rank's shard and pool, sized together with the other ranks."""
    start = time.perf_counter()
    model = load_shard(job, group)
    dtype = resolve_dtype(job.args.dtype, group.device)
    # Rank 0 registers the --lora-modules adapters; a worker only installs what it is sent.
    lora = setup_lora(dataclasses.replace(job.args, lora_modules=()), model, dtype, group.device)
    kv_dtype, kv_scales = job.kv_format(group.device)
    blocks = kv_pool_blocks(job.args, model, kv_dtype, group.device, job.max_model_len, group)
    shape = model.decode_shape(job.args.block_size, kv_dtype)
    backend = select_backend(job.args.attention_backend, group.device, shape)
    runner = ModelRunner(
        *(model, job.args.block_size, blocks, backend, group.device, kv_dtype, kv_scales),
        state_slots_of(job.args, model),
    )
    runner.lora = lora
    logger.info(
        "rank %d: shard loaded in %.2f s, KV pool of %d blocks",
        group.rank,
        time.perf_counter() - start,
        blocks,
    )
    return runner


def worker_main(rank: int, spec: RankSpec) -> None:
    """The entry of worker ranks 1..N-1 (`RankSpec.entry`): join rank 0's group, load this
    rank's shard, serve steps until rank 0 says stop."""
    job: ShardJob = pickle.loads(spec.payload)
    # The executor tells each rank its device (PAGEFLEET_DEVICE); else one per rank on the node.
    fallback = local_device(rank, job.device_type)
    device = torch.device(worker_device(str(fallback)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Ranks share the node's cores; each takes its part (rank 0 keeps the engine's).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    group = RankGroup.join(
        spec.master_addr, spec.master_port, rank, spec.world_size, spec.backend, device
    )
    kv = None
    try:
        runner = build_worker(job, group)
        if job.args.kv_transfer_config:
            kv = WorkerKV(runner.kv_pool, rank, runner.model.tp.layout)
        serve_steps(runner, group, kv)
    finally:
        if kv is not None:
            kv.close()
        group.close()
