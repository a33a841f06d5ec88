"""`pagefleet bench serve`: a serving benchmark client for any OpenAI-compatible server
(completions, chat, or embeddings in batches: bench_embeddings.py).

Synthetic, seeded datasets (random, shared-prefix, multi-turn); Poisson arrivals or all at
once; a concurrency cap. Reports completed/failed requests, request and output-token
throughput, and TTFT / TPOT / ITL / E2E latency (mean, median, p90, p99).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point company number group problem fact cache block token page pool "
    "model request router engine queue memory answer river mountain light water"
).split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    reply: str = ""
    embeddings: int = 0  # --endpoint embeddings: vectors the request returned


@dataclass
class Conversation:
    turns: list  # user messages (later turns resend the growing history); embeddings: batches


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    p = bench_sub.add_parser("serve", help="load an OpenAI-compatible server and measure it")
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name to send")
    p.add_argument(
        "--endpoint", choices=["chat", "completions", "embeddings"], default="completions"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="embeddings: inputs per request (--num-prompts counts inputs) (1)",
    )
    p.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn"], default="random")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=100,
        help="requests (conversations for multi-turn) to send (100)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s; inf sends all at once (inf)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens) (128)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request (128)")
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups (8)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix words")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns (4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--result-json", default=None, help="write the summary and settings here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=lambda args: asyncio.run(run_bench(args)))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(words, 1)))


def build_dataset(args) -> list[Conversation]:
    rng = random.Random(args.seed)
    if args.dataset == "random":
        return [Conversation([_text(rng, args.input_len)]) for _ in range(args.num_prompts)]
    if args.dataset == "shared-prefix":
        prefixes = [_text(rng, args.prefix_len) for _ in range(args.num_groups)]
        return [
            Conversation([f"{prefixes[i % args.num_groups]} {_text(rng, args.input_len)}"])
            for i in range(args.num_prompts)
        ]
    return [
        Conversation([_text(rng, args.input_len) for _ in range(args.num_turns)])
        for _ in range(args.num_prompts)
    ]


async def one_request(client, args, messages: list[dict]) -> RequestResult:
    import httpx

    body: dict = {
        "model": args.model,
        "max_tokens": args.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    if args.endpoint == "chat":
        url = "/v1/chat/completions"
        body["messages"] = messages
    else:
        url = "/v1/completions"
        body["prompt"] = "\n".join(m["content"] for m in messages)
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                for choice in data.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                    result.reply += piece
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = repr(e)
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = last is not None
    if not result.ok:
        result.error = "no output"
    return result


async def run_bench(args) -> int:
    import httpx

    conversations = build_dataset(args)
    embeddings = args.endpoint == "embeddings"
    if embeddings:  # one request per batch of inputs (the batch is its one "turn")
        from pagefleet.fleet.bench_embeddings import embed_request, embedding_batches

        batches = embedding_batches(conversations, args.batch_size)
        conversations = [Conversation([batch]) for batch in batches]
    limit = asyncio.Semaphore(args.max_concurrency or len(conversations) * args.num_turns)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: list[RequestResult] = []
    total = sum(len(c.turns) for c in conversations)
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="requests", dynamic_ncols=True)
    rng = random.Random(args.seed + 1)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url.rstrip("/"), headers=headers, timeout=timeout, limits=limits
    ) as client:

        async def converse(conv: Conversation) -> None:
            history: list[dict] = []
            for turn in conv.turns:
                history.append({"role": "user", "content": turn})
                async with limit:
                    if embeddings:
                        result = await embed_request(client, args, turn)
                    else:
                        result = await one_request(client, args, history)
                results.append(result)
                if bar is not None:
                    bar.update(1)
                if not result.ok:
                    return
                history.append({"role": "assistant", "content": result.reply})

        start = time.perf_counter()
        tasks = []
        for conv in conversations:
            tasks.append(asyncio.ensure_future(converse(conv)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    summary = summarize(results, duration)
    print(format_summary(summary))
    if args.result_json:
        settings = {k: v for k, v in vars(args).items() if k != "func"}
        with open(args.result_json, "w") as f:
            json.dump({"settings": settings, "summary": summary}, f, indent=2, default=str)
    return 0 if summary["completed"] else 1


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(round(p / 100 * (len(ordered) - 1)), len(ordered) - 1)]

    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p90": pct(90),
        "p99": pct(99),
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": output / duration if duration else 0.0,
        "total_output_tokens": output,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "input_token_throughput": sum(r.prompt_tokens for r in ok) / duration if duration else 0.0,
        "total_embeddings": sum(r.embeddings for r in ok),
        "embedding_throughput": sum(r.embeddings for r in ok) / duration if duration else 0.0,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats(tpot),
        "itl_s": _stats([x for r in ok for x in r.itl]),
        "e2e_s": _stats([r.e2e for r in ok]),
    }


def format_summary(s: dict) -> str:
    lines = [
        "=" * 20 + " Serving Benchmark Result " + "=" * 20,
        f"{'Successful requests:':<40}{s['completed']}",
        f"{'Failed requests:':<40}{s['failed']}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:.2f}",
        f"{'Total output tokens:':<40}{s['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_token_throughput']:.2f}",
        f"{'Input token throughput (tok/s):':<40}{s['input_token_throughput']:.2f}",
    ]
    latencies = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL")]
    if s["total_embeddings"]:  # one answer per request: no token latencies
        lines.append(f"{'Embedding throughput (emb/s):':<40}{s['embedding_throughput']:.2f}")
        latencies = []
    for key, title in (*latencies, ("e2e_s", "E2E latency")):
        st = s[key]
        lines.append(
            f"{title + ' (ms) mean / median / p90 / p99:':<40}"
            f"{st['mean'] * 1e3:.1f} / {st['median'] * 1e3:.1f} / "
            f"{st['p90'] * 1e3:.1f} / {st['p99'] * 1e3:.1f}"
        )
    if s["errors"]:
        lines.append(f"{'Errors:':<40}{s['errors']}")
    return "\n".join(lines)
