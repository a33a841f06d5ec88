"""The capacity arithmetic (pagefleet.common.capacity) and `pagefleet plan`: issue 19's
published figures reproduced exactly (they are the acceptance tests), through the module, the
cli's --json and the installed `pagefleet plan` command itself."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pagefleet.common.capacity import (
    GB,
    GpuBudget,
    ModelShape,
    Workload,
    admit,
    fit_workload,
    gpu_memory_bytes,
    kv_heads_per_rank,
    model_shape,
    plan_on_gpu,
    pool_of_blocks,
)
from pagefleet.common.cli import main

# Qwen2.5-7B's shape: 28 layers x 4 KV heads x head dim 128.
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
# Llama-3-8B's shape: 32 layers x 8 KV heads x head dim 128.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
# A Qwen3.5-27B-like hybrid: 64 layers, every 4th full attention (16), 4 KV heads x 256.
HYBRID_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": {
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "layer_types": [*["linear_attention"] * 3, "full_attention"] * 16,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    },
}
H100 = GpuBudget(gpu_memory_bytes("H100-80GB"), 0.92, 5 * GB)


def _write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bytes_per_token_and_block_of_a_28_layer_4_head_model():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    assert shape.kv_bytes_per_token("fp16") == 57_344
    assert shape.kv_bytes_per_block(16, "fp16") == 917_504
    plan = pool_of_blocks(shape, 5_625, kv_format="fp16")
    assert (plan.kv_blocks, plan.kv_tokens) == (5_625, 90_000)
    assert round(plan.kv_bytes / GB, 2) == 5.16


def test_eight_long_requests_fit_only_with_their_shared_prefix():
    """Without sharing 8 x 763 = 6,104 blocks (seven need 5,341: seven of eight fit in 5,625);
    with an exact 2,000-token shared prefix, 125 + 8 x 638 = 5,229 and all eight fit."""
    fit = fit_workload(Workload(8, 12_000, 200, 2_000), num_blocks=5_625)
    assert fit.blocks_needed == 6_104
    assert fit.blocks_per_request * 7 == 5_341
    assert fit.fit_at_once == 7
    assert (fit.shared_blocks, fit.blocks_per_request_shared) == (125, 638)
    assert fit.blocks_needed_shared == 5_229
    assert fit.fit_at_once_shared == 8


def test_plan_cli_reproduces_the_28_layer_figures(tmp_path, capsys):
    report = _plan_json(
        capsys,
        _write(tmp_path, QWEN25_7B),
        "--kv-cache-dtype",
        "fp16",
        "--num-gpu-blocks",
        "5625",
        "--requests",
        "8",
        "--prompt-tokens",
        "12000",
        "--output-tokens",
        "200",
        "--shared-prefix",
        "2000",
    )
    (row,) = report["plans"]
    assert (row["bytes_per_token"], row["bytes_per_block"]) == (57_344, 917_504)
    assert (row["kv_blocks"], row["kv_tokens"], round(row["kv_gb"], 2)) == (5_625, 90_000, 5.16)
    w = row["workload"]
    assert (w["blocks_needed"], w["fit_at_once"]) == (6_104, 7)
    assert (w["blocks_needed_shared"], w["fit_at_once_shared"]) == (5_229, 8)


def test_plan_cli_32_layer_8_head_model_needs_11_8_gb_for_90000_tokens(tmp_path, capsys):
    report = _plan_json(
        capsys, _write(tmp_path, LLAMA3_8B), "--kv-cache-dtype", "fp16", "--num-gpu-blocks", "5625"
    )
    (row,) = report["plans"]
    assert row["bytes_per_token"] == 131_072
    assert row["kv_tokens"] == 90_000
    assert round(row["kv_gb"], 1) == 11.8


# weights, KV -> weights GB, KV GB, KiB/token, KV tokens, sequences at 262,144 / 32,768 / 8,192
HYBRID_TABLE = {
    ("bf16", "bf16"): (54.0, 14.6, 64, 222_778, (0, 6, 27)),
    ("fp8", "bf16"): (27.0, 41.6, 64, 634_765, (2, 19, 77)),
    ("fp8", "fp8"): (27.0, 41.6, 32, 1_269_531, (4, 38, 154)),
    ("int4", "fp8"): (13.5, 55.1, 32, 1_681_518, (6, 51, 205)),
}


def test_hybrid_27b_on_one_80gb_gpu_counts_only_attention_layers():
    shape = ModelShape.from_hf_config(HYBRID_27B)
    assert (shape.num_layers, shape.num_attention_layers) == (64, 16)
    # 48 linear layers x (conv 3 x (2x16x128 + 48x128) + 48 x 128 x 128 state) x 2 bytes
    assert shape.linear_state_bytes_per_sequence == 48 * (3 * 10_240 + 786_432) * 2
    for (weights, kv), (w_gb, kv_gb, kib, tokens, seqs) in HYBRID_TABLE.items():
        plan = plan_on_gpu(
            shape, H100, weights_format=weights, kv_format=kv, num_parameters=27 * 10**9
        )
        assert round(plan.weights_bytes / GB, 1) == w_gb
        assert round(plan.kv_bytes / GB, 1) == kv_gb
        assert plan.bytes_per_token == kib * 1024
        assert plan.kv_tokens == tokens
        assert tuple(plan.sequences_at(c) for c in (262_144, 32_768, 8_192)) == seqs


HYBRID_ARGS = [
    "--gpu",
    "H100-80GB",
    "--weights",
    "bf16,fp8,int4",
    "--kv-cache-dtype",
    "bf16,fp8",
    "--gpu-memory-utilization",
    "0.92",
    "--overhead-gb",
    "5",
    "--params",
    "27e9",
]


def _check_hybrid_rows(report: dict) -> None:
    rows = {(r["weights_format"], r["kv_format"]): r for r in report["plans"]}
    assert len(rows) == 6  # every combination
    for key, (w_gb, kv_gb, kib, tokens, seqs) in HYBRID_TABLE.items():
        r = rows[key]
        assert (round(r["weights_gb"], 1), round(r["kv_gb"], 1)) == (w_gb, kv_gb)
        assert (r["kib_per_token"], r["kv_tokens"]) == (kib, tokens)
        assert tuple(r["sequences"][c] for c in ("262144", "32768", "8192")) == seqs


def test_plan_cli_reproduces_the_hybrid_table(tmp_path, capsys):
    _check_hybrid_rows(_plan_json(capsys, _write(tmp_path, HYBRID_27B), *HYBRID_ARGS))


def test_the_installed_pagefleet_plan_command_prints_the_table_and_json(tmp_path):
    """The `plan` entry point is registered: the real command, in its own process, answers the
    published hybrid table both ways (catches a subcommand the cli never loads)."""
    command = [str(Path(sys.executable).parent / "pagefleet"), "plan"]
    config = _write(tmp_path, HYBRID_27B)
    table = subprocess.run(
        [*command, config, *HYBRID_ARGS], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "16 attention layers of 64" in table and "linear-attention state" in table
    assert "1,269,531" in table and "4 / 38 / 154" in table and "222,778" in table
    out = subprocess.run(
        [*command, config, *HYBRID_ARGS, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    _check_hybrid_rows(json.loads(out))


def test_tensor_parallel_splits_kv_heads_and_weights():
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    assert shape.kv_bytes_per_token("bf16", tensor_parallel_size=2) == 131_072 // 2
    # More ranks than KV heads: each rank keeps a replica of one head.
    assert kv_heads_per_rank(8, 16) == 1
    assert shape.kv_bytes_per_token("bf16", tensor_parallel_size=16) == 131_072 // 8
    budget = GpuBudget(24 * GB)
    one = plan_on_gpu(shape, budget, weights_format="bf16", kv_format="bf16", num_parameters=8 * GB)
    two = plan_on_gpu(
        shape,
        budget,
        weights_format="bf16",
        kv_format="bf16",
        tensor_parallel_size=2,
        num_parameters=8 * GB,
    )
    assert two.weights_bytes == one.weights_bytes // 2 and two.kv_tokens > 2 * one.kv_tokens


def test_the_checkpoint_dtype_is_read_under_either_key_and_is_the_auto_format(tmp_path, capsys):
    """transformers >= 4.56 writes `dtype`, older ones `torch_dtype`; `auto` (the engine's
    default) plans at the checkpoint's dtype."""
    renamed = {k: v for k, v in QWEN25_7B.items() if k != "torch_dtype"} | {"dtype": "float32"}
    assert ModelShape.from_hf_config(renamed).dtype == "float32"
    report = _plan_json(
        capsys, _write(tmp_path, renamed), "--kv-cache-dtype", "auto", "--num-gpu-blocks", "1"
    )
    assert report["plans"][0]["bytes_per_token"] == 2 * 57_344


