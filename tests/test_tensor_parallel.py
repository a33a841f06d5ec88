"""Tensor parallelism: greedy output of a TP=2 engine (two ranks, gloo, on CPU) equals the TP=1
engine's token for token and HF transformers' in float32, for every architecture we load (GQA
split, replicated KV heads, tied embeddings and q/k/v biases, Qwen3 q/k norm), across chunked
prefill, preemption and prefix-cache hits; the step broadcast and the shard layout on their own;
and `pagefleet serve --tensor-parallel-size 2` end to end."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from test_model_equivalence import GREEDY, check_all, prompts_of_varied_lengths

from hf_reference import ARCH_CASES, randomise_biases
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.distributed.step_codec import decode_step, encode_step
from pagefleet.engine.model.parallel import TPLayout
from pagefleet.engine.model.registry import model_config
from ray_nodes import RAY_ENV
from server_utils import metric_value, running_server

# Ray joins any Ray cluster it finds on the machine: these run beside no other Ray test.
pytestmark = pytest.mark.machine_wide

# Small enough to preempt (9 blocks of 16 for 8 prompts of up to 57 tokens: measured 4
# preemptions) and to chunk prompts (32 tokens a step, shared by the prompts).
TIGHT = {
    "num_gpu_blocks_override": 9,
    "max_model_len": 140,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 32,
}


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _run_paths(llm: LLM, path: str | None) -> dict:
    """Varied prompts through a tight pool (chunked prefill and preemption), then a prompt of
    two full blocks twice (a prefix hit, the second time a full one); with `path`, each output
    is checked against HF's."""
    engine = llm.engine
    prompts = prompts_of_varied_lengths(8)
    varied = llm.generate(prompts, GREEDY, use_tqdm=False)
    preemptions = engine.scheduler.num_preemptions
    shared = [list(range(300, 332))]
    first = llm.generate(shared, GREEDY, use_tqdm=False)
    again = llm.generate(shared, GREEDY, use_tqdm=False)
    if path is not None:
        check_all(path, prompts, varied)
        check_all(path, shared, again)
    return {
        "varied": _tokens(varied),
        "prefix": _tokens(first) + _tokens(again),
        "preemptions": preemptions,
        "cached": again[0].num_cached_tokens,
    }


@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_tp2_greedy_equals_tp1_and_hf(tiny_checkpoints, arch):
    """Catches a wrong shard (q/k/v or gate/up slices, KV-head replication when KV heads <
    ranks, a bias added twice by a row-parallel layer, the vocabulary split and its padding),
    a worker whose KV pool falls out of step with rank 0's block ids (preemption, prefix hits,
    chunked prefill reuse them), and a broadcast that loses part of a step."""
    path = tiny_checkpoints[arch]
    one = _run_paths(LLM(path, **TIGHT), None)  # TP=1 equals HF: test_model_equivalence
    llm = LLM(path, tensor_parallel_size=2, **TIGHT)
    try:
        cfg = llm.engine.model_config
        assert llm.engine.runner.kv_pool.shape[2] == max(1, cfg.num_kv_heads // 2)
        two = _run_paths(llm, path)
    finally:
        llm.engine.close()
    assert two["preemptions"] > 0, "the pool did not force preemption"
    assert two["cached"] == 32, "the second run of the prompt was not a full prefix hit"
    assert two["varied"] == one["varied"]
    assert two["prefix"] == one["prefix"]


def test_tp2_over_ray_actors_equals_tp1_on_every_scheduling_path(tiny_checkpoints, monkeypatch):
    """The same paths with rank 1 as a Ray actor (the engine's private local cluster): the
    executor changes where ranks run, never what they compute. Mistral's one KV head is
    replicated on both ranks."""
    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = tiny_checkpoints["mistral"]
    one = _run_paths(LLM(path, **TIGHT), None)
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **TIGHT)
    try:
        assert type(llm.engine.runner.executor).__name__ == "RayExecutor"
        two = _run_paths(llm, path)
    finally:
        llm.engine.close()
    assert two["preemptions"] > 0 and two["cached"] == 32
    assert (two["varied"], two["prefix"]) == (one["varied"], one["prefix"])


