"""Speculative decoding (n-gram, draft model) against none: output tokens/s, forwards and
acceptance.

Float32 on CPU (2 threads), greedy, ignore_eos, each pair of runs in this process, alternated
(none, ngram, none, ngram; best of two each) so that machine load hits both sides alike.
  (a) copy-heavy on the 57M-parameter checkpoint of offline_throughput.py: prompts quoting a
      passage. Its weights are random: its output copies nothing, so almost no draft is
      accepted and the ratio measures what speculating costs when it does not pay.
  (b) a looping model: the tests' tiny Llama (write_tiny_checkpoint's default shape), whose
      greedy output falls into loops the proposer predicts: what accepted drafts save.
A trained model quoting its prompt sits between the two; docs/benchmarks.md has the figures.
The draft_model rows use a 2-layer draft of the same tokenizer: the target's own first two
layers with its embeddings, final norm and head (an early-exit draft; a separately trained
2-layer model would agree with a random target on nothing).

    .venv/bin/python benchmarks/spec_decode.py [--threads 2] [--requests 8] [--workloads ab]
        [--methods ngram,draft_model]

Wall-clock ratios swing with the load of a shared machine; the ratio per CPU second (this
process's) is the steadier figure there.
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
from offline_throughput import SHAPE
from safetensors.torch import load_file, save_file

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.client import EngineObserver, StepStats
from pagefleet.engine.model.tiny import write_tiny_checkpoint

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


class _Steps(EngineObserver):
    def __init__(self) -> None:
        self.steps = 0

    def on_step(self, stats: StepStats) -> None:
        self.steps += 1


def run(path: str, prompts: list[list[int]], concurrency: int, spec: dict | None) -> dict:
    llm = LLM(
        path,
        max_model_len=512,
        max_num_seqs=concurrency,
        num_gpu_blocks_override=64 * concurrency,
        speculative_config=spec,
    )
    steps = _Steps()
    llm.engine.subscribe(steps)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    steps.steps = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "tok_s": tokens / seconds,
        "tok_cpu_s": tokens / cpu_seconds,
        "steps": steps.steps,
        "tokens": tokens,
    }
    counters = llm.engine.spec_counters
    if counters is not None:
        s = counters.snapshot()
        result.update(
            acceptance=s.acceptance_rate,
            mean_len=s.mean_accepted_length,
            per_pos=s.accepted_per_pos,
            drafts=s.num_drafts,
        )
    result["outputs"] = [o.outputs[0].token_ids for o in outs]
    return result


def compare(path: str, prompts: list[list[int]], concurrency: int, method: str, draft: str) -> str:
    runs: dict[str, list[dict]] = {"none": [], method: []}
    for _ in range(2):
        runs["none"].append(run(path, prompts, concurrency, None))
        runs[method].append(run(path, prompts, concurrency, method_config(method, draft)))
    none = max(runs["none"], key=lambda r: r["tok_s"])
    spec = max(runs[method], key=lambda r: r["tok_s"])
    assert spec["outputs"] == none["outputs"], "greedy output changed with speculation"
    none_cpu = max(r["tok_cpu_s"] for r in runs["none"])
    spec_cpu = max(r["tok_cpu_s"] for r in runs[method])
    return (
        f"concurrency {concurrency}: none {none['tok_s']:.1f} tok/s ({none['steps']} forwards), "
        f"{method} {spec['tok_s']:.1f} tok/s ({spec['steps']} forwards), "
        f"ratio {spec['tok_s'] / none['tok_s']:.2f}x wall, {spec_cpu / none_cpu:.2f}x per "
        f"CPU second; acceptance {spec['acceptance']:.1%}, "
        f"mean accepted length {spec['mean_len']:.2f}, accepted per position "
        f"{list(spec['per_pos'])} over {spec['drafts']} drafts"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--workloads", default="ab", help="a, b or ab")
    parser.add_argument("--methods", default="ngram,draft_model", help="ngram and/or draft_model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        big = str(write_tiny_checkpoint(Path(tmp) / "57m", "LlamaForCausalLM", **SHAPE))
        tiny = str(write_tiny_checkpoint(Path(tmp) / "tiny", "LlamaForCausalLM"))
        for name, path, prompts in (
            ("(a) 57M, copy-heavy", big, copy_heavy(args.requests)),
            ("(b) looping tiny model", tiny, looping(args.requests)),
        ):
            if name[1] not in args.workloads:
                continue
            draft = early_exit_draft(path, Path(tmp) / f"draft-{name[1]}")
            for method in args.methods.split(","):
                for concurrency in (1, 8):
                    line = compare(path, prompts, concurrency, method, draft)
                    print(f"{name}, {line}", flush=True)


def looping(n: int, seed: int = 1) -> list[list[int]]:
    """Short repetitive prompts in the tiny model's vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(2, 6))] * 6 for _ in range(n)]


if __name__ == "__main__":
    main()
