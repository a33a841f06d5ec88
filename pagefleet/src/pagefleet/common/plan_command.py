"""`pagefleet plan`: capacity before deploying (weights, KV pool, tokens and sequences that fit,
workload what-ifs), a thin command over pagefleet.common.capacity; a table for people, --json
for tools."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from pagefleet.common.capacity import (
    GB,
    CapacityPlan,
    GiB,
    GpuBudget,
    KiB,
    ModelShape,
    Workload,
    fit_workload,
    gpu_memory_bytes,
    model_shape,
    num_state_slots,
    plan_in_memory,
    plan_on_gpu,
    pool_of_blocks,
)

DEFAULT_CONTEXTS = (262_144, 32_768, 8_192)


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from e

    return parse


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="KV capacity of a model on a GPU: weights, KV pool, tokens and sequences that fit",
    )
    p.add_argument("model", help="checkpoint dir or config.json (read locally, never fetched)")
    p.add_argument("--gpu", default="H100-80GB", help="GPU type (H100-80GB); see --gpu-memory-gb")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="GPU memory in GB (10^9 B)")
    p.add_argument(
        "--weights",
        type=_csv(str),
        default=None,
        help="weight formats: bf16,fp8,int4 (the checkpoint's: its dtype or quantization, "
        "weighed as its files are)",
    )
    p.add_argument(
        "--kv-cache-dtype", type=_csv(str), default=None, help="KV formats: bf16,fp8 (model's)"
    )
    p.add_argument(
        "--tensor-parallel-size", "--tp", type=_csv(int), default=[1], help="TP sizes (1)"
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="mixture of experts: whole experts per GPU (the fullest holds ceil(experts / TP))",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92, help="(0.92)")
    p.add_argument("--overhead-gb", type=float, default=0.0, help="activations, graphs... (0)")
    p.add_argument("--params", type=float, default=None, help="parameter count (from the model)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="a pool of this many blocks instead of sizing it from GPU memory",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="GiB of cache per rank instead of GPU memory (the engine's CPU flag)",
    )
    hybrid = p.add_argument_group(
        "hybrid models: state slots paid from the same memory before the KV pool"
    )
    hybrid.add_argument(
        "--max-num-seqs", type=int, default=None, help="running sequences (a state slot each)"
    )
    hybrid.add_argument(
        "--num-state-snapshots",
        type=int,
        default=None,
        help="prefix-cache state snapshots (default: --max-num-seqs)",
    )
    p.add_argument(
        "--contexts",
        type=_csv(int),
        default=list(DEFAULT_CONTEXTS),
        help="context lengths to count sequences at (262144,32768,8192)",
    )
    what_if = p.add_argument_group("workload what-if")
    what_if.add_argument("--requests", type=int, default=None, help="N requests")
    what_if.add_argument("--prompt-tokens", type=int, default=None, help="P prompt tokens each")
    what_if.add_argument("--output-tokens", type=int, default=0, help="O output tokens each")
    what_if.add_argument("--shared-prefix", type=int, default=0, help="S identical prefix tokens")
    p.add_argument("--json", action="store_true", help="JSON for tools instead of a table")
    p.set_defaults(func=run_plan)


def _finite(flag: str, value: float, low: float) -> float:
    """A number flag's value when finite and >= low (ValueError naming the flag otherwise:
    int() of inf would overflow, of nan fail without saying which flag)."""
    if not math.isfinite(value) or value < low:
        raise ValueError(f"{flag} {value} must be a finite number >= {low:g}")
    return value


def _budget(args: argparse.Namespace) -> GpuBudget:
    if args.gpu_memory_gb is not None:
        memory = int(_finite("--gpu-memory-gb", args.gpu_memory_gb, 0) * GB)
    else:
        memory = gpu_memory_bytes(args.gpu)
    overhead = _finite("--overhead-gb", args.overhead_gb, 0)
    return GpuBudget(memory, args.gpu_memory_utilization, int(overhead * GB))


def build_plans(args: argparse.Namespace, shape: ModelShape) -> list[CapacityPlan]:
    """One plan per weight format x KV format x TP size."""
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        raise ValueError(f"--block-size {args.block_size} must be a power of two")
    if args.num_gpu_blocks is not None and args.num_gpu_blocks < 1:
        raise ValueError(f"--num-gpu-blocks {args.num_gpu_blocks} must be >= 1")
    if any(c < 1 for c in args.contexts):
        raise ValueError("--contexts must be >= 1 token each")
    weights = args.weights or ["auto"]
    kv_formats = [shape.dtype if k == "auto" else k for k in args.kv_cache_dtype or ["auto"]]
    slots = _state_slots(args, shape)
    plans = []
    for w, kv, tp in itertools.product(weights, kv_formats, args.tensor_parallel_size):
        # The checkpoint's own format (auto) weighs what its files hold, codes and scales.
        own = w == "auto" or w == shape.weights_format
        w = shape.own_weights_format if w == "auto" else w
        common = {
            "kv_format": kv,
            "block_size": args.block_size,
            "tensor_parallel_size": tp,
            "state_slots": slots,
        }
        if args.num_gpu_blocks is not None:
            plan = pool_of_blocks(shape, args.num_gpu_blocks, weights_format=w, **common)
        elif args.kv_cache_memory is not None:
            memory = int(_finite("--kv-cache-memory", args.kv_cache_memory, 0) * GiB)
            plan = plan_in_memory(shape, memory, weights_format=w, **common)
        else:
            params = int(_finite("--params", args.params, 1)) if args.params is not None else None
            plan = plan_on_gpu(
                shape,
                _budget(args),
                weights_format=w,
                num_parameters=params,
                expert_parallel=args.enable_expert_parallel,
                weights_bytes=shape.weight_bytes if own and params is None else None,
                **common,
            )
        plans.append(plan)
    return plans


def _state_slots(args: argparse.Namespace, shape: ModelShape) -> int:
    """State slots a hybrid engine of --max-num-seqs keeps (0: not asked, or no state)."""
    if args.max_num_seqs is None:
        if args.num_state_snapshots is not None:
            raise ValueError("--num-state-snapshots needs --max-num-seqs")
        return 0
    slots = num_state_slots(args.max_num_seqs, args.num_state_snapshots)
    return slots if shape.linear_state_bytes_per_sequence else 0


def _workload(args: argparse.Namespace) -> Workload | None:
    if args.requests is None and args.prompt_tokens is None:
        return None
    if args.requests is None or args.prompt_tokens is None:
        raise ValueError("a what-if needs --requests and --prompt-tokens")
    return Workload(args.requests, args.prompt_tokens, args.output_tokens, args.shared_prefix)


def plan_report(args: argparse.Namespace, shape: ModelShape) -> dict[str, Any]:
    """Everything `plan` prints, as plain data."""
    plans = build_plans(args, shape)
    workload = _workload(args)
    rows = []
    for plan in plans:
        row: dict[str, Any] = {
            **asdict(plan),
            "weights_gb": plan.weights_bytes / GB,
            "kv_gb": plan.kv_bytes / GB,
            "kib_per_token": plan.bytes_per_token / KiB,
            "sequences": {str(c): plan.sequences_at(c) for c in args.contexts},
        }
        if workload is not None:
            row["workload"] = asdict(fit_workload(workload, plan.kv_blocks, plan.block_size))
        rows.append(row)
    return {
        "model": asdict(shape),
        "workload": asdict(workload) if workload is not None else None,
        "plans": rows,
    }


def _shape_line(shape: dict[str, Any]) -> str:
    line = (
        f"{shape['num_attention_layers']} attention layers of {shape['num_layers']} x "
        f"{shape['num_kv_heads']} KV heads x head dim {shape['head_dim']}"
    )
    if shape["num_experts"]:
        line += (
            f"; mixture of experts: {shape['num_experts']} experts, "
            f"{shape['experts_per_token']} per token"
        )
        total, active = shape["num_parameters"], shape["num_active_parameters"]
        if total is not None and active is not None:
            line += f", {total / 1e9:.2f}B parameters ({active / 1e9:.2f}B active per token)"
    if shape["linear_state_bytes_per_sequence"]:
        line += (
            f"; linear-attention state {shape['linear_state_bytes_per_sequence'] / 2**20:.1f} MiB"
            " per sequence (apart from the pool)"
        )
    return line


def _what_if_lines(report: dict[str, Any]) -> list[str]:
    w = report["workload"]
    lines = [
        "",
        f"what-if: {w['num_requests']} requests of {w['prompt_tokens']:,} prompt + "
        f"{w['output_tokens']:,} output tokens, shared prefix {w['shared_prefix_tokens']:,}",
    ]
    for r in report["plans"]:
        f = r["workload"]
        lines.append(
            f"  {r['weights_format']}/{r['kv_format']}/TP{r['tensor_parallel_size']}: "
            f"{f['blocks_needed']:,} blocks ({f['blocks_per_request']:,} each), "
            f"{f['fit_at_once']} at once; shared: {f['shared_blocks']:,} + "
            f"{w['num_requests']} x {f['blocks_per_request_shared']:,} = "
            f"{f['blocks_needed_shared']:,} blocks, {f['fit_at_once_shared']} at once "
            f"(pool: {r['kv_blocks']:,} blocks)"
        )
    return lines


def format_table(report: dict[str, Any], contexts: list[int]) -> str:
    seq_head = "seqs at " + " / ".join(f"{c:,}" for c in contexts)
    head = (
        f"{'weights':>7} {'KV':>5} {'TP':>3} {'weights GB':>10} {'KV GB':>7} {'KiB/token':>9} "
        f"{'B/block':>11} {'KV tokens':>12} {'blocks':>10}  {seq_head}"
    )
    lines = [_shape_line(report["model"]), "", head, "-" * len(head)]
    first = report["plans"][0] if report["plans"] else {}
    if first.get("state_slots"):
        lines.insert(
            1,
            f"{first['state_slots']} state slots (running sequences + prefix snapshots) take "
            f"{first['state_bytes'] / GiB:.2f} GiB per GPU before the KV pool",
        )
    for r in report["plans"]:
        seqs = " / ".join(str(r["sequences"][str(c)]) for c in contexts)
        lines.append(
            f"{r['weights_format']:>7} {r['kv_format']:>5} {r['tensor_parallel_size']:>3} "
            f"{r['weights_gb']:>10.1f} {r['kv_gb']:>7.2f} {r['kib_per_token']:>9g} "
            f"{r['bytes_per_block']:>11,} {r['kv_tokens']:>12,} {r['kv_blocks']:>10,}  {seqs}"
        )
    if report["workload"] is not None:
        lines += _what_if_lines(report)
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """ValueError (a bad flag or model) goes to the cli's error line and exit status 2."""
    report = plan_report(args, model_shape(args.model))
    print(json.dumps(report, indent=2) if args.json else format_table(report, args.contexts))
    return 0
