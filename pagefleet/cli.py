"""The `pagefleet` command: one subcommand per role (more arrive with each role)."""

from __future__ import annotations

import argparse
import sys

from pagefleet import __version__


def _demo(args: argparse.Namespace) -> int:
    if not args.stand_in:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from pagefleet.cache import demo_checkpoint
        from pagefleet.engine.demo import run_llm_demo

        print(run_llm_demo(str(args.model or demo_checkpoint())))
        return 0
    from pagefleet.engine.demo import format_report, run_demo

    report = run_demo(
        num_requests=args.num_requests,
        num_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    print(format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagefleet", description="Kubernetes-native LLM serving with a paged KV cache."
    )
    parser.add_argument("--version", action="version", version=f"pagefleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="generate with the tiny local demo model (LLM.generate), or --stand-in to run the "
        "scheduler and KV cache alone on a synthetic shared-prefix load",
    )
    demo.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    demo.add_argument(
        "--stand-in", action="store_true", help="no model: scheduler + KV cache with a stand-in"
    )
    demo.add_argument("--num-requests", type=int, default=64, help="requests to run (64)")
    demo.add_argument("--num-gpu-blocks", type=int, default=96, help="KV blocks in the pool (96)")
    demo.add_argument("--max-num-seqs", type=int, default=32, help="running requests cap (32)")
    demo.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="token budget per step (512)"
    )
    demo.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    demo.set_defaults(func=_demo)
    from pagefleet.engine.server.serve import add_serve_parser

    add_serve_parser(sub)
    from pagefleet.bench_serve import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagefleet {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
