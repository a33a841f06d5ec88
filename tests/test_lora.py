"""Multi-LoRA in one engine: each adapter's greedy output equals transformers + peft, a step
mixing adapters and the base model equals each run alone, no step runs more than --max-loras
adapters, the prefix cache never shares a block across adapters, and an adapter that cannot
run is refused with the reason. One engine (two slots, three adapters) serves the cases."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from lora_adapters import assert_peft_greedy_equal, write_adapter, write_adapters
from safetensors.torch import load_file, save_file

from conftest import make_request, make_scheduler
from pagefleet.common.block_hash import hash_blocks, lora_extra_keys
from pagefleet.engine import LLM, LoRARequest, SamplingParams
from pagefleet.engine.lora.adapter import (
    AdapterError,
    AdapterNotFound,
    AdapterOutsideRoot,
    check_adapter,
    resolve_under_root,
)
from pagefleet.engine.lora.layers import lora_targets
from pagefleet.engine.lora.ops import GatheredKernels, LoRABatch, SegmentKernels
from pagefleet.engine.model.checkpoint import read_config
from pagefleet.engine.model.registry import family_of

MAX_TOKENS = 10
PROMPTS = {  # per model: lengths off and on block edges (16), one chunked over several steps
    None: list(range(3, 40)),
    "sql": [7, 8, 9] * 11,
    "chat": list(range(50, 98)),
    "math": list(range(100, 113)),
}


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    return write_adapters(tiny_checkpoints["llama"], tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def llm(tiny_checkpoints, adapters):
    """Two slots for three adapters: steps must wait for a slot and slots must be reused;
    a small step budget splits prompts into chunks that share steps with decodes."""
    engine = LLM(
        tiny_checkpoints["llama"],
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=2,
        lora_modules=[f"{n}={adapters[n]}" for n in ("sql", "chat", "math")],
        num_gpu_blocks_override=128,
        max_model_len=256,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    yield engine
    engine.engine.close()


def lora(name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, 0, "")


def generate(llm, prompts, names) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([list(p) for p in prompts], params, False, [lora(n) for n in names])
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def alone(llm):
    return {name: generate(llm, [prompt], [name])[0] for name, prompt in PROMPTS.items()}


def test_each_adapter_alone_equals_transformers_peft(tiny_checkpoints, adapters, alone):
    base = tiny_checkpoints["llama"]
    for name, prompt in PROMPTS.items():
        adapter = adapters[name] if name else None
        assert_peft_greedy_equal(base, adapter, prompt, alone[name], MAX_TOKENS)
    # Every adapter changes the output (else the tests above could not see one ignored).
    assert len({tuple(tokens) for tokens in alone.values()}) == len(PROMPTS)


def test_a_step_mixing_three_adapters_and_the_base_equals_each_alone(llm, alone):
    """Fails for: rows given another row's slot (a gather or scatter in the wrong order),
    a slot reused while a request still runs with it, or more adapters in a step than slots
    (the manager refuses such a step)."""
    manager = llm.engine.lora
    seen: list[set[str]] = []
    activate = manager.activate

    def recording(names):
        seen.append(set(names))
        return activate(names)

    manager.activate = recording
    loads = manager.counters.slot_loads
    try:
        names = [None, "sql", "chat", "math", "sql", None]
        outs = generate(llm, [PROMPTS[n] for n in names], names)
    finally:
        del manager.activate
    assert outs == [alone[n] for n in names]
    assert max(len(s) for s in seen) == 2  # two adapters shared steps, never three
    assert manager.counters.slot_loads > loads  # the third adapter took a slot in turn
    assert len(manager._cpu) <= 2  # --max-cpu-loras


def test_prefix_cache_never_shares_blocks_across_adapters(llm, alone):
    """Blocks are keyed by the adapter's name exactly as the router hashes them: the same
    tokens under another adapter (or the base) hit nothing, under the same adapter hit."""
    prompt = PROMPTS["chat"]  # three full blocks
    kv = llm.engine.scheduler.kv_cache
    kv.reset_prefix_cache()
    hits = []
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name in ("chat", "sql", None, "chat"):
        out = llm.generate([list(prompt)], params, False, lora(name))[0]
        hits.append(out.num_cached_tokens)
    assert hits == [0, 0, 0, 48]
    assert out.outputs[0].token_ids == alone["chat"]
    cached = set(kv.pool.cached)
    by_model = {
        name: set(hash_blocks(prompt, 16, extra_keys=lora_extra_keys(name)))
        for name in ("chat", "sql", None)
    }
    for hashes in by_model.values():
        assert hashes <= cached
    assert not by_model["chat"] & by_model["sql"] and not by_model["chat"] & by_model[None]


def test_tensor_parallel_ranks_compute_their_shards_of_each_adapter(
    tiny_checkpoints, adapters, alone
):
    """TP=2 with one slot: every adapter change is installed on both ranks (rank 1 reads its
    own shard: A's columns for o/down, B's rows for q/k/v and gate/up) and the row-parallel
    layers all-reduce the shrink. Equal to TP=1 (itself equal to transformers + peft)."""
    llm = LLM(
        tiny_checkpoints["llama"],
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        lora_modules=[f"sql={adapters['sql']}", f"chat={adapters['chat']}"],
        num_gpu_blocks_override=64,
        max_model_len=256,
    )
    try:
        names = [None, "sql", "chat", "math"]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        loras = [lora(n) for n in names[:3]] + [LoRARequest("math", 0, adapters["math"])]
        outs = llm.generate([PROMPTS[n] for n in names], params, False, loras)
        assert [list(o.outputs[0].token_ids) for o in outs] == [alone[n] for n in names]
        assert llm.engine.lora.counters.slot_loads == 3
    finally:
        llm.engine.close()


def test_scheduler_runs_at_most_max_loras_adapters_and_skips_past_a_blocked_one():
    sched = make_scheduler(max_loras=2, max_num_batched_tokens=64, max_num_seqs=8)
    names = ["a", "b", "c", None, "a", "c"]
    for i, name in enumerate(names):
        req = make_request(f"r{i}", [i + 1] * 5, max_tokens=3)
        req.lora_request = lora(name)
        sched.add_request(req)
    first = sched.schedule()
    admitted = [r.request_id for r, _ in first.scheduled]
    # "c" would be a third adapter: it waits, and the base request and "a" behind it go.
    assert admitted == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r5"]
    while sched.has_unfinished():
        out = sched.schedule()
        assert len({r.lora_name for r, _ in out.scheduled} - {None}) <= 2
        sched.update_from_output(out, [9] * len(out.scheduled))
    assert not sched.requests


@pytest.mark.parametrize("kernels", [SegmentKernels, GatheredKernels])
def test_batched_delta_equals_each_row_with_its_own_adapter(kernels):
    """The two CPU implementations against a loop over rows, with base rows, a slot no row
    uses and a slot whose adapter skips this layer (all zero weights)."""
    gen = torch.Generator().manual_seed(0)
    slots, width, n_in, n_out = 4, 6, 10, 7
    a = torch.randn(slots * width, n_in, generator=gen)
    b = torch.randn(n_out, slots * width, generator=gen)
    a[3 * width : 4 * width] = 0
    b[:, 3 * width : 4 * width] = 0
    present = [True, True, False, False]
    row_slots = [1, -1, 0, 1, 3, -1, 0, 0]
    x = torch.randn(len(row_slots), n_in, generator=gen)
    y = torch.randn(len(row_slots), n_out, generator=gen)
    expected = y.clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            s = slice(slot * width, (slot + 1) * width)
            expected[row] += b[:, s] @ (a[s] @ x[row])
    batch = LoRABatch.build(row_slots, x.device)
    t = kernels.shrink(x, a, batch, width, present)
    kernels.expand(t, b, batch, width, present, y)
    torch.testing.assert_close(y, expected)
    # One adapter on every row: the whole batch at once.
    batch = LoRABatch.build([1] * 3, x.device)
    assert batch.segments[0][1] is None
    y = torch.zeros(3, n_out)
    kernels.expand(kernels.shrink(x[:3], a, batch, width, present), b, batch, width, present, y)
    torch.testing.assert_close(y, x[:3] @ a[width : 2 * width].t() @ b[:, width : 2 * width].t())


# ---------------------------------------------------------------- adapters refused, and why


@pytest.fixture(scope="module")
def targets(llm):
    return llm.engine.lora.targets


def _copy(src: str, dst, config_edit=None, weights_edit=None) -> str:
    dst.mkdir()
    config = json.loads((Path(src) / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(
        json.dumps(config_edit(config) if config_edit else config)
    )
    weights = load_file(os.path.join(src, "adapter_model.safetensors"))
    save_file(weights_edit(weights) if weights_edit else weights, dst / "adapter_model.safetensors")
    return str(dst)


def test_adapters_that_cannot_run_are_refused_with_the_reason(
    adapters, targets, tiny_checkpoints, tmp_path
):
    def refused(path, match, error=AdapterError):
        with pytest.raises(error, match=match):
            check_adapter(path, targets, max_rank=8)

    refused(adapters["wide"], "rank 16 is above --max-lora-rank 8")
    refused(tmp_path / "nowhere", "is not a folder", AdapterNotFound)
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text("{}")
    (half / "adapter_model.bin").write_bytes(b"pickle")
    refused(half, "pickled adapter_model.bin is not loaded", AdapterNotFound)
    dora = _copy(adapters["sql"], tmp_path / "dora", lambda c: {**c, "use_dora": True})
    refused(dora, "DoRA")
    saved = _copy(adapters["sql"], tmp_path / "saved", lambda c: {**c, "modules_to_save": ["x"]})
    refused(saved, "modules_to_save")
    extra = _copy(
        adapters["sql"],
        tmp_path / "extra",
        weights_edit=lambda w: {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
    )
    refused(extra, "lm_head")
    other = write_adapter(
        tiny_checkpoints["qwen3"], tmp_path / "other", 0, r=4, target_modules=["q_proj"]
    )
    refused(other, "an adapter trained for another model")
    lonely = _copy(
        adapters["sql"],
        tmp_path / "lonely",
        weights_edit=lambda w: {
            k: v for k, v in w.items() if "layers.0.self_attn.q_proj.lora_B" not in k
        },
    )
    refused(lonely, "has lora_A only")


def _targets_of(path: str):
    """The LoRA targets of a checkpoint's model, built on the meta device (no weights)."""
    hf_config = read_config(path)
    family, arch = family_of(hf_config)
    cfg = family.config_from_hf(hf_config, arch)
    with torch.device("meta"):
        model = family.build(cfg, 64, None)
    return cfg, lora_targets(model, cfg)