def test_a_one_byte_kv_format_holds_twice_the_tokens_of_a_two_byte_one():
    """fp8 by name and a 1-byte element size (what the engine passes) are the same arithmetic."""
    shape = ModelShape.from_hf_config(QWEN25_7B)
    assert shape.kv_bytes_per_token("fp8") == shape.kv_bytes_per_token(1) == 57_344 // 2
    assert shape.kv_bytes_per_token(2) == shape.kv_bytes_per_token("bfloat16")


def _write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header = {k: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]} for k, s in shapes.items()}
    blob = json.dumps({**header, "__metadata__": {"format": "pt"}}).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)


def test_parameters_are_counted_from_safetensors_headers(tmp_path):
    """A checkpoint dir's parameters come from its safetensors headers, not an estimate."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    _write_safetensors(tmp_path / "model.safetensors", {"a": [3, 5], "b": [7]})
    assert model_shape(tmp_path).num_parameters == 22
    assert model_shape(tmp_path / "config.json").num_parameters > 7 * 10**9  # estimated
    assert model_shape(LLAMA3_8B).num_kv_heads == 8


def test_known_gpus_and_unknown_ones():
    assert gpu_memory_bytes("H200") == 141 * GB
    assert gpu_memory_bytes("NVIDIA-A100-SXM4-40GB") == 40 * GB
    assert gpu_memory_bytes("NVIDIA-H100-80GB-HBM3") == 80 * GB
    assert gpu_memory_bytes("l4") == gpu_memory_bytes("NVIDIA-A10G") == 24 * GB
    assert gpu_memory_bytes("B200") == 180 * GB
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_memory_bytes("TPU")


def test_admission_refuses_a_pool_smaller_than_one_request_and_names_the_fixes():
    shape = ModelShape.from_hf_config(HYBRID_27B)
    plan = plan_on_gpu(
        shape, H100, weights_format="bf16", kv_format="bf16", num_parameters=27 * 10**9
    )
    verdict = admit(shape, plan, 262_144)
    assert not verdict.admitted and verdict.reason == "PoolTooSmall"
    assert "222,768 tokens" in verdict.message  # whole blocks of the pool
    assert "max-model-len <= 222,768" in verdict.message
    assert "kv-cache-dtype fp8 (445,552 tokens)" in verdict.message
    assert "tensor-parallel-size" in verdict.message
    ok = admit(shape, plan, 32_768)
    assert ok.admitted and "6 requests" in ok.message
    unset = admit(shape, plan, None)
    assert not unset.admitted and unset.reason == "NoMaxModelLen"
    assert "262144" in unset.message


def test_plan_cli_errors_say_which_flag(tmp_path, capsys):
    path = _write(tmp_path, QWEN25_7B)
    assert main(["plan", path, "--gpu", "TPU"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["plan", path, "--requests", "3"]) == 2
    assert "--prompt-tokens" in capsys.readouterr().err
    assert main(["plan", path, "--gpu-memory-utilization", "1.5"]) == 2
    assert "utilization" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_both_distributions_register_the_plan_command():
    """pagefleet-common (the images) and the all-in-one dev install both bring `plan`."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    for pyproject in (root / "pyproject.toml", root / "pagefleet" / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        commands = project["entry-points"]["pagefleet.commands"]
        assert commands["plan"] == "pagefleet.common.plan_command:add_plan_parser", pyproject


