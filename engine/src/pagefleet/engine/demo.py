"""The demo main job: `LLM.generate` on the tiny local checkpoint, and a stand-in-model run.

`run_llm_demo` serves chat prompts that share a system prompt through the real engine. The
stand-in run drives only the scheduler and KV cache with the stand-in model of
engine/simulated.py, so runs are reproducible and the scheduling, prefix caching and
preemption are the real ones.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from pagefleet.engine.config import CacheConfig, SchedulerConfig
from pagefleet.engine.request import Request
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import Scheduler
from pagefleet.engine.simulated import STAND_IN_VOCAB as VOCAB
from pagefleet.engine.simulated import run_step


@dataclass
class DemoReport:
    requests: int
    steps: int
    prompt_tokens: int
    output_tokens: int
    prefix_hit_rate: float
    preemptions: int
    peak_usage: float
    cached_free_blocks: int
    seconds: float


def shared_prefix_workload(
    num_requests: int, num_groups: int, prefix_len: int, seed: int, block_size: int = 16
) -> list[Request]:
    """Users in groups sharing a system prompt, each with its own question."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(num_groups)]
    requests = []
    for i in range(num_requests):
        suffix = [rng.randrange(VOCAB) for _ in range(rng.randint(8, 96))]
        params = SamplingParams(max_tokens=rng.randint(8, 128))
        prompt = prefixes[i % num_groups] + suffix
        requests.append(Request(f"req-{i}", prompt, params, block_size=block_size))
    return requests


def run_demo(
    num_requests: int = 64,
    num_groups: int = 4,
    prefix_len: int = 256,
    num_blocks: int = 96,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    seed: int = 0,
) -> DemoReport:
    sched = Scheduler.create(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=2048,
        ),
        CacheConfig(block_size=16, num_gpu_blocks=num_blocks),
    )
    requests = shared_prefix_workload(num_requests, num_groups, prefix_len, seed)
    start = time.perf_counter()
    steps = 0
    peak = 0.0
    pending = list(reversed(requests))
    while pending or sched.has_unfinished():
        # Two arrivals per step: requests join while others decode.
        for _ in range(2):
            if pending:
                sched.add_request(pending.pop())
        out = sched.schedule()
        peak = max(peak, sched.kv_cache.usage)
        run_step(sched, out, VOCAB)
        steps += 1
    kv = sched.kv_cache
    return DemoReport(
        requests=sum(1 for r in requests if r.status.finished),
        steps=steps,
        prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        output_tokens=sum(r.num_output_tokens for r in requests),
        prefix_hit_rate=kv.prefix_cache_hits / max(kv.prefix_cache_queries, 1),
        preemptions=sched.num_preemptions,
        peak_usage=peak,
        cached_free_blocks=kv.num_cached_free_blocks,
        seconds=time.perf_counter() - start,
    )


DEMO_QUESTIONS = [
    "What is a KV cache?",
    "Why does prefix caching help chat?",
    "Tell me about the river and the mountain.",
    "Write a short poem about blocks.",
]


def run_llm_demo(model_path: str, max_tokens: int = 24) -> str:
    """Generate for a few chats with one system prompt; returns a printable report."""
    from pagefleet.engine.llm import LLM
    from pagefleet.engine.sampling_params import SamplingParams

    llm = LLM(model_path, kv_cache_memory=0.25, max_model_len=1024)
    system = {"role": "system", "content": "You are a helpful assistant. " * 6}
    chats = [[system, {"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    # The first chat fills the cache with the system prompt; the others then hit it.
    outputs = llm.chat(chats[:1], params, use_tqdm=False)
    outputs += llm.chat(chats[1:], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    kv = llm.engine.scheduler.kv_cache
    lines = [f"pagefleet demo: LLM.generate on {model_path}"]
    for question, out in zip(DEMO_QUESTIONS, outputs, strict=True):
        completion = out.outputs[0]
        lines.append(f"  user: {question}")
        lines.append(
            f"  model ({len(completion.token_ids)} tokens, {completion.finish_reason}): "
            f"{completion.text!r}"
        )
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    lines.append(
        f"  {tokens} tokens in {seconds:.2f} s; prefix-cache hits "
        f"{kv.prefix_cache_hits}/{kv.prefix_cache_queries} prompt tokens (the shared system "
        f"prompt); KV pool {kv.num_blocks} blocks"
    )
    return "\n".join(lines)


def format_report(r: DemoReport) -> str:
    return "\n".join(
        [
            "pagefleet demo: scheduler + paged KV cache, stand-in model (no weights)",
            f"  requests finished      {r.requests} in {r.steps} steps ({r.seconds * 1e3:.0f} ms)",
            f"  prompt / output tokens {r.prompt_tokens} / {r.output_tokens}",
            f"  prefix-cache hit rate  {r.prefix_hit_rate:.1%} of prompt tokens",
            f"  preemptions            {r.preemptions}",
            f"  peak KV usage          {r.peak_usage:.1%} of blocks",
            f"  cached free blocks     {r.cached_free_blocks} (reusable, not counted as usage)",
        ]
    )