def test_projections_outside_the_linear_seam_take_no_adapter(
    moe_checkpoints, hybrid_checkpoints, tmp_path
):
    """A MoE layer's experts and router, a linear-attention layer and a gated attention's
    query (its rows interleave each head's gate) are not LoRA targets; an adapter naming one
    is refused with the reason, as vLLM refuses modules a model does not support."""
    _, moe = _targets_of(moe_checkpoints["qwen3_moe"])  # layer 1 is dense (mlp_only_layers)
    assert {k for k in moe if ".mlp." in k} == {
        f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")
    }
    assert {f"model.layers.{i}.self_attn.{p}_proj" for i in range(3) for p in "qkvo"} <= set(moe)
    cfg, hybrid = _targets_of(hybrid_checkpoints["qwen3_5"])
    attention = {int(k.split(".")[2]) for k in hybrid if ".self_attn." in k}
    assert attention == set(cfg.kv_layer_indices) != set(range(cfg.num_layers))
    assert not [k for k in hybrid if k.endswith("q_proj")]
    assert {k.rsplit(".", 1)[1] for k in hybrid} == {"k_proj", "v_proj", "o_proj"} | {
        "gate_proj",
        "up_proj",
        "down_proj",
    }

    expert = tmp_path / "expert"
    expert.mkdir()
    (expert / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]})
    )
    module = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file(
        {
            f"{module}.lora_A.weight": torch.zeros(4, 64),
            f"{module}.lora_B.weight": torch.zeros(24, 4),
        },
        expert / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterError, match=r"experts\.0\.gate_proj.* not a projection .*experts"):
        check_adapter(expert, moe, max_rank=8)


