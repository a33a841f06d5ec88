"""How many KV blocks one rank's memory holds: its weights (a shard of them under tensor
parallelism) and a dry-run activation peak come off the GPU's budget; on CPU the pool gets
--kv-cache-memory. Every rank of a tensor-parallel engine runs this together (the dry run's
forward has collectives) and the engine takes the smallest answer. The arithmetic (bytes per
token and block, blocks in a budget) is pagefleet.common.capacity's, shared with `pagefleet
plan` and the operator's admission check. A hybrid model's state slots are paid from the same
budget first (`cache_plan_of`), as `pagefleet plan --max-num-seqs` plans them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagefleet.common.capacity import CapacityPlan, cache_plan, kv_pool_plan, num_state_slots
from pagefleet.engine.attention.backend import select_backend
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.model.causal_lm import CausalLM
from pagefleet.engine.model.linear import weight_bytes
from pagefleet.engine.request import Request
from pagefleet.engine.runner import ModelRunner, forget_start_up_routing, kv_bytes_per_token
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from pagefleet.engine.distributed.group import RankGroup

GiB = 1 << 30
# Where a container's memory limit is read: cgroup v2, then v1 ("max" or a huge v1 number
# means none).
CGROUP_MEMORY_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def host_memory_bytes() -> int:
    """This host's memory as this process may use it: physical memory, or the container's
    cgroup limit when lower (a pod that allocates past it is OOM-killed)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_MEMORY_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def refuse_past_host_memory(flag: str, gib: float) -> None:
    """Refuse a host pool of `gib` larger than this host's memory (the container's limit
    included). Its pages are written only as requests use them (kv_cache/pool_memory.py), so
    nothing else would fail at start: the engine would be OOM-killed later, under load."""
    host = host_memory_bytes()
    if gib * GiB > host:
        raise ValueError(
            f"{flag} {gib:g} GiB is more than this host's memory ({host / GiB:.1f} GiB, the "
            "container's limit included)"
        )


def kv_pool_blocks(
    args: EngineArgs,
    model: CausalLM,
    kv_dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    group: RankGroup | None = None,
    draft: DraftPool | None = None,
) -> int:
    """Blocks the pool holds (--num-gpu-blocks-override wins): with a rank group, every rank
    calls this and all get the smallest rank's figure (block ids are the same on every rank).
    A draft model's pool has a block for each of the target's, plus scratch: the budget
    holds both."""
    if args.num_gpu_blocks_override:
        blocks = args.num_gpu_blocks_override
    else:
        if device.type == "cuda":
            budget = cuda_kv_budget(args, model, device, max_model_len)
        else:
            refuse_past_host_memory("--kv-cache-memory", args.kv_cache_memory)
            budget = int(args.kv_cache_memory * GiB)
        if draft is not None:
            target = kv_pool_plan_of(args, model, kv_dtype, 0).bytes_per_block
            budget = draft.target_share(budget, target)
        blocks = cache_plan_of(args, model, kv_dtype, budget).kv_blocks
    return blocks if group is None else group.min_over_ranks(blocks)


@dataclass(frozen=True)
class DraftPool:
    """What a draft model's KV pool takes next to the target's: bytes per block (one for
    each of the target's blocks) and its scratch blocks."""

    bytes_per_block: int
    scratch_blocks: int

    def target_share(self, budget: int, target_bytes_per_block: int) -> int:
        """The part of `budget` left for the target's blocks once the draft's are paid."""
        left = max(budget - self.scratch_blocks * self.bytes_per_block, 0)
        return left * target_bytes_per_block // (target_bytes_per_block + self.bytes_per_block)


def kv_pool_plan_of(
    args: EngineArgs, model: CausalLM, kv_dtype: torch.dtype, kv_bytes: int
) -> CapacityPlan:
    """This rank's pool of `kv_bytes` as the capacity module sees it (tokens, blocks, bytes per
    token and per block, sequences at a context), the state slots beside it, and this rank's
    weights as loaded."""
    slots = state_slots_of(args, model)
    return kv_pool_plan(
        kv_bytes_per_token(model, kv_dtype),
        kv_bytes,
        kv_format=str(kv_dtype).removeprefix("torch."),
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        state_slots=slots,
        state_bytes=slots * state_bytes_per_slot(model),
        weights_format=model.weights_format,
        weights_bytes=weight_bytes(model),
    )


def cache_plan_of(
    args: EngineArgs, model: CausalLM, kv_dtype: torch.dtype, cache_bytes: int
) -> CapacityPlan:
    """This rank's cache of `cache_bytes`: state slots first, the rest KV blocks."""
    return cache_plan(
        kv_bytes_per_token(model, kv_dtype),
        cache_bytes,
        kv_format=str(kv_dtype).removeprefix("torch."),
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        state_slots=state_slots_of(args, model),
        state_bytes_per_slot=state_bytes_per_slot(model),
    )


def check_holds_one(plan: CapacityPlan, max_model_len: int, device: torch.device) -> None:
    """Refuse a pool that cannot hold one request of max_model_len, naming the knobs (and,
    for a hybrid model, the state slots paid before it)."""
    if plan.holds_one(max_model_len):
        return
    memory_flag = "--gpu-memory-utilization" if device.type == "cuda" else "--kv-cache-memory"
    state = ""
    if plan.state_slots:
        state = (
            f", or lower --max-num-seqs or --num-state-snapshots ({plan.state_slots} "
            f"linear-attention state slots take {plan.state_bytes / GiB:.2f} GiB first)"
        )
    raise ValueError(
        f"the KV cache holds {plan.block_tokens} tokens, less than one request of "
        f"max_model_len={max_model_len}: lower --max-model-len, raise {memory_flag} "
        f"or --num-gpu-blocks-override, or use a smaller --kv-cache-dtype{state} "
        f"(`pagefleet plan` shows the options)"
    )


def state_slots_of(args: EngineArgs, model: CausalLM) -> int:
    """A hybrid model's state slots (capacity.num_state_slots); 0 for a model without state."""
    if model.config.state_shape() is None:
        return 0
    return num_state_slots(args.max_num_seqs, args.num_state_snapshots, args.enable_prefix_caching)


def state_bytes_per_slot(model: CausalLM) -> int:
    """One sequence's recurrent state on this rank, at the model's dtype (0 without)."""
    shape = model.config.state_shape(model.tp.layout.size if model.tp else 1)
    if shape is None:
        return 0
    return shape.values * model.embed_tokens.weight.element_size()


def cuda_kv_budget(
    args: EngineArgs, model: CausalLM, device: torch.device, max_model_len: int
) -> int:
    """Bytes left for the KV pool on the GPU: utilisation x total, minus the weights and
    the activation peak of a dry-run forward at max_num_batched_tokens."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    dtype = next(model.parameters()).dtype
    probe = ModelRunner(
        model,
        args.block_size,
        -(-args.max_num_batched_tokens // args.block_size),
        select_backend(args.attention_backend, device),
        device,
        dtype,
    )
    n = min(args.max_num_batched_tokens, max_model_len - 1)
    dry = Request("profile", [0] * n, SamplingParams(max_tokens=1), block_size=probe.block_size)
    dry.block_ids.extend(range(-(-n // probe.block_size)))
    dry.state_slot = 0  # a hybrid probe's one slot (its state pool is not kept)
    probe.execute(SchedulerOutput(scheduled=[(dry, n)], num_tokens=n))
    forget_start_up_routing(model)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del probe
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    return max(int(total * args.gpu_memory_utilization) - peak, 0)