def test_the_engine_pool_arithmetic_per_rank_matches_its_tensor_parallel_shards():
    """runner.kv_bytes_per_block (the engine's pool sizing) goes through the capacity module:
    under TP each rank's KV heads are those TPLayout shards it (split, or one replicated head
    when fewer heads than ranks), and a 1-byte dtype (fp8) halves a 2-byte one."""
    from types import SimpleNamespace

    import torch

    from pagefleet.engine.model.parallel import TPLayout
    from pagefleet.engine.model.registry import model_config
    from pagefleet.engine.runner import kv_bytes_per_block

    for kv_heads in (1, 2, 4, 8):
        config = model_config({**LLAMA3_8B, "num_key_value_heads": kv_heads})
        for size in (1, 2, 4, 8):
            if kv_heads % size and size % kv_heads:
                continue
            layout = TPLayout.of(config, 0, size)
            assert kv_heads_per_rank(kv_heads, size) == layout.num_kv_heads
            tp = SimpleNamespace(layout=layout) if size > 1 else None
            model = SimpleNamespace(config=config, tp=tp)
            per_block = kv_bytes_per_block(model, 16, torch.bfloat16)
            assert per_block == 2 * 32 * layout.num_kv_heads * 128 * 2 * 16
            assert kv_bytes_per_block(model, 16, torch.float8_e4m3fn) == per_block // 2