def test_lora_over_a_quantized_base_or_the_pooling_runner_is_refused_at_start(tiny_checkpoints):
    args = {"enable_lora": True, "num_gpu_blocks_override": 16, "max_model_len": 64}
    with pytest.raises(ValueError, match="LoRA over a quantized base model is not supported"):
        LLM(tiny_checkpoints["llama"], quantization="fp8", **args)
    with pytest.raises(ValueError, match="generate runner only"):
        LLM(tiny_checkpoints["llama"], runner="pooling", convert="embed", **args)


def test_run_time_paths_stay_under_the_root(adapters, tmp_path):
    """Traversal, absolute paths and symlinks (of the folder or of one file) out of the root
    are refused before anything about the path's existence is said."""
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(adapters["sql"], root / "linked")  # a folder symlink out of the root
    partial = root / "partial"
    partial.mkdir()
    (partial / "adapter_config.json").write_text("{}")
    os.symlink(
        os.path.join(adapters["sql"], "adapter_model.safetensors"),
        partial / "adapter_model.safetensors",
    )
    inside = root / "inside"
    os.symlink(adapters["sql"], tmp_path / "real")
    (root / "inside").mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (inside / f).write_bytes((Path(adapters["sql"]) / f).read_bytes())
    for path in ("../real", str(tmp_path / "real"), "linked", "partial", "../../etc", "/etc"):
        with pytest.raises(AdapterOutsideRoot):
            resolve_under_root(root, path)
    with pytest.raises(AdapterNotFound):
        resolve_under_root(root, "missing")
    assert resolve_under_root(root, "inside") == inside.resolve()
    assert resolve_under_root(root, str(inside)) == inside.resolve()


