"""Quantized weights before and after: one row per format on a trained model, on CPU.

The model: SmolLM2-135M-Instruct, the demo model's Q4_1 GGUF (`pagefleet up` serves it),
dequantized once by transformers into a float32 checkpoint: the float32 row and the source
every other row is quantized from by the project's reference quantizer
(engine/model/quant/reference.py: round-to-nearest; groups of 64, since 576 columns do not
split into 128s). Rows: float32, bf16 (--dtype bfloat16), fp8 (compressed-tensors FP8 W8A8,
per channel, dynamic), fp8 quantized at load (--quantization fp8), int8 (compressed-tensors
INT8 W8A8), int4 GPTQ, int4 AWQ, GGUF Q8_0 (written from the float32 checkpoint) and GGUF Q4_1
(the file as shipped: its float32 row is its own dequantization, so the others are measured
against a Q4_1 model). Per row, measured in this run against float32:

- weight bytes (the engine's count: kernels' layouts, float embeddings and LM head included),
  and the decoder linears' alone;
- offline decode-heavy throughput (N requests of P prompt tokens, O output tokens, greedy,
  ignore_eos), output tokens per second: the best of --rounds rounds, the rows taking turns
  round by round (every row's engine loaded at once: a few GB for all the rows) so a
  neighbour's burst or the host's drift falls on all of them, each round on prompts of its own
  and the warm-up on two others (no prefix-cache hits); the load average is the best round's;
- lm-evaluation-harness accuracy on benchmarks/lm_eval/pagefleet_facts (121 four-way
  questions), through an lm-eval `LM` over the engine's prompt logprobs;
- per-token agreement with float32: float32's greedy outputs fed back (teacher forcing), the
  share of positions where the row's top-1 is float32's token.

    .venv/bin/python benchmarks/quantization.py [--work DIR] [--rows float32,int4-gptq,...]
        [--requests 8] [--prompt-tokens 32] [--output-tokens 128] [--rounds 3] [--threads 2]
        [--no-eval] [--eval-limit N]
    .venv/bin/python benchmarks/quantization.py --kernels   # the CPU kernels per shape class

--kernels times each CPU kernel against oneDNN's float32 GEMM on the model's shapes at 1, 8
and 64 rows (the evidence behind quant/cpu_kernels.py's choices).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

from pagefleet.common.demo_model import cache_dir, ensure_demo_model
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model.linear import Linear, weight_bytes
from pagefleet.engine.model.quant.reference import Spec, write_quantized

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import cpu_model

ROOT = Path(__file__).resolve().parents[1]
GROUP = 64
ROWS = {  # name -> (checkpoint kind, engine args)
    "float32": ("float", {}),
    "bf16": ("float", {"dtype": "bfloat16"}),
    "fp8": ("fp8", {}),
    "fp8-online": ("float", {"quantization": "fp8"}),
    "int8": ("int8", {}),
    "int4-gptq": ("gptq", {}),
    "int4-awq": ("awq", {}),
    "gguf-q8_0": ("gguf-q8_0", {}),
    "gguf-q4_1": ("gguf-q4_1", {}),
}
SPECS = {
    "fp8": Spec("ct-fp8"),
    "int8": Spec("ct-int8"),
    "gptq": Spec("gptq", 4, GROUP, symmetric=True),
    "awq": Spec("awq", 4, GROUP, symmetric=False),
}


# ---------------------------------------------------------------- the model


def trained_float_checkpoint(work: Path) -> Path:
    """SmolLM2-135M-Instruct as a float32 HF checkpoint (made once in `work`) from the demo
    model's GGUF (fetched once into pagefleet's cache, as `make up` does)."""
    dest = work / "smollm2-f32"
    if (dest / "model.safetensors").is_file():
        return dest
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = ensure_demo_model(cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    dest.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_word_embeddings
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("dtype", None)
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(dest)
    return dest


def gguf_checkpoint(work: Path, kind: str) -> Path:
    """The demo model's own Q4_1 file, or a Q8_0 one written from the float checkpoint with
    the `gguf` library's quantizer (tests/gguf_files.py, as llama.cpp's converter writes)."""
    if kind == "gguf-q4_1":
        return ensure_demo_model(cache_dir())
    dest = work / "smollm2-q8_0.gguf"
    if not dest.is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from gguf import GGMLQuantizationType

        from gguf_files import write_gguf_of

        write_gguf_of(trained_float_checkpoint(work), dest, GGMLQuantizationType.Q8_0)
    return dest


def checkpoint(work: Path, kind: str) -> Path:
    if kind.startswith("gguf"):
        return gguf_checkpoint(work, kind)
    src = trained_float_checkpoint(work)
    if kind == "float":
        return src
    dest = work / f"smollm2-{kind}"
    if not (dest / "model.safetensors").is_file():
        write_quantized(src, dest, SPECS[kind])
    return dest


# ---------------------------------------------------------------- measurements


def linear_bytes(model) -> int:
    return sum(
        m.weight_bytes()
        for n, m in model.named_modules()
        if isinstance(m, Linear) and n.startswith("layers.")
    )


def prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    """Chat prompts of real text, cut to `length` tokens: n different facts questions."""
    tokenizer = llm.get_tokenizer()
    facts = (ROOT / "benchmarks/lm_eval/pagefleet_facts.jsonl").read_text().splitlines()
    if n > len(facts):
        raise SystemExit(f"{n} prompts asked for; there are {len(facts)} different questions")
    out = []
    for i in range(n):
        question = json.loads(facts[i * 7 % len(facts)])["question"]  # 7 and 121 coprime
        text = f"Answer in detail and explain your reasoning step by step. {question} " * 4
        out.append(tokenizer.encode(text)[:length])
    return out


def decode_throughput(
    llm: LLM, batch: list[list[int]], output_tokens: int, warm: list[list[int]] | None = None
) -> tuple[float, list]:
    """Output tokens per second of `batch`, after a short warm-up on `warm` (other prompts,
    so no prompt of the batch is in the prefix cache before it is timed)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    if warm:
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(batch) * output_tokens / elapsed, [o.outputs[0].token_ids for o in outputs]