# --- hostile configs: a clear error, never a traceback, a hang or a nonsense plan -------------

# (field, value, what the error names) over a valid llama shape. Each caught a crash or a
# silent nonsense figure before the shape fields were checked: 0 heads divided by zero,
# Infinity overflowed int(), 10**12 layers built a list of 10**12 entries (a hang and an OOM
# in the operator), negative KV heads became one head, 10**400 parameters overflowed a float.
HOSTILE_FIELDS = (
    ("num_attention_heads", 0, "num_attention_heads"),
    ("num_hidden_layers", float("inf"), "num_hidden_layers"),
    ("num_hidden_layers", float("nan"), "num_hidden_layers"),
    ("num_hidden_layers", 10**12, "num_hidden_layers"),
    ("num_hidden_layers", -3, "num_hidden_layers"),
    ("num_hidden_layers", "32", "num_hidden_layers"),
    ("num_hidden_layers", True, "num_hidden_layers"),
    ("num_key_value_heads", -4, "num_key_value_heads"),
    ("head_dim", 12.5, "head_dim"),
    ("vocab_size", 10**400, "vocab_size"),
    ("max_position_embeddings", float("inf"), "max_position_embeddings"),
    ("full_attention_interval", float("inf"), "full_attention_interval"),
    ("linear_conv_kernel_dim", [4], "linear_conv_kernel_dim"),
    ("torch_dtype", {"a": 1}, "dtype"),
)


@pytest.mark.parametrize(("field", "value", "named"), HOSTILE_FIELDS)
def test_a_hostile_shape_field_is_a_value_error_naming_it(field, value, named):
    """Catches the shape read crashing (ZeroDivisionError, OverflowError), hanging on a huge
    layer count or giving a nonsense shape: every bad field is a ValueError that names it."""
    with pytest.raises(ValueError, match=named):
        ModelShape.from_hf_config({**LLAMA3_8B, field: value})


def test_plan_refuses_hostile_configs_in_one_line(tmp_path, capsys):
    """Catches `pagefleet plan` dying with a traceback on a bad config.json (0 heads,
    Infinity, a huge layer count, JSON nested past the parser's recursion limit, a truncated
    safetensors file): exit status 2 and one error line."""
    cases = [
        json.dumps({**LLAMA3_8B, "num_attention_heads": 0}),
        json.dumps({**LLAMA3_8B, "num_hidden_layers": float("inf")}),
        json.dumps({**LLAMA3_8B, "num_hidden_layers": 10**12}),
        "[" * 100_000,
    ]
    for i, text in enumerate(cases):
        path = tmp_path / f"c{i}.json"
        path.write_text(text)
        assert main(["plan", str(path)]) == 2, text[:60]
        err = capsys.readouterr().err
        assert err.startswith("pagefleet plan: error:") and err.count("\n") == 1, err[:300]
    checkpoint = tmp_path / "truncated"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(LLAMA3_8B))
    (checkpoint / "model.safetensors").write_bytes(b"\x01\x02")
    assert main(["plan", str(checkpoint)]) == 2
    assert "safetensors" in capsys.readouterr().err
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    assert main(["plan", str(binary)]) == 2
    assert "binary.json" in capsys.readouterr().err
    good = _write(tmp_path, LLAMA3_8B)
    for flags, named in (
        (["--tp", "0"], "tensor parallel"),  # a ZeroDivisionError traceback
        (["--num-gpu-blocks", "-1"], "--num-gpu-blocks"),  # a pool of 0 blocks, silently
    ):
        assert main(["plan", good, *flags]) == 2, flags
        assert named in capsys.readouterr().err
    for flag in ("--gpu-memory-gb", "--overhead-gb", "--params"):
        for value in ("inf", "nan", "-1"):
            assert main(["plan", good, flag, value]) == 2, (flag, value)
            assert flag in capsys.readouterr().err
