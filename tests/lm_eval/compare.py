"""Run lm-evaluation-harness twice on the same checkpoint and compare per-choice log-likelihoods:
`--model local-completions` against `pagefleet serve`, and its in-process `hf` backend.

    .venv/bin/pip install 'lm_eval[api]==0.4.13' accelerate   # dev tools, not dependencies
    .venv/bin/python tests/lm_eval/compare.py [--model DIR] [--work DIR]

Without --model it writes a tiny random Llama checkpoint. Prints every choice's two values and
exits 1 if any pair differs by more than --tolerance (float32 noise). Results: docs/testing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BIN = Path(sys.executable).parent
TASK = "pagefleet_mc"


def lm_eval(model: str, model_args: str, out: Path, env: dict) -> list[dict]:
    command = [
        str(BIN / "lm_eval"),
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASK,
        "--include_path",
        str(HERE),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
    ]
    if model == "hf":
        command += ["--device", "cpu"]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, env=env)
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def loglikelihoods(samples: list[dict]) -> dict[tuple[int, int], float]:
    return {
        (s["doc_id"], i): float(resp[0][0]) for s in samples for i, resp in enumerate(s["resps"])
    }


def serve(model: str, port: int, env: dict, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [str(BIN / "pagefleet"), "serve", model, "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "tiny", "--dtype", "float32"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagefleet serve exited {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("pagefleet serve did not become healthy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: a tiny one)")
    parser.add_argument("--work", default="/tmp/pagefleet-lm-eval", help="outputs go here")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from pagefleet.engine.model.tiny import write_tiny_checkpoint

        model = str(write_tiny_checkpoint(work / "llama", "LlamaForCausalLM"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    from pagefleet.up import free_port

    port = free_port()
    proc = serve(model, port, env, work / "serve.log")
    try:
        served = lm_eval(
            "local-completions",
            f"model=tiny,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={model},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
            work / f"served-{time.time_ns()}",
            env,
        )
    finally:
        proc.kill()
        proc.wait()
    reference = lm_eval(
        "hf", f"pretrained={model},dtype=float32", work / f"hf-{time.time_ns()}", env
    )
    ours, theirs = loglikelihoods(served), loglikelihoods(reference)
    assert ours.keys() == theirs.keys(), "the two runs scored different choices"
    print("| doc | choice | local-completions (pagefleet) | hf | difference |")
    print("|----:|-------:|------------------------------:|---:|-----------:|")
    worst = 0.0
    for key in sorted(ours):
        diff = abs(ours[key] - theirs[key])
        worst = max(worst, diff)
        print(f"| {key[0]} | {key[1]} | {ours[key]:.6f} | {theirs[key]:.6f} | {diff:.2e} |")
    acc = [sum(s["acc"] for s in run) / len(run) for run in (served, reference)]
    print(f"\n{len(ours)} choices; max |difference| {worst:.2e}; acc {acc[0]:.3f} vs {acc[1]:.3f}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
