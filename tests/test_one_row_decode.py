"""Fused one-row decode layers (model/one_row_decode.py): single-stream decode runs each layer
as one compiled call and still gives HF's greedy output for every dense family; every step it
does not cover (a LoRA wrapper, an fp8 pool, several rows) runs the layers op by op."""

from __future__ import annotations

import pytest
import torch

from conftest import full_prefix_hit_step
from hf_reference import ARCH_CASES, assert_greedy_equal
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.cpu_choice.decide import Timed
from pagefleet.engine.cpu_choice.measure import CACHE_FILE, TimingCache
from pagefleet.engine.model import one_row_decode
from pagefleet.engine.model.loader import load_model
from pagefleet.engine.model.one_row_decode import OneRowDecoder, fusable_layers, in_huge_pages

CPU = torch.device("cpu")
TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
# Lengths across block edges (block 16): a one-token prompt, one a token short of a block, one
# filling two blocks, one past three.
PROMPTS = [[7], list(range(20, 35)), list(range(100, 132)), list(range(300, 350))]
# The in-place attention kernel, which the fused layers run (auto picks it where it measures
# faster; an explicit torch backend keeps its own one-row steps).
NUMBA = {"attention_backend": "numba", "num_gpu_blocks_override": 64, "max_model_len": 128}


@pytest.fixture
def fused_steps(monkeypatch) -> list[int]:
    """Rows of each step the fused layers ran."""
    steps: list[int] = []
    run = OneRowDecoder.__call__

    def counted(self, x, *args):
        steps.append(x.shape[0])
        return run(self, x, *args)

    monkeypatch.setattr(OneRowDecoder, "__call__", counted)
    return steps


@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_single_stream_runs_fused_layers_and_equals_hf(tiny_checkpoints, arch, fused_steps):
    """One sequence at a time: every decode step is one row. llama (rope scaling), mistral
    (one KV head), qwen2 (q/k/v bias, tied embeddings), qwen3 (q/k norm, head_dim apart)."""
    path = tiny_checkpoints[arch]
    llm = LLM(path, max_num_seqs=1, **NUMBA)
    assert llm.engine.runner.model.one_row_decoder is not None
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, TOKENS)
    # Every token after each prompt's first (its prefill) came from a fused step, and the
    # one-token prompt's prefill too.
    assert fused_steps == [1] * (len(PROMPTS) * (TOKENS - 1) + 1)


def test_o_and_mlp_biases_run_fused_and_equal_hf(tmp_path, fused_steps):
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    extra = {"attention_bias": True, "mlp_bias": True}
    path = str(write_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", **extra))
    llm = LLM(path, max_num_seqs=1, **NUMBA)
    outs = llm.generate(PROMPTS[1:3], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS[1:3], outs, strict=True):
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, TOKENS)
    assert len(fused_steps) == 2 * (TOKENS - 1)


def test_contexts_cut_into_runs_of_blocks_merge_to_hf(tiny_checkpoints, fused_steps, monkeypatch):
    """A long context on several threads is cut into runs of blocks, each a work item of the
    parallel kernel, merged after (numba_paged.context_parts); forced here on short ones, so
    the runs are a few blocks and some hold none."""
    path = tiny_checkpoints["llama"]
    cuts = []

    def cut_in_five(rows, kv_heads, threads, blocks):
        cuts.append(blocks)
        return 5

    monkeypatch.setattr(one_row_decode, "context_parts", cut_in_five)
    llm = LLM(path, max_num_seqs=1, **NUMBA)
    outs = llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS[2:], outs, strict=True):
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, TOKENS)
    assert fused_steps and min(cuts) == 3 and max(cuts) == 5  # tables of 3 to 5 blocks


def test_a_full_prefix_hit_recomputes_its_last_token_fused_without_writing(
    tiny_checkpoints, fused_steps
):
    llm = LLM(tiny_checkpoints["llama"], **NUMBA)
    out, _, first_token = full_prefix_hit_step(llm)
    pool = llm.engine.runner.kv_pool
    before = pool.clone()
    fused_steps.clear()
    logits, _, _ = llm.engine.runner.execute(out)
    assert fused_steps == [1]
    assert torch.equal(pool, before), "the step wrote into the pool"
    assert int(logits[0].argmax()) == first_token