def agreement(llm: LLM, batch: list[list[int]], reference: list[list[int]]) -> float:
    """Share of float32's output tokens that are this engine's top-1, fed float32's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    seqs = [p + r for p, r in zip(batch, reference, strict=True)]
    outputs = llm.generate(seqs, params, use_tqdm=False)
    agree = total = 0
    for prompt, ref, out in zip(batch, reference, outputs, strict=True):
        for pos, token in enumerate(ref, start=len(prompt)):
            total += 1
            agree += out.prompt_logprobs[pos][token].rank == 1
    return agree / total


def facts_accuracy(llm: LLM, limit: int | None = None) -> dict[str, float]:
    """lm-evaluation-harness on pagefleet_facts (its first `limit` questions when given),
    scoring through this engine."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    class EngineLM(LM):
        def loglikelihood(self, requests):
            tokenizer = llm.get_tokenizer()
            seqs, spans = [], []
            for request in requests:
                context, continuation = request.args
                whole = tokenizer.encode(context + continuation)
                ctx = tokenizer.encode(context)
                if whole[: len(ctx)] != ctx:  # the boundary merged: encode them apart
                    whole = ctx + tokenizer.encode(continuation)
                seqs.append(whole)
                spans.append(len(ctx))
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
            results = []
            for seq, start, out in zip(
                seqs, spans, llm.generate(seqs, params, use_tqdm=False), strict=True
            ):
                rows = [out.prompt_logprobs[i][seq[i]] for i in range(start, len(seq))]
                results.append((sum(r.logprob for r in rows), all(r.rank == 1 for r in rows)))
            return results

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            raise NotImplementedError

    manager = TaskManager(include_path=str(ROOT / "benchmarks/lm_eval"))
    cwd = os.getcwd()
    os.chdir(ROOT)  # the task's data path is relative to the repository root
    try:
        result = lm_eval.simple_evaluate(
            model=EngineLM(),
            tasks=["pagefleet_facts"],
            task_manager=manager,
            limit=limit,
            verbosity="ERROR",
        )
    finally:
        os.chdir(cwd)
    scores = result["results"]["pagefleet_facts"]
    return {"acc": scores["acc,none"], "acc_norm": scores["acc_norm,none"]}


def load_row(name: str, work: Path, args) -> dict:
    """A row's engine, its weight bytes and the requests of each round."""
    kind, engine_args = ROWS[name]
    path = checkpoint(work, kind)
    start = time.perf_counter()
    llm = LLM(str(path), num_gpu_blocks_override=512, max_model_len=1024, **engine_args)
    row = {"row": name, "load_s": time.perf_counter() - start, "llm": llm, "rates": []}
    model = llm.engine.runner.model
    row["weights_bytes"], row["linear_bytes"] = weight_bytes(model), linear_bytes(model)
    row["format"] = model.weights_format
    n = args.requests
    every = prompts(llm, n * args.rounds + 2, args.prompt_tokens)
    row["warm"] = every[-2:]
    row["batches"] = [every[r * n : (r + 1) * n] for r in range(args.rounds)]
    row["batch"] = row["batches"][0]
    return row


def measure_rounds(rows: list[dict], args) -> None:
    """Each row's throughput, rows in turn round by round; the first round's outputs kept."""
    for r in range(args.rounds):
        for row in rows:
            warm = row["warm"] if r == 0 else None
            rate, outputs = decode_throughput(
                row["llm"], row["batches"][r], args.output_tokens, warm
            )
            if rate > row.get("tokens_per_s", 0.0):
                row["tokens_per_s"], row["loadavg"] = rate, os.getloadavg()[0]
            row["rates"].append(rate)
            row.setdefault("outputs", outputs)


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        "| row | format | weights MiB | x float32 | linears x float32 | decode tok/s | x float32 "
        "| facts acc | acc_norm | agreement | load avg |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acc = f"{100 * r['acc']:.1f}" if "acc" in r else "-"
        norm = f"{100 * r['acc_norm']:.1f}" if "acc_norm" in r else "-"
        lines.append(
            f"| {r['row']} | {r['format']} | {r['weights_bytes'] / 2**20:.1f} "
            f"| {r['weights_bytes'] / base['weights_bytes']:.3f} "
            f"| {r['linear_bytes'] / base['linear_bytes']:.3f} | {r['tokens_per_s']:.1f} "
            f"| {r['tokens_per_s'] / base['tokens_per_s']:.2f} | {acc} | {norm} "
            f"| {100 * r['agreement']:.1f}% | {r['loadavg']:.1f} |"
        )
    return "\n".join(lines)


