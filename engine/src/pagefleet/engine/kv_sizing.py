"""How many KV blocks one rank's memory holds: its weights (a shard of them under tensor
parallelism) and a dry-run activation peak come off the GPU's budget; on CPU the pool gets
--kv-cache-memory. Every rank of a tensor-parallel engine runs this together (the dry run's
forward has collectives) and the engine takes the smallest answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagefleet.engine.attention.backend import select_backend
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.model.transformer import CausalLM
from pagefleet.engine.request import Request
from pagefleet.engine.runner import ModelRunner, kv_bytes_per_block
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from pagefleet.engine.distributed.group import RankGroup

GiB = 1 << 30


def kv_pool_blocks(
    args: EngineArgs,
    model: CausalLM,
    kv_dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    group: RankGroup | None = None,
) -> int:
    """Blocks the pool holds (--num-gpu-blocks-override wins): with a rank group, every rank
    calls this and all get the smallest rank's figure (block ids are the same on every rank)."""
    per_block = kv_bytes_per_block(model, args.block_size, kv_dtype)
    if args.num_gpu_blocks_override:
        blocks = args.num_gpu_blocks_override
    elif device.type == "cuda":
        blocks = cuda_kv_budget(args, model, device, max_model_len) // per_block
    else:
        blocks = int(args.kv_cache_memory * GiB) // per_block
    return blocks if group is None else group.min_over_ranks(blocks)


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
    probe.execute(SchedulerOutput(scheduled=[(dry, n)], num_tokens=n))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del probe
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    return max(int(total * args.gpu_memory_utilization) - peak, 0)
