"""The offline and async APIs, checkpoint loading errors, and KV pool sizing."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import threading
import time

import pytest

from pagefleet.engine import LLM, SamplingParams, async_llm
from pagefleet.engine.async_llm import AsyncLLM
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.model.tiny import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["qwen3"], num_gpu_blocks_override=256, max_model_len=256)


def test_generate_accepts_text_token_ids_and_dicts_in_order(llm):
    tok = llm.get_tokenizer()
    text = "hello world, what is a cache?"
    ids = tok.encode(text)
    outs = llm.generate(
        [text, ids, {"prompt_token_ids": ids}, {"prompt": text}], GREEDY, use_tqdm=False
    )
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert outs[0].prompt == text and outs[1].prompt is None
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    single = llm.generate(text, GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert single[0].outputs[0].text == tok.decode(
        single[0].outputs[0].token_ids, skip_special_tokens=True
    )


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "tell me about the sky"}]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert tok.decode(out.prompt_token_ids) == expected
    assert (
        out.outputs[0].token_ids
        == llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_bad_requests_raise_value_errors(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(300))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    # An out-of-vocabulary stop id would index past the logits when min_tokens masks it.
    bad_stop = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[-1833])
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        llm.generate([[1, 2, 3]], bad_stop, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_progress_bar_can_be_on(llm, capsys):
    llm.generate(["one", "two"], GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_missing_and_unsupported_checkpoints_are_named(tmp_path, tiny_checkpoints):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        LLM(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["llama"], broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        LLM(str(broken))
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_checkpoints["mistral"], sharded)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="lacks shards"):
        LLM(str(sharded))
    odd = tmp_path / "odd"
    shutil.copytree(tiny_checkpoints["llama"], odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(odd))
    no_tok = tmp_path / "no_tok"
    shutil.copytree(tiny_checkpoints["llama"], no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        LLM(str(no_tok))


def test_kv_pool_is_sized_from_memory_and_reported(tiny_checkpoints, caplog):
    caplog.set_level(logging.INFO, logger="pagefleet.engine")
    # llama tiny: 2 layers x 2 (k, v) x 16 slots x 2 kv heads x 16 dims x 4 bytes = 8 KiB/block
    llm = LLM(tiny_checkpoints["llama"], kv_cache_memory=1 / 1024, max_model_len=512)
    assert llm.engine.scheduler.kv_cache.num_blocks == 128
    logs = caplog.text
    assert "KV cache size: 2048 tokens" in logs
    assert "Maximum concurrency for 512 tokens per request: 4.00x" in logs
    assert "KV cache: 512 bytes per token, 8192 per block (float32)" in logs
    assert "model weights take" in logs
    with pytest.raises(ValueError, match=r"--max-model-len.*--kv-cache-memory.*--kv-cache-dtype"):
        LLM(tiny_checkpoints["llama"], kv_cache_memory=1 / 1024, max_model_len=4096)


def test_a_kv_pool_larger_than_host_memory_is_refused_at_start(tiny_checkpoints):
    """Catches the lazily zeroed CPU pool (kv_cache/pool_memory.py) letting an engine start
    with --kv-cache-memory beyond the host (or its container's limit), to be OOM-killed under
    load rather than refused at start; the pool still costs no resident memory until used."""
    from pagefleet.engine.kv_sizing import host_memory_bytes

    too_big = 2 * host_memory_bytes() / (1 << 30)
    with pytest.raises(ValueError, match=r"--kv-cache-memory .* more than this host's memory"):
        LLM(tiny_checkpoints["llama"], kv_cache_memory=too_big)

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    engine = LLM(tiny_checkpoints["llama"]).engine  # the default 4 GiB
    assert engine.runner.kv_pool.untyped_storage().nbytes() >= 4 << 30
    grown = resident() - before
    assert grown < 1 << 30, f"{grown / (1 << 30):.1f} GiB more resident: the pool was written"


def test_engine_and_plan_size_the_pool_with_the_same_arithmetic(tiny_checkpoints, capsys):
    """The engine's pool and `pagefleet plan` for the same checkpoint agree to the block
    (catches the engine and the planner drifting apart: one capacity module sizes both)."""
    from pagefleet.common.cli import main

    llm = LLM(tiny_checkpoints["llama"], kv_cache_memory=1 / 1024, max_model_len=512)
    command = ["plan", tiny_checkpoints["llama"], "--kv-cache-dtype", "float32", "--json"]
    assert main([*command, "--num-gpu-blocks", "128", "--contexts", "512"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plans"]
    one_block = llm.engine.runner.kv_pool[:, :, :, 0]  # every layer's K and V of block 0
    assert row["bytes_per_block"] == one_block.nbytes == 8192
    assert row["bytes_per_token"] == 512
    assert row["kv_blocks"] == llm.engine.scheduler.kv_cache.num_blocks == 128
    assert row["sequences"]["512"] == 4


def test_engine_args_are_validated():
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        EngineArgs(model="x", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="--dtype"):
        from pagefleet.engine.model.loader import resolve_dtype

        resolve_dtype("int3", __import__("torch").device("cpu"))


def test_one_set_of_engine_defaults_from_flags_to_the_scheduler():
    """`pagefleet serve` without flags, EngineArgs and the configs it builds agree on every
    default (max_num_batched_tokens once was 2048 for the server and 8192 for the scheduler)."""
    from pagefleet.common.cli import build_parser
    from pagefleet.engine.config import CacheConfig, SchedulerConfig
    from pagefleet.engine.server.serve import engine_args_from

    args = EngineArgs(model="m")
    assert engine_args_from(build_parser().parse_args(["serve", "m"])) == args
    assert args.scheduler_config(4096) == SchedulerConfig(max_model_len=4096)
    assert args.cache_config(7) == CacheConfig(num_gpu_blocks=7)


def test_tiny_checkpoint_refuses_unknown_architectures(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture"):
        write_tiny_checkpoint(tmp_path / "x", "GPT2LMHeadModel")


def test_async_engine_streams_and_matches_offline(tiny_checkpoints, monkeypatch):
    """...and is built on its loop's own thread, so that thread's OpenMP team is the
    process's only one (async_llm.py says why that matters)."""
    path = tiny_checkpoints["llama"]
    built_on: list[threading.Thread] = []
    build = async_llm.make_engine

    def make_engine(*args):
        built_on.append(threading.current_thread())
        return build(*args)

    monkeypatch.setattr(async_llm, "make_engine", make_engine)
    prompts = [[10 + i, 20, 30, 40 + i] * (i + 1) for i in range(6)]
    expected = [
        o.outputs[0].token_ids
        for o in LLM(path, num_gpu_blocks_override=128, max_model_len=256).generate(
            prompts, GREEDY, use_tqdm=False
        )
    ]
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=path, num_gpu_blocks_override=128, max_model_len=256)
    )
    monkeypatch.undo()
    assert built_on == [engine._thread] and engine._thread is not threading.current_thread()

    async def one(i: int) -> list[list[int]]:
        """The token ids of each update the stream delivered."""
        return [
            list(out.outputs[0].token_ids)
            async for out in engine.generate(prompts[i], GREEDY, f"req-{i}")
        ]

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        streams = asyncio.run(all_of_them())
        assert [updates[-1] for updates in streams] == expected
        # Outputs are cumulative and an unread one is replaced by the next (async_llm.py), so
        # a busy consumer sees fewer updates than tokens (as CI did): each update must
        # extend the one before, never repeat or shrink it.
        for updates in streams:
            assert all(
                len(b) > len(a) and b[: len(a)] == a for a, b in itertools.pairwise(updates)
            ), [len(u) for u in updates]
    finally:
        engine.shutdown()
    assert not engine.is_running