def test_unloading_waits_for_the_adapters_requests_and_drops_its_blocks(llm, adapters, alone):
    """An adapter is unloaded only once no request runs with it, and the blocks keyed by its
    name go with it: an adapter loaded later under the same name never reads them."""
    engine = llm.engine
    generate(llm, [PROMPTS["math"] * 2], ["math"])  # leaves cached blocks keyed by "math"
    assert engine.scheduler.kv_cache.pool.cached
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("busy", PROMPTS["math"], params, lora_request=lora("math"))
    with pytest.raises(ValueError, match="1 request\\(s\\) in flight"):
        engine.remove_lora("math")
    engine.abort_request("busy")
    engine.remove_lora("math")
    assert "math" not in [a.lora_name for a in engine.list_loras()]
    assert not engine.scheduler.kv_cache.pool.cached
    with pytest.raises(KeyError):
        engine.remove_lora("math")
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("gone", PROMPTS["math"], params, lora_request=lora("math"))
    engine.add_lora(LoRARequest("math", 0, adapters["math"]))
    assert generate(llm, [PROMPTS["math"]], ["math"]) == [alone["math"]]


def test_run_time_loading_is_off_unless_asked_for(tiny_checkpoints, tmp_path):
    from fastapi.testclient import TestClient
    from test_server import _StubEngine

    from pagefleet.common.cli import build_parser
    from pagefleet.common.tokenizer import load_tokenizer
    from pagefleet.engine.server.app import ServerConfig, build_app
    from pagefleet.engine.server.serve import lora_updates_from

    app = build_app(_StubEngine(load_tokenizer(tiny_checkpoints["llama"])), ServerConfig("m"))
    with TestClient(app) as http:
        body = {"lora_name": "x", "lora_path": "/etc"}
        off = http.post("/v1/load_lora_adapter", json=body)
        assert off.status_code == 404 and "--allow-runtime-lora-updating" in off.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
        assert http.post("/v1/completions", json={"model": "x", "prompt": "hi"}).status_code == 404
    parse = build_parser().parse_args
    assert lora_updates_from(parse(["serve", "m"])) is None
    for flags, message in (
        (["--allow-runtime-lora-updating", "--lora-root", str(tmp_path)], "needs --enable-lora"),
        (["--enable-lora", "--allow-runtime-lora-updating"], "needs --lora-root"),
        (["--lora-root", str(tmp_path)], "only with --allow-runtime-lora-updating"),
    ):
        with pytest.raises(ValueError, match=message):
            lora_updates_from(parse(["serve", "m", *flags]))
    on = parse(
        [
            "serve",
            "m",
            "--enable-lora",
            "--allow-runtime-lora-updating",
            "--lora-root",
            str(tmp_path),
        ]
    )
    assert lora_updates_from(on).root == tmp_path.resolve()
