"""Embeddings throughput: pagefleet's pooling runner vs sentence-transformers' `encode`, and what
prefix affinity would buy a fleet of pooling engines.

One run, float32 on CPU (2 threads by default), one random Llama-style checkpoint of the 57M
shape of offline_throughput.py (hidden 512, intermediate 1536, 8 layers, 8 heads, 2 KV heads,
vocab 32000) with a sentence-transformers configuration (last-token pooling, Normalize: the
Qwen3-Embedding recipe). The same seeded texts (mixed lengths, 8-248 tokens) go to both sides
in calls of 1 (32 calls), 32 (2 calls) and 256 inputs (1 call):
`SentenceTransformer.encode(texts, batch_size=n)` (which sorts by length to pad little) against
`LLM.embed(texts)` (one prefill-only request per text, batched by the token budget). Both
give the same vectors (checked, cosine >= 0.9999); the ratio is embeddings (and tokens) per
second, pagefleet / sentence-transformers.

Routing: two pooling engines in one process and a shuffled stream of requests: 256 queries
that open with one of 4 instructions (Qwen3-Embedding's "Instruct: ... Query:" pattern), 8 a
request; then 8 documents' 200-token openings each followed by 8 different passages, 2 a
request (chunks carrying their document's header: where affinity can matter most). Each
request goes to the engine that holds its group's prefix (affinity) or alternately (load-only:
an even spread); the ratio is their throughputs, and the work ratio the prompt tokens the
engines computed (load-only / affinity: the same on any machine, whatever its load).

    .venv/bin/python benchmarks/embeddings.py [--threads 2] [--max-len 256] [--passes 1]
        [--part compare,routing]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from pagefleet.engine import LLM
from pagefleet.engine.model.tiny import write_tiny_checkpoint

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    vocab_size=32000,
)
WORDS = (
    "time person year way day thing world life hand part child eye place work week case point "
    "company number group problem fact cache block token page pool model request router engine "
    "queue memory answer river mountain light water"
).split()
INSTRUCTIONS = [
    "Given a web search query, retrieve relevant passages that answer the query",
    "Given a question, retrieve questions that are semantically equivalent",
    "Given a claim, find documents that refute the claim",
    "Retrieve the code snippet that solves the programming problem described",
]


def checkpoint(root: Path, max_len: int) -> str:
    path = write_tiny_checkpoint(root / "embed", "LlamaForCausalLM", **SHAPE)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{kind}"}
        for i, (where, kind) in enumerate(kinds)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": SHAPE["hidden_size"], "pooling_mode_lasttoken": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "2_Normalize").mkdir()
    bert = {"max_seq_length": max_len, "do_lower_case": False}
    (path / "sentence_bert_config.json").write_text(json.dumps(bert))
    return str(path)


def texts_of_lengths(tokenizer, lengths: list[int], seed: int, prefix: str = "") -> list[str]:
    """Texts of about these token counts (whole words, so a little over)."""
    rng = random.Random(seed)
    out = []
    for target in lengths:
        words = prefix.split()
        count = len(tokenizer.encode(" ".join(words)))
        while count < target:  # a word is 1-4 tokens here: add a quarter of what is missing
            words += [rng.choice(WORDS) for _ in range(max(1, (target - count) // 4))]
            count = len(tokenizer.encode(" ".join(words)))
        out.append(" ".join(words))
    return out


def best_of(fn, passes: int = 2) -> tuple[float, list]:
    """The fastest of `passes` runs of `fn()` in seconds, and its output."""
    best, out = float("inf"), None
    for _ in range(passes):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def compare(llm: LLM, st, texts: list[str], batch: int, passes: int) -> dict:
    """Both sides over `texts` in calls of `batch` inputs (warmed up on one call first)."""
    calls = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    tokenizer = llm.get_tokenizer()
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)

    def ours(calls=calls):
        return [o.outputs.data for call in calls for o in llm.embed(call, use_tqdm=False)]

    def theirs(calls=calls):
        encode = st.encode
        return [v for call in calls for v in encode(call, batch_size=batch, convert_to_tensor=True)]

    ours(calls[:1])  # warm-up both
    theirs(calls[:1])
    t_ours, got = best_of(ours, passes)
    t_theirs, want = best_of(theirs, passes)
    cosine = torch.nn.functional.cosine_similarity(torch.stack(got), torch.stack(want).float())
    return {
        "batch": batch,
        "texts": len(texts),
        "tokens": num_tokens,
        "pagefleet_emb_s": len(texts) / t_ours,
        "st_emb_s": len(texts) / t_theirs,
        "pagefleet_tok_s": num_tokens / t_ours,
        "st_tok_s": num_tokens / t_theirs,
        "ratio": t_theirs / t_ours,
        "min_cosine": float(cosine.min()),
    }


def routing(path: str, groups: list[list[str]], per_request: int) -> dict:
    """Two engines; the groups' inputs, `per_request` at a time in a shuffled order (a stream of
    API requests), each request to one engine: by group (affinity: a group's shared prefix
    stays on one engine) or alternately (load-only: the router's even spread). Returns each
    policy's embeddings per second and prefix-cache hit rate, and the ratio."""
    requests = [
        (g, group[i : i + per_request])
        for g, group in enumerate(groups)
        for i in range(0, len(group), per_request)
    ]
    random.Random(1).shuffle(requests)
    results = {}
    for policy in ("affinity", "load-only"):
        engines = [LLM(path, max_model_len=1024, kv_cache_memory=1) for _ in range(2)]
        for llm in engines:
            llm.embed(["warm up"], use_tqdm=False)
        start = time.perf_counter()
        for k, (g, inputs) in enumerate(requests):
            engines[g % 2 if policy == "affinity" else k % 2].embed(inputs, use_tqdm=False)
        elapsed = time.perf_counter() - start
        stats = [e.engine.stats() for e in engines]
        queried = sum(s.prefix_cache_queries for s in stats)
        hits = sum(s.prefix_cache_hits for s in stats)
        results[policy] = {
            "emb_s": round(sum(map(len, groups)) / elapsed, 3),
            "hit_rate": round(hits / queried, 4),
            "tokens_computed": queried - hits,  # the work, whatever the machine's load
        }
    affinity, spread = results["affinity"], results["load-only"]
    results["ratio"] = round(affinity["emb_s"] / spread["emb_s"], 3)
    results["work_ratio"] = round(spread["tokens_computed"] / affinity["tokens_computed"], 3)
    return results


def with_prefix(tokenizer, prefix: str, lengths: list[int], seed: int) -> list[str]:
    """Texts that open with `prefix` and go on for about `lengths` more tokens."""
    base = len(tokenizer.encode(prefix))
    return texts_of_lengths(tokenizer, [base + n for n in lengths], seed, prefix=prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=256, help="longest text (256)")
    parser.add_argument("--passes", type=int, default=1, help="timed passes, best kept (1)")
    parser.add_argument(
        "--part", choices=["compare", "routing", "compare,routing"], default="compare,routing"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp), args.max_len)
        llm = LLM(path, max_model_len=args.max_len, kv_cache_memory=1)
        st = SentenceTransformer(path, device="cpu")
        tokenizer = llm.get_tokenizer()
        rng = random.Random(0)
        lengths = [rng.randint(8, args.max_len - 8) for _ in range(256)]
        texts = texts_of_lengths(tokenizer, lengths, seed=1)
        # 32 calls of 1, 2 of 32, 1 of 256 texts (the same texts each time, by prefix).
        for batch, count in ((1, 32), (32, 64), (256, 256)) if "compare" in args.part else ():
            row = compare(llm, st, texts[:count], batch, args.passes)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
            )
        if "routing" in args.part:
            queries = [
                with_prefix(tokenizer, f"Instruct: {instruction} Query:",
                            [rng.randint(12, 40) for _ in range(64)], seed=2 + g)
                for g, instruction in enumerate(INSTRUCTIONS)
            ]  # fmt: skip
            result = routing(path, queries, 8)
            print("routing, 4 instructions x 64 queries, 8 a request:", json.dumps(result))
            documents = [
                with_prefix(tokenizer, texts_of_lengths(tokenizer, [200], seed=100 + g)[0],
                            [rng.randint(20, 50) for _ in range(8)], seed=10 + g)
                for g in range(8)
            ]  # fmt: skip
            result = routing(path, documents, 2)
            print("routing, 8 documents x 8 passages, 2 a request:", json.dumps(result))
    print(f"load average: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