def test_async_abort_frees_blocks_at_the_next_step(tiny_checkpoints):
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=tiny_checkpoints["llama"], num_gpu_blocks_override=64, max_model_len=256)
    )
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def leave_early():
        stream = engine.generate(list(range(40)), long, "leaver")
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()  # the client went away
        deadline = time.monotonic() + 10  # a poll, not a sleep: the next step frees them
        while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def bad_request():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate(list(range(300)), long, "too-long"):
                pass

    try:
        asyncio.run(leave_early())
        kv = engine.engine.scheduler.kv_cache
        assert not engine.engine.has_unfinished_requests()
        assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
        asyncio.run(bad_request())
    finally:
        engine.shutdown()


def test_a_failed_batch_leaves_nothing_behind(llm):
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], list(range(300))], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache.usage == 0.0


def test_request_ids_may_contain_any_character(llm):
    engine = llm.engine
    for rid in ("chat#1", "a#b#2"):
        engine.add_request(rid, [5, 6, 7], GREEDY)
    engine.add_request("n", [5, 6, 7], SamplingParams(n=2, temperature=0, max_tokens=4))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"chat#1", "a#b#2", "n"}
    assert len(finished["n"].outputs) == 2


def test_async_abort_ends_a_reading_consumer_and_bad_requests_fail_alone(tiny_checkpoints):
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=tiny_checkpoints["llama"], num_gpu_blocks_override=64, max_model_len=256)
    )
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        outs = []
        async for out in engine.generate(list(range(10)), long, "victim"):
            outs.append(out)
            if len(outs) == 3:
                engine.abort("victim")  # from outside, while we keep reading
        with pytest.raises(ValueError, match="invalid request"):
            async for _ in engine.generate(["not", "ids"], long, "bad"):
                pass
        ok = [o async for o in engine.generate([1, 2, 3], GREEDY, "fine")]
        return outs, ok

    try:
        outs, ok = asyncio.run(main())
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert ok[-1].finished and len(ok[-1].outputs[0].token_ids) == 12
    finally:
        engine.shutdown()

    async def after_shutdown():
        async for _ in engine.generate([1, 2], GREEDY, "late"):
            pass

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(after_shutdown())
