"""Speculative decoding (n-gram, draft model) against none: output tokens/s, inter-token
latency, forwards and acceptance.

Float32 on CPU, greedy, ignore_eos; each pair of runs in this process, alternated (none, spec,
none, spec; best of two each by tokens/s) so that machine load hits both sides alike. The
checkpoint has the 57M-parameter shape of offline_throughput.py, built to copy its context
(copying_model.py: an induction circuit in two layers, the other six zero, so a forward costs
what the random checkpoint's does; a random checkpoint quotes nothing and no draft of it is
ever accepted). The draft is its first two layers with its embeddings, norm and head (an
early-exit draft of the same tokenizer), so here it agrees with the target almost always:
the draft rows measure the machinery at near-full acceptance.
  (a) copy-heavy: a passage, some filler, then the passage again with 5% of tokens edited, cut
      half-way: the continuation quotes the prompt.
  (b) chat-like: random prompts that nothing quotes: what speculating costs when it misses.
ITL is the gap between a request's successive outputs divided over the tokens each brought
(vLLM's way), p50/p90 over every token of the run.

    .venv/bin/python benchmarks/spec_decode.py [--threads 2] [--workloads ab]
        [--methods ngram,draft_model] [--concurrency 1,8,64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from copying_model import write_copying_checkpoint
from offline_throughput import SHAPE
from safetensors.torch import load_file, save_file

from pagefleet.engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
DRAFT_LAYERS = 2
OUTPUT_TOKENS = 96


def method_config(method: str, draft: str) -> dict:
    if method == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}


def early_exit_draft(target: str, dest: Path, num_layers: int = DRAFT_LAYERS) -> str:
    """A copy of the checkpoint at `target` keeping only its first `num_layers` layers."""
    shutil.copytree(target, dest)
    config_file = dest / "config.json"
    config = json.loads(config_file.read_text())
    config["num_hidden_layers"] = num_layers
    config_file.write_text(json.dumps(config))
    for file in dest.glob("*.safetensors"):
        kept = {
            name: w
            for name, w in load_file(file).items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
        }
        save_file(kept, file, metadata={"format": "pt"})
    return str(dest)


def copy_heavy(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of a passage, some filler, then the passage again with a few tokens edited."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        passage = [rng.randrange(10, 32000) for _ in range(rng.randint(48, 160))]
        edited = [t if rng.random() > 0.05 else rng.randrange(10, 32000) for t in passage]
        filler = [rng.randrange(10, 32000) for _ in range(rng.randint(8, 32))]
        prompts.append(passage + filler + edited[: len(edited) // 2])
    return prompts


def chat_like(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 32000) for _ in range(rng.randint(32, 256))] for _ in range(n)]


def run(path: str, prompts: list[list[int]], concurrency: int, spec: dict | None) -> dict:
    llm = LLM(
        path,
        max_model_len=512,
        max_num_seqs=concurrency,
        num_gpu_blocks_override=64 * concurrency,
        speculative_config=spec,
    )
    engine = llm.engine
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    order = [engine.add_request(None, p, params) for p in prompts]
    seen: dict[str, tuple[float, int]] = {}  # request -> (time of its last output, tokens)
    itl: list[float] = []
    final: dict[str, list[int]] = {}
    steps = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for out in outs:
            tokens = len(out.outputs[0].token_ids)
            last, had = seen.get(out.request_id, (now, tokens))
            if tokens > had:
                itl.extend([(now - last) / (tokens - had)] * (tokens - had))
            seen[out.request_id] = (now, tokens)
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    total = sum(len(t) for t in final.values())
    itl.sort()
    result = {
        "tok_s": total / seconds,
        "tok_cpu_s": total / cpu_seconds,
        "steps": steps,
        "itl_p50_ms": 1e3 * itl[len(itl) // 2],
        "itl_p90_ms": 1e3 * itl[int(len(itl) * 0.9)],
        "outputs": [final[rid] for rid in order],
    }
    counters = engine.spec_counters
    if counters is not None:
        s = counters.snapshot()
        result.update(
            acceptance=s.acceptance_rate,
            mean_len=s.mean_accepted_length,
            per_pos=s.accepted_per_pos,
            drafts=s.num_drafts,
        )
    return result


def compare(
    path: str,
    prompts: list[list[int]],
    concurrency: int,
    method: str,
    draft: str,
    disable_by_batch_size: int | None = None,
) -> str:
    config = method_config(method, draft)
    if disable_by_batch_size is not None:
        config = {**config, "disable_by_batch_size": disable_by_batch_size}
    runs: dict[str, list[dict]] = {"none": [], method: []}
    for _ in range(2):
        runs["none"].append(run(path, prompts, concurrency, None))
        runs[method].append(run(path, prompts, concurrency, config))
    none = max(runs["none"], key=lambda r: r["tok_s"])
    spec = max(runs[method], key=lambda r: r["tok_s"])
    assert spec["outputs"] == none["outputs"], "greedy output changed with speculation"
    none_cpu = max(r["tok_cpu_s"] for r in runs["none"])
    spec_cpu = max(r["tok_cpu_s"] for r in runs[method])
    line = (
        f"concurrency {concurrency}: none {none['tok_s']:.1f} tok/s, ITL p50/p90 "
        f"{none['itl_p50_ms']:.1f}/{none['itl_p90_ms']:.1f} ms ({none['steps']} forwards); "
        f"{method} {spec['tok_s']:.1f} tok/s, ITL p50/p90 {spec['itl_p50_ms']:.1f}/"
        f"{spec['itl_p90_ms']:.1f} ms ({spec['steps']} forwards); "
        f"ratio {spec['tok_s'] / none['tok_s']:.2f}x wall, {spec_cpu / none_cpu:.2f}x per "
        f"CPU second"
    )
    if spec["drafts"]:
        line += (
            f"; acceptance {spec['acceptance']:.1%}, mean accepted length "
            f"{spec['mean_len']:.2f}, accepted per position {list(spec['per_pos'])} over "
            f"{spec['drafts']} drafts"
        )
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", default="ab", help="a, b or ab")
    parser.add_argument("--methods", default="ngram,draft_model", help="ngram and/or draft_model")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="pass to the config (default: the engine's own; a draft model on CPU pauses at 8)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_copying_checkpoint(Path(tmp) / "57m-copying", **SHAPE))
        draft = early_exit_draft(path, Path(tmp) / "draft")
        for name, make in (("(a) copy-heavy", copy_heavy), ("(b) chat-like", chat_like)):
            if name[1] not in args.workloads:
                continue
            for method in args.methods.split(","):
                for concurrency in map(int, args.concurrency.split(",")):
                    prompts = make(max(8, concurrency))
                    line = compare(
                        path, prompts, concurrency, method, draft, args.disable_by_batch_size
                    )
                    print(f"{name}, {line}", flush=True)


if __name__ == "__main__":
    main()