def test_tp2_biased_model_logprobs_equal_tp1(tmp_path):
    """The gathered logits rows: prompt-logprob rows ride with the sampled rows in one gather;
    a row mixed up or a vocabulary slice out of order changes these numbers. The checkpoint
    biases o_proj and down_proj, which a row-parallel layer must add once, not once per rank."""
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(
        tmp_path / "biased", "LlamaForCausalLM", attention_bias=True, mlp_bias=True
    )
    randomise_biases(path / "model.safetensors")  # HF initialises them to zero
    path = str(path)
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    prompts = prompts_of_varied_lengths(4)
    want = LLM(path, num_gpu_blocks_override=64, max_model_len=256).generate(
        prompts, params, use_tqdm=False
    )
    llm = LLM(path, tensor_parallel_size=2, num_gpu_blocks_override=64, max_model_len=256)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.close()
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys()
            for token in x:
                assert abs(x[token].logprob - y[token].logprob) < 1e-4
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()


def test_step_broadcast_round_trip(tiny_checkpoints):
    """What the workers rebuild from the broadcast equals what rank 0 prepared, for a step
    holding a decode row, a full-prefix-hit row (not written) and a prompt chunk."""
    llm = LLM(tiny_checkpoints["llama"], num_gpu_blocks_override=64, max_model_len=256)
    engine = llm.engine
    cached = list(range(40, 72))  # two full blocks
    llm.generate([cached], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    engine.add_request("decoding", list(range(100, 120)), SamplingParams(max_tokens=8))
    engine.step()
    engine.add_request("hit", cached, SamplingParams(max_tokens=2))
    engine.add_request("chunk", list(range(200, 240)), SamplingParams(max_tokens=2))
    out = engine.scheduler.schedule()
    assert sorted(n for _, n in out.scheduled) == [1, 1, 40]
    inputs = engine.runner.prepare(out)
    assert inputs.meta.write_rows is not None, "no row skipped its write"
    rows = [*inputs.sample_rows, 5, 6]
    head, body = encode_step(inputs.input_ids, inputs.positions, inputs.meta, rows)
    assert head.tolist()[1] == len(body)
    ids, positions, meta, logit_rows = decode_step(body, head.tolist()[2], 16)
    want = inputs.meta
    assert torch.equal(ids, inputs.input_ids) and torch.equal(positions, inputs.positions)
    assert torch.equal(meta.slot_mapping, want.slot_mapping)
    assert torch.equal(meta.write_rows, want.write_rows)
    assert meta.num_single == want.num_single == 2
    assert logit_rows.tolist() == rows
    for a, b in zip(meta.single_groups, want.single_groups, strict=True):
        assert (a.start, a.end) == (b.start, b.end)
        assert torch.equal(a.block_tables, b.block_tables) and torch.equal(a.mask, b.mask)
        assert torch.equal(a.seq_lens, b.seq_lens)  # the numba kernel's bound, not the mask's
    for a, b in zip(meta.prefills, want.prefills, strict=True):
        assert (a.start, a.num_tokens, a.num_computed) == (b.start, b.num_tokens, b.num_computed)
        assert torch.equal(a.block_ids, b.block_ids)


def _config(heads: int, kv_heads: int, intermediate: int = 128, vocab: int = 509):
    return model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 4), (8, 2), (8, 1), (16, 2)])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_each_rank_holds_the_kv_heads_its_q_heads_read(heads, kv_heads, size):
    """vLLM's split: KV heads divided over ranks, or replicated when fewer than ranks (each
    rank then holds the one its q heads share); every q head of a rank reads a KV head of that
    rank, and the vocabulary slices cover it exactly once."""
    cfg = _config(heads, kv_heads)
    layouts = [TPLayout.of(cfg, rank, size) for rank in range(size)]
    per_group = heads // kv_heads
    for t in layouts:
        for q in range(t.rank * t.num_heads, (t.rank + 1) * t.num_heads):
            assert t.first_kv_head <= q // per_group < t.first_kv_head + t.num_kv_heads
    held = [h for t in layouts for h in range(t.first_kv_head, t.first_kv_head + t.num_kv_heads)]
    assert sorted(set(held)) == list(range(kv_heads))
    assert len(held) == max(kv_heads, size)  # replicas only where needed
    vocab = [v for t in layouts for v in range(t.vocab_start, t.vocab_end)]
    assert vocab == list(range(cfg.vocab_size))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "size", "what"),
    [
        (6, 6, 128, 4, "attention heads"),
        (8, 8, 130, 4, "intermediate_size"),
        (12, 3, 120, 2, "KV heads"),
        (12, 6, 120, 4, "KV heads"),
    ],
)
def test_sizes_the_model_does_not_split_into_are_refused(heads, kv_heads, intermediate, size, what):
    with pytest.raises(ValueError, match=f"--tensor-parallel-size {size} .*{what}"):
        TPLayout.of(_config(heads, kv_heads, intermediate), 0, size)