def run_rows(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    names = args.rows.split(",")
    if names[0] != "float32":
        names.insert(0, "float32")
    rows = [load_row(name, work, args) for name in names]
    measure_rounds(rows, args)
    reference = rows[0]
    for row in rows:
        row["agreement"] = agreement(row["llm"], reference["batch"], reference["outputs"])
        if not args.no_eval:
            row.update(facts_accuracy(row["llm"], args.eval_limit))
        rates = ", ".join(f"{rate:.1f}" for rate in row["rates"])
        print(f"{table(rows[: rows.index(row) + 1]).splitlines()[-1]}  rounds: {rates}", flush=True)
    for row in rows:
        row["llm"].engine.close()
        del row["llm"]
    gc.collect()
    print(f"\n{cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    print(
        f"{args.requests} requests x {args.prompt_tokens} prompt + {args.output_tokens} output "
        f"tokens, greedy, ignore_eos, best of {args.rounds} rounds; "
        f"facts questions scored: {args.eval_limit or 'all'}\n"
    )
    print(table(rows))


# ---------------------------------------------------------------- the kernels per shape


def time_call(fn, repeat: int = 5, number: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def shape_kernels(k: int, n: int, gen: torch.Generator) -> dict:
    """Every CPU kernel on one (in, out) shape: name -> call(x)."""
    from pagefleet.engine.model.quant.cpu_int8 import OneDnnInt8MatMul
    from pagefleet.engine.model.quant.cpu_kernels import CpuIntKernel
    from pagefleet.engine.model.quant.int_weight import IntWeight
    from pagefleet.engine.model.quant.kernels import Fp8MatMul, Int8MatMul
    from pagefleet.engine.model.quant.packing import pack_codes

    def int_weight(bits: int, group: int) -> IntWeight:
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
        scales = torch.rand(n, k // group, generator=gen)
        return IntWeight(pack_codes(codes, bits), bits, scales, -scales, group, k)

    int8_codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w8a8 = Int8MatMul(int8_codes, torch.rand(n), None)
    w8a8_onednn = OneDnnInt8MatMul(int8_codes, torch.rand(n), None)
    w8a8_nibbles = OneDnnInt8MatMul(int8_codes, torch.rand(n), None, signed=False)
    fp8 = Fp8MatMul(torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn), torch.rand(n), None)
    return {
        "int4 g64": CpuIntKernel(int_weight(4, GROUP)),
        "int8 channel": CpuIntKernel(int_weight(8, k)),
        "int8 g64 (2 planes)": CpuIntKernel(int_weight(8, GROUP)),
        "int8 W8A8 _int_mm": lambda x: w8a8(x, None),
        "int8 W8A8 oneDNN": lambda x: w8a8_onednn(x, None),
        "int8 W8A8 oneDNN nibbles": lambda x: w8a8_nibbles(x, None),
        "fp8 _scaled_mm": lambda x: fp8(x, None),
    }


def run_kernels(args) -> None:
    from pagefleet.engine.model.packed import pack_weight, packed_linear

    gen = torch.Generator().manual_seed(0)
    print(f"{cpu_model()}, torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    names = list(shape_kernels(64, 16, gen))
    print("| shape | rows | float32 oneDNN us | " + " | ".join(names) + " |")
    print("|---|---:|---:|" + "---:|" * len(names))
    for shape, (k, n) in SHAPES.items():
        packed = pack_weight(torch.randn(n, k, generator=gen))
        kernels = shape_kernels(k, n, gen)
        for rows in (1, 8, 64):
            x = torch.randn(rows, k, generator=gen)
            base = time_call(functools.partial(packed_linear, x, packed))
            cells = []
            for name, kernel in kernels.items():
                slow = name.startswith("fp8")  # CPU _scaled_mm is slow: fewer calls
                took = time_call(functools.partial(kernel, x), 2 if slow else 5, 1 if slow else 10)
                cells.append(f"{base / took:.2f}x")
            print(f"| {shape} {k}x{n} | {rows} | {base * 1e6:.0f} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(Path.home() / ".cache/pagefleet/quantization"))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row, in turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-eval", action="store_true", help="skip lm-evaluation-harness")
    parser.add_argument(
        "--eval-limit", type=int, help="score the first N questions only (a loaded machine)"
    )
    parser.add_argument("--kernels", action="store_true", help="time the CPU kernels instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernels:
        run_kernels(args)
    else:
        run_rows(args)


if __name__ == "__main__":
    main()