def test_an_fp8_pool_a_torch_backend_and_batches_run_the_layers_op_by_op(
    tiny_checkpoints, fused_steps
):
    path = tiny_checkpoints["llama"]
    fp8 = LLM(path, kv_cache_dtype="fp8", max_num_seqs=1, **NUMBA)
    fp8.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert fused_steps == []
    reference = LLM(path, max_num_seqs=1, **(NUMBA | {"attention_backend": "torch"}))
    out = reference.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    assert_greedy_equal(path, PROMPTS[0], out.outputs[0].token_ids, TOKENS)
    assert fused_steps == []
    batch = LLM(path, **NUMBA)
    outs = batch.generate(PROMPTS[1:3], GREEDY, use_tqdm=False)  # same length: two rows a step
    for prompt, out in zip(PROMPTS[1:3], outs, strict=True):
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, TOKENS)
    assert fused_steps == []


def test_torch_attention_chosen_by_measurement_still_fuses_one_row(
    tiny_checkpoints, tmp_path, monkeypatch, fused_steps
):
    """Where `auto` measured torch's gather faster (for batches), a single stream still runs
    fused, attending on the in-place kernel; `--attention-backend torch` named by the flag
    does not (the previous test)."""
    path = tiny_checkpoints["llama"]
    model = load_model(path, torch.float32, CPU, 64, linear_path="plain")
    subject = model.decode_shape(16, torch.float32).subject()
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path))
    faster_torch = {"torch": 1e-5, "numba": 3e-5}
    TimingCache(tmp_path / CACHE_FILE).put(
        subject, [Timed(f"rows={r}", dict(faster_torch)) for r in (1, 16, 64)]
    )
    llm = LLM(path, max_num_seqs=1, **(NUMBA | {"attention_backend": "auto"}))
    assert llm.engine.runner.backend.name == "torch"
    out = llm.generate(PROMPTS[2:3], GREEDY, use_tqdm=False)[0]
    assert_greedy_equal(path, PROMPTS[2], out.outputs[0].token_ids, TOKENS)
    assert fused_steps == [1] * (TOKENS - 1)


def test_a_wrapped_linear_takes_the_step_back_to_the_layers(tiny_checkpoints, fused_steps):
    """A LoRA wrapper (or any module) put in a linear's place after loading, or a weight
    given new storage: the fused layers would skip the one and read the other's old copy, so
    the step runs op by op."""
    path = tiny_checkpoints["llama"]
    llm = LLM(path, max_num_seqs=1, **NUMBA)
    attn = llm.engine.runner.model.layers[0].self_attn
    attn.o_proj.weight.data = attn.o_proj.weight.detach().clone()
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    assert_greedy_equal(path, PROMPTS[0], out.outputs[0].token_ids, TOKENS)
    assert fused_steps == []
    llm = LLM(path, max_num_seqs=1, **NUMBA)
    mlp = llm.engine.runner.model.layers[1].mlp
    calls = []

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append(x.shape[0])
            return self.inner(x)

    mlp.down_proj = Wrapper(mlp.down_proj)
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    assert_greedy_equal(path, PROMPTS[0], out.outputs[0].token_ids, TOKENS)
    assert fused_steps == [] and calls.count(1) == TOKENS


@pytest.fixture(scope="module")
def quantized_ggufs(tmp_path_factory) -> dict[str, str]:
    """A tiny Qwen2 (tied embeddings, q/k/v biases) as a Q8_0 and a Q4_1 GGUF file, each
    in its own folder (transformers reads a GGUF from its folder)."""
    from gguf import GGMLQuantizationType as T

    from gguf_files import write_gguf_of
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("quantized-gguf")
    hf = write_tiny_checkpoint(root / "hf", "Qwen2ForCausalLM", tie_word_embeddings=True)
    files = {}
    for qtype in ("Q8_0", "Q4_1"):
        (root / qtype).mkdir()
        files[qtype] = str(write_gguf_of(hf, root / qtype / "model.gguf", T[qtype]))
    return files