def test_serve_tp2_output_health_and_metrics(tiny_checkpoints):
    """`pagefleet serve --tensor-parallel-size 2`: the OpenAI API answers TP=1's greedy text,
    health is 200 and the engine's metrics count the request."""
    path = tiny_checkpoints["qwen3"]
    prompt = "Tell me about the river and the mountain."
    want = (
        LLM(path, num_gpu_blocks_override=256, max_model_len=256)
        .generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    with running_server(path, "--tensor-parallel-size", "2", timeout=180) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
        assert httpx.get(f"{base}/health").status_code == 200
        assert metric_value(base, "vllm:request_success_total", {"finished_reason": "length"}) >= 1
        assert metric_value(base, "vllm:generation_tokens_total") >= 16
        blocks = {"num_gpu_blocks": "256", "block_size": "16"}
        assert metric_value(base, "vllm:cache_config_info", blocks) == 1


# A script as users write them: no `if __name__ == "__main__":` guard, no close at the end.
_TRITON_TP2 = """
import json, sys
from pagefleet.engine import LLM, SamplingParams
path, engine_args, prompts, params = sys.argv[1], *map(json.loads, sys.argv[2:])
llm = LLM(path, tensor_parallel_size=2, attention_backend="triton", **engine_args)
assert type(llm.engine.runner.backend).__name__ == "TritonAttentionBackend"
outs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_tp2_with_the_triton_backend_equals_tp1(tiny_checkpoints, tmp_path):
    """The Triton attention backend on each rank's KV heads (kernels interpreted on CPU, in a
    child process so TRITON_INTERPRET reaches both ranks and no other test): the same greedy
    tokens as TP=1 with the torch backend. Catches a kernel or its metadata assuming the
    model's full head counts. The child is a script file with no `__main__` guard that ends
    without closing the engine (issue 37): it must neither die in multiprocessing's bootstrap
    (rank 1 importing the script again) nor call its normal exit an engine failure."""
    import json
    import os
    import subprocess
    import sys

    path = tiny_checkpoints["qwen3"]
    engine_args = {"num_gpu_blocks_override": 64, "max_model_len": 128}
    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    prompts = prompts_of_varied_lengths(4)
    want = _tokens(
        LLM(path, **engine_args).generate(prompts, SamplingParams(**params), use_tqdm=False)
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    args = [json.dumps(engine_args), json.dumps(prompts), json.dumps(params)]
    script = tmp_path / "tp2_script.py"
    script.write_text(_TRITON_TP2)
    done = subprocess.run(
        [sys.executable, str(script), path, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine failed" not in done.stderr, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want
