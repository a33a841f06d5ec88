"""`pagefleet demo`: the tiny demo model served on 127.0.0.1 with a curl to try, or run offline
through `LLM`, or (`--stand-in`) the scheduler and KV cache alone."""

from __future__ import annotations

import argparse
import os

DEMO_CURL = """pagefleet is serving {model}{noise}.
Stream a chat completion:

  curl -N http://{host}:{port}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "stream": true, "max_tokens": 32,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

Metrics: http://{host}:{port}/metrics    Stop: Ctrl-C
"""


def add_demo_parser(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="serve the tiny local demo model on 127.0.0.1 and print a curl to try; "
        "--offline runs LLM.generate instead, --stand-in the scheduler and KV cache alone",
    )
    demo.add_argument(
        "--model",
        default=None,
        help="checkpoint dir or GGUF file (default: SmolLM2-135M-Instruct, fetched once)",
    )
    demo.add_argument(
        "--tiny", action="store_true", help="the tiny random checkpoint instead (no download)"
    )
    demo.add_argument("--host", default="127.0.0.1", help="address to serve on (127.0.0.1)")
    demo.add_argument("--port", type=int, default=8000, help="port to serve on (8000)")
    demo.add_argument("--offline", action="store_true", help="LLM.chat on the demo model")
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
    demo.set_defaults(func=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    if args.stand_in:
        return _stand_in_demo(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pagefleet.engine.cache import TINY_SERVED_NAME, model_to_serve

    model, name = model_to_serve(args.model, args.tiny, None)
    if args.offline:
        from pagefleet.engine.demo import run_llm_demo

        print(run_llm_demo(model))
        return 0
    from pagefleet.engine.server.serve import add_serve_parser, run_serve

    parser = argparse.ArgumentParser(prog="pagefleet")
    add_serve_parser(parser.add_subparsers())
    serve_args = parser.parse_args(
        [
            "serve",
            model,
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--served-model-name",
            name,
            "--kv-cache-memory",
            "0.25",
            "--max-model-len",
            "1024",
        ]
    )
    noise = " (random weights: the text is noise)" if name == TINY_SERVED_NAME else ""
    banner = DEMO_CURL.format(host=args.host, port=args.port, model=name, noise=noise)
    return run_serve(serve_args, banner=banner)


def _stand_in_demo(args: argparse.Namespace) -> int:
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