def _transformers_on(gguf_file: str):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    file = Path(gguf_file)
    return AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_a_quantized_gguf_decodes_fused_on_its_codes_as_transformers_picks(
    quantized_ggufs, qtype, fused_steps
):
    """Single-stream decode of a quantized file runs each layer as one call on its codes a
    byte each (quant/row_codes.py: the dequantized weight's float32 product), and a Q8_0
    token embedding's logits on its own codes. Transformers on the same file (it dequantizes
    it), fed our tokens, picks each as its top-1 or within a near-tie of it: the prompt
    steps still take tinygemm's bfloat16 activations (tests/test_quantization.py's
    criterion; here one tie of 0.005 nats fell the other way)."""
    path = quantized_ggufs[qtype]
    llm = LLM(path, max_num_seqs=1, **NUMBA)
    model = llm.engine.runner.model
    assert model.one_row_decoder is not None
    head_codes = model.one_row_decoder.head_codes
    assert (head_codes is not None) == (qtype == "Q8_0")  # Q4_1's embedding is 4-bit
    if head_codes is not None:
        assert model.lm_head.one_row == head_codes.one_row
    outs = llm.generate(PROMPTS[1:3], GREEDY, use_tqdm=False)
    assert fused_steps == [1] * (2 * (TOKENS - 1))
    theirs = _transformers_on(path)
    agree = 0
    for prompt, out in zip(PROMPTS[1:3], outs, strict=True):
        ours = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = theirs(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
        for row, token in zip(logits.log_softmax(-1), ours, strict=True):
            agree += int(row.argmax()) == token
            assert (row.max() - row[token]).item() <= 0.05
    assert agree >= 0.9 * 2 * TOKENS


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantized_layers_fuse_on_their_own_codes_and_a_head_copy_within_the_budget(
    quantized_ggufs, qtype
):
    """The fused layers read the codes the kernels keep (no copy: the weight bytes do not
    move); the LM head's 8-bit codes are a copy beside the float embedding, made only
    within the budget for second copies and then counted with the weights."""
    from pagefleet.engine.model.linear import weight_bytes

    model = load_model(quantized_ggufs[qtype], torch.float32, CPU, 64, linear_path="plain")
    assert fusable_layers(model) == list(model.layers)
    assert one_row_decode.fusable_shapes(model) == frozenset()  # no float weight to plan
    before = weight_bytes(model)
    decoder = OneRowDecoder.build(model, budget=0, coded_head=True)
    assert decoder is not None and decoder.head_codes is None
    assert weight_bytes(model) == before
    model.fuse_one_row_layers(budget=1 << 30, coded_head=True)
    head = model.one_row_decoder.head_codes
    if qtype == "Q4_1":
        assert head is None and weight_bytes(model) == before  # a 4-bit embedding
    else:
        assert weight_bytes(model) == before + head.nbytes()


def test_a_bfloat16_quantized_model_loads_without_fused_layers(quantized_ggufs):
    """The fused kernel is float32's: a bfloat16 model's quantized linears stay op by op."""
    model = load_model(quantized_ggufs["Q8_0"], torch.bfloat16, CPU, 64, linear_path="auto")
    assert fusable_layers(model) == [] and model.one_row_decoder is None


@pytest.mark.parametrize("breaks", ["tensor-parallel", "quantized", "other-family"])
def test_layers_that_are_not_plain_dense_float_are_not_fused(tiny_checkpoints, breaks):
    model = load_model(tiny_checkpoints["llama"], torch.float32, CPU, 64, linear_path="plain")
    assert fusable_layers(model) == list(model.layers)
    if breaks == "tensor-parallel":
        model.tp = object()
    elif breaks == "quantized":
        model.layers[-1].self_attn.o_proj.method = object()
    else:
        model.layers[0].one_row_fusable = False
    assert fusable_layers(model) == []
    assert one_row_decode.fusable_shapes(model) == frozenset()
    assert OneRowDecoder.build(model) is None


def test_moving_weights_into_one_array_keeps_values_and_ties(tiny_checkpoints):
    model = load_model(tiny_checkpoints["qwen2"], torch.float32, CPU, 64, linear_path="plain")
    assert model.lm_head.weight is model.embed_tokens.weight  # tied
    params = [model.embed_tokens.weight, model.layers[0].self_attn.qkv_proj.weight]
    before = [p.detach().clone() for p in params]
    in_huge_pages(params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    first, second = (p.data_ptr() for p in params)
    assert second - first >= before[0].numel() * 4 and first % 64 == second % 64 == 0
    ids = torch.tensor([3, 9])
    assert torch.equal(model.embed_tokens(ids), before[0][ids])


@pytest.mark.parametrize("tamper", ["slot", "table", "context"])
def test_a_step_out_of_the_pools_bounds_is_refused_before_the_kernel(tiny_checkpoints, tamper):
    """The kernel writes and reads the pool unchecked: a slot past the pool, a table naming a
    block it does not have, or a context longer than the table raise instead."""
    llm = LLM(tiny_checkpoints["llama"], **NUMBA)
    engine = llm.engine
    engine.add_request("one", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    engine.step()  # the prompt
    inputs = engine.runner.prepare(engine.scheduler.schedule())
    meta, pool = inputs.meta, engine.runner.kv_pool
    group = meta.single_groups[0]
    if tamper == "slot":
        meta.slot_mapping[0] = pool.shape[3] * pool.shape[4]
    elif tamper == "table":
        group.block_tables[0, 0] = pool.shape[3]
    else:
        group.seq_lens[0] = group.block_tables.shape[1] * pool.shape[4] + 1
    before = pool.clone()
    with pytest.raises(ValueError, match="out of the pool's bounds"):
        engine.runner.hidden_states(inputs)
    assert torch.equal(pool, before)
