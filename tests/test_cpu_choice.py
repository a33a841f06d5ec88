"""Per-machine CPU choices (issue 38): the pure rule on made-up measurements (wins, near-ties,
ties, failed measurements), the per-CPU-model timing cache, and `--linear-path auto` in an
engine whose cache holds made-up timings: exactly the shapes the timings favour are packed,
the choice is logged with its reason, and greedy output still equals HF's. `--attention-backend
auto` likewise: both backends timed on the model's decode shape, the engine running the one its
timings favour (each backend's greedy equality with HF: test_cpu_paged_attention.py)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import threading

import pytest
import torch

from hf_reference import assert_greedy_equal
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.attention.backend import DecodeShape
from pagefleet.engine.attention.cpu_auto import cpu_backend_choice
from pagefleet.engine.cpu_choice import measure
from pagefleet.engine.cpu_choice.decide import Timed, choose
from pagefleet.engine.cpu_choice.measure import (
    CACHE_FILE,
    TimingCache,
    cached_timings,
    describe_cpu,
    machine_key,
)
from pagefleet.engine.model import linear_plan as plan_module
from pagefleet.engine.model import loader, numba_ops
from pagefleet.engine.model.linear_plan import (
    PACK_ALL,
    PACK_NONE,
    choose_paths,
    fit_second_layouts,
    float_weights_by_shape,
    linear_plan,
    rotation,
    second_layout_budget,
)
from pagefleet.engine.model.loader import load_model
from pagefleet.engine.model.numba_ops import linear_one_row
from pagefleet.engine.model.packed import plain_linear
from pagefleet.engine.server.serve import add_serve_parser

PATHS = ("plain", "packed")
CPU = torch.device("cpu")


def timed(*per_class: tuple[float, float]) -> list[Timed]:
    """(plain, packed) seconds per row class."""
    return [
        Timed(f"rows={r}", {"plain": a, "packed": b})
        for r, (a, b) in zip((1, 16, 64), per_class, strict=False)
    ]


# ---------------------------------------------------------------- the pure rule


def test_a_clearly_faster_candidate_replaces_the_default_and_says_by_how_much():
    choice = choose(PATHS, "plain", timed((2.0, 1.0), (2.0, 1.0), (2.0, 1.0)))
    assert choice.name == "packed"
    assert "packed is 2.00x faster than plain" in choice.reason
    assert "rows=16: packed 2.00x" in choice.reason


def test_the_default_stays_when_it_is_fastest():
    choice = choose(PATHS, "plain", timed((1.0, 3.0), (1.0, 1.5)))
    assert choice.name == "plain"
    assert "plain (the default) is fastest" in choice.reason
    assert "rows=1: packed 0.33x" in choice.reason


@pytest.mark.parametrize("packed", [1.0, 0.97], ids=["exact-tie", "3%-faster"])
def test_a_tie_or_a_win_within_the_margin_keeps_the_default(packed):
    choice = choose(PATHS, "plain", timed((1.0, packed), (1.0, packed), (1.0, packed)))
    assert choice.name == "plain"
    if packed < 1.0:
        assert "within the 5% margin" in choice.reason


def test_the_default_decides_a_tie_whichever_candidate_it_is():
    assert choose(PATHS, "packed", timed((1.0, 1.0))).name == "packed"
    assert choose(("packed", "plain"), "plain", timed((1.0, 1.0))).name == "plain"


def test_single_stream_weighs_as_much_as_the_batches():
    """Packed twice as slow at one row and 1.5x as fast at 16 and 64: the geometric mean of
    relative costs (plain 1.31, packed 1.26) is within the margin, so plain stays; a larger
    batch win tips it."""
    assert choose(PATHS, "plain", timed((1.0, 2.0), (1.5, 1.0), (1.5, 1.0))).name == "plain"
    assert choose(PATHS, "plain", timed((1.0, 2.0), (3.0, 1.0), (3.0, 1.0))).name == "packed"


def test_the_rule_reads_ratios_not_absolute_times():
    """A class with long calls (64 rows) does not outvote the short ones."""
    slow_big = timed((1e-5, 2e-5), (1e-4, 2e-4), (1.0, 0.5))
    assert choose(PATHS, "plain", slow_big).name == "plain"


@pytest.mark.parametrize(
    "bad", [None, math.nan, math.inf, 0.0, -1.0], ids=["missing", "nan", "inf", "zero", "negative"]
)
def test_a_failed_measurement_keeps_the_default_and_names_what_failed(bad):
    timings = timed((2.0, 1.0), (2.0, bad), (2.0, 1.0))
    choice = choose(PATHS, "plain", timings)
    assert choice.name == "plain"
    assert "the measurement of packed at rows=16 failed" in choice.reason


def test_nothing_measured_or_a_candidate_never_timed_keeps_the_default():
    assert choose(PATHS, "plain", []).name == "plain"
    choice = choose(PATHS, "plain", [Timed("rows=1", {"plain": 1.0})])
    assert choice.name == "plain" and "packed at rows=1 failed" in choice.reason


def test_a_default_that_is_not_a_candidate_is_refused():
    with pytest.raises(ValueError, match="'numba' is not a candidate"):
        choose(PATHS, "numba", timed((1.0, 1.0)))


# ---------------------------------------------------------------- the timing cache


def test_timings_are_kept_per_machine_and_read_back(tmp_path):
    cache = TimingCache(tmp_path / CACHE_FILE)
    cache.put("linear 8x4", timed((1.0, 2.0)))
    assert TimingCache(tmp_path / CACHE_FILE).get("linear 8x4") == timed((1.0, 2.0))
    data = json.loads((tmp_path / CACHE_FILE).read_text())
    assert list(data) == [machine_key()]  # the CPU model, threads and torch version name it
    other = TimingCache(tmp_path / CACHE_FILE)
    other.machine = "another CPU | 2 threads | torch 0"
    assert other.get("linear 8x4") is None


def cpuinfo(model: int, flags: str, name: str = "AMD EPYC") -> str:
    """A two-processor /proc/cpuinfo text; the second processor differs, to be ignored."""
    block = (
        "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {m}\n"
        "model name\t: {name}\nstepping\t: 1\ncache size\t: 512 KB\nflags\t\t: {flags}\n"
    )
    first = block.format(n=0, m=model, name=name, flags=flags)
    return first + "\n" + block.format(n=1, m=99, name="other", flags="avx512f") + "\n"


def test_cpus_sharing_a_model_name_are_told_apart_and_keep_separate_timings(tmp_path, monkeypatch):
    zen3 = describe_cpu(cpuinfo(1, "fpu sse2 avx2 fma"))
    zen4 = describe_cpu(cpuinfo(17, "fpu avx2 fma avx512f avx512_vnni avx512_bf16"))
    assert zen3 == "AMD EPYC (family 25, model 1, stepping 1; avx2 fma; cache 512 KB)"
    assert zen4 == (
        "AMD EPYC (family 25, model 17, stepping 1; avx2 fma avx512f avx512_vnni avx512_bf16; "
        "cache 512 KB)"
    )
    assert describe_cpu("processor : 0\nmodel name : Old\n").startswith("Old (no AVX2")
    monkeypatch.setattr(measure, "cpu_model", lambda: zen4)
    TimingCache(tmp_path / CACHE_FILE).put("linear 8x4", timed((2.0, 1.0)))
    assert TimingCache(tmp_path / CACHE_FILE).get("linear 8x4") == timed((2.0, 1.0))
    monkeypatch.setattr(measure, "cpu_model", lambda: zen3)  # AVX-512 times do not apply
    assert TimingCache(tmp_path / CACHE_FILE).get("linear 8x4") is None


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        '{"%s": {"linear 8x4": 3}}',
        '{"%s": [1]}',
        '{"%s": {"linear 8x4": [1]}}',
        '{"%s": {"linear 8x4": []}}',
        '{"%s": {"linear 8x4": [{"label": "rows=1", "seconds": {"plain": "1.0"}}]}}',
        '{"%s": {"linear 8x4": [{"label": "rows=1", "seconds": {"plain": true}}]}}',
        '{"%s": {"linear 8x4": [{"label": 1, "seconds": {"plain": 1.0}}]}}',
    ],
)
def test_an_unreadable_cache_is_measured_again(tmp_path, content):
    path = tmp_path / CACHE_FILE
    path.write_text(content.replace("%s", machine_key()))
    calls = []
    timings, source = cached_timings(
        TimingCache(path), "linear 8x4", lambda: calls.append(1) or timed((1.0, 2.0))
    )
    assert calls == [1] and timings == timed((1.0, 2.0)) and "measured now" in source
    assert TimingCache(path).get("linear 8x4") == timed((1.0, 2.0))


def test_a_machine_measures_once_and_a_failed_measurement_is_not_kept(tmp_path):
    cache = TimingCache(tmp_path / CACHE_FILE)
    calls = []
    for _ in range(2):
        cached_timings(cache, "linear 8x4", lambda: calls.append(1) or timed((1.0, 2.0)))
    assert calls == [1]

    def broken(*_):
        raise RuntimeError("oneDNN refused the shape")

    timings, source = cached_timings(cache, "linear 4x4", broken)
    assert timings == [] and "oneDNN refused the shape" in source
    assert cache.get("linear 4x4") is None
    assert choose(PATHS, "plain", timings).name == "plain"


# ---------------------------------------------------------------- the linear plan


def test_auto_measures_the_real_weights_of_every_shape_and_keeps_them(tiny_checkpoints, tmp_path):
    model = load_model(tiny_checkpoints["llama"], torch.float32, CPU, 64, linear_path="plain")
    shapes = float_weights_by_shape(model)
    assert len(shapes) >= 4  # qkv, o, gate|up, down (and the LM head unless tied)
    cache = TimingCache(tmp_path / CACHE_FILE)
    plan = linear_plan("auto", shapes, cache)
    for out, inp in shapes:
        timings = cache.get(f"linear {out}x{inp}")
        assert [t.label for t in timings] == ["rows=1", "rows=16", "rows=64"]
        assert set(timings[0].seconds) == {"plain", "packed", "gemv"}  # the GEMV at one row
        assert all(s > 0 for t in timings for s in t.seconds.values())
        paths = choose_paths(timings)  # the tiny model's copies fit this machine's budget
        assert plan.packs((out, inp)) == (paths.layout == "packed")
        assert plan.one_row_path((out, inp)) == paths.one_row


def test_explicit_paths_override_the_measurement():
    assert linear_plan("packed", {}) is PACK_ALL
    assert linear_plan("plain", {}) is PACK_NONE
    with pytest.raises(ValueError, match="--linear-path 'fast'"):
        linear_plan("fast", {})


def one_row_timed(plain: float, packed: float, gemv: float | None, many=(2.0, 1.0)):
    """rows=1 with the GEMV, then 16 and 64 rows at (plain, packed) `many`."""
    return [
        Timed("rows=1", {"plain": plain, "packed": packed, "gemv": gemv}),
        *(Timed(f"rows={r}", {"plain": many[0], "packed": many[1]}) for r in (16, 64)),
    ]


def test_the_layout_comes_from_batches_and_the_one_row_path_from_one_row():
    paths = choose_paths(one_row_timed(3.0, 2.0, 1.0))
    assert (paths.layout, paths.one_row, paths.second_layout) == ("packed", "gemv", True)
    assert paths.saves == 1.0  # seconds per weight a one-row step saves over packed
    assert "one row: gemv is 2.00x faster than packed" in paths.reason
    on_plain = choose_paths(one_row_timed(2.0, 3.0, 1.0, many=(1.0, 2.0)))
    assert (on_plain.layout, on_plain.one_row, on_plain.second_layout) == ("plain", "gemv", False)
    mkl = choose_paths(one_row_timed(1.0, 2.0, 1.5))  # Intel's case: MKL's sgemv at one row
    assert (mkl.layout, mkl.one_row, mkl.second_layout) == ("packed", "plain", True)


@pytest.mark.parametrize(
    "gemv", [1.98, None, float("nan")], ids=["within-margin", "missing", "nan"]
)
def test_a_one_row_path_needs_a_clear_measured_win_to_leave_the_layout(gemv):
    paths = choose_paths(one_row_timed(3.0, 2.0, gemv))
    assert (paths.layout, paths.one_row, paths.second_layout) == ("packed", None, False)
    if gemv is not None and gemv == gemv:
        assert "within the 5% margin" in paths.reason
    else:
        assert "gemv at rows=1 failed" in paths.reason


def test_second_copies_go_to_the_most_time_saved_per_byte_within_the_budget():
    wanted = {(8, 4): (1.0, 100), (16, 4): (3.0, 200), (32, 4): (1.0, 50)}
    assert fit_second_layouts(wanted, 250) == {(16, 4), (32, 4)}  # 0.015 and 0.02 s/byte
    assert fit_second_layouts(wanted, 350) == set(wanted)
    assert fit_second_layouts(wanted, 0) == set()


def test_the_budget_is_a_share_of_the_available_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemAvailable:  4000000 kB\n")
    assert second_layout_budget(meminfo, limit=1 << 40) == 4000000 * 1024 // 4
    assert second_layout_budget(meminfo, limit=1000) == 250  # a container's lower limit
    meminfo.write_text("MemTotal:  8000000 kB\n")
    assert second_layout_budget(meminfo, limit=1 << 40) == 0  # unknown: no second copies
    assert second_layout_budget(tmp_path / "absent", limit=1 << 40) == 0


def test_without_room_for_a_copy_one_layout_is_chosen_over_every_row_count(tmp_path, caplog):
    """Packed wins batches by 1.1x but loses one row by 2x: with a copy, packed and a plain
    one-row path; without room, one layout over all three classes (plain here)."""
    weights = {(8, 4): [torch.randn(8, 4)]}
    cache = TimingCache(tmp_path / CACHE_FILE)
    cache.put("linear 8x4", one_row_timed(1.0, 2.0, 1.5, many=(1.1, 1.0)))
    roomy = linear_plan("auto", weights, cache, budget=1 << 20)
    assert roomy.packs((8, 4)) and roomy.one_row_path((8, 4)) == "plain"
    with caplog.at_level(logging.INFO, logger="pagefleet.engine.model.linear_plan"):
        tight = linear_plan("auto", weights, cache, budget=64)
    assert not tight.packs((8, 4)) and tight.one_row_path((8, 4)) is None
    assert "no room for a plain copy" in caplog.text
    # Without room, a plain layout is scored at one row by its faster path (the GEMV here):
    # 3x slower than packed by MKL's time, 2x faster by the GEMV's.
    cache.put("linear 8x4", one_row_timed(3.0, 2.0, 1.0, many=(1.1, 1.0)))
    gemv_plain = linear_plan("auto", weights, cache, budget=64)
    assert not gemv_plain.packs((8, 4)) and gemv_plain.one_row_path((8, 4)) == "gemv"


def test_fused_layers_keep_plain_copies_first_and_fall_back_without_room(tmp_path, caplog):
    """A layer shape packed for batches and packed at one row too keeps its plain copy where
    the layers run fused (their kernel reads it): the one-row path is then the faster of the
    two plain ones. Without room for the layers' copies, the shape is chosen as any other and
    the layers run op by op."""
    layer, head = (8, 4), (16, 4)
    weights = {layer: [torch.randn(8, 4)], head: [torch.randn(16, 4)]}
    cache = TimingCache(tmp_path / CACHE_FILE)
    cache.put("linear 8x4", one_row_timed(2.0, 1.0, 1.5))  # packed wins everywhere
    cache.put("linear 16x4", one_row_timed(3.0, 2.0, 1.0))  # the head: gemv at one row
    fused = linear_plan("auto", weights, cache, budget=1 << 20, layer_shapes=frozenset({layer}))
    assert fused.one_row_layers
    assert fused.packs(layer) and fused.one_row_path(layer) == "gemv"
    assert fused.packs(head) and fused.one_row_path(head) == "gemv"
    # Room for the layers' copy (128 bytes) and not the head's (256) after it: layers first.
    layers_only = linear_plan("auto", weights, cache, budget=200, layer_shapes=frozenset({layer}))
    assert layers_only.one_row_layers and layers_only.one_row_path(layer) == "gemv"
    assert layers_only.one_row_path(head) is None
    with caplog.at_level(logging.INFO, logger="pagefleet.engine.model.linear_plan"):
        tight = linear_plan("auto", weights, cache, budget=64, layer_shapes=frozenset({layer}))
    assert not tight.one_row_layers
    assert tight.packs(layer) and tight.one_row_path(layer) is None  # packed at one row
    assert "op by op (plain copies of 0 MiB do not fit in 0 MiB)" in caplog.text
    assert not linear_plan("auto", weights, cache, budget=1 << 20).one_row_layers
    assert not linear_plan("packed", weights, layer_shapes=frozenset({layer})).one_row_layers


def write_made_up_timings(cache_root, shapes, packed_wins) -> None:
    cache = TimingCache(cache_root / CACHE_FILE)
    for shape in shapes:
        wins = shape in packed_wins
        cache.put(
            f"linear {shape[0]}x{shape[1]}",
            timed(*[(2e-5, 1e-5) if wins else (1e-5, 2e-5)] * 3),
        )


def test_an_engine_packs_exactly_the_shapes_its_cached_timings_favour(
    tiny_checkpoints, tmp_path, monkeypatch, caplog
):
    path = tiny_checkpoints["llama"]
    shapes = sorted(
        float_weights_by_shape(load_model(path, torch.float32, CPU, 64, linear_path="plain"))
    )
    packed_wins = set(shapes[::2])  # every other shape: a mixed plan
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path))
    write_made_up_timings(tmp_path, shapes, packed_wins)
    with caplog.at_level(logging.INFO, logger="pagefleet.engine.model.linear_plan"):
        llm = LLM(path, num_gpu_blocks_override=128, max_model_len=256)
    for out, inp in shapes:
        verdict = "packed" if (out, inp) in packed_wins else "plain"
        assert any(
            f"linear path for {out}x{inp} weights" in r.message
            and f": {verdict};" in r.message
            and "measured earlier on this machine" in r.message
            for r in caplog.records
        ), f"no log line for {out}x{inp}"
    model = llm.engine.runner.model
    seen = set()
    for module in model.modules():
        if hasattr(module, "spec") and hasattr(module, "method"):
            shape = (module.out_features, module.in_features)
            seen.add(shape)
            assert (getattr(module, "packed", None) is not None) == (shape in packed_wins), shape
    assert seen >= set(shapes)

    prompts = [[5, 9, 33, 2, 71, 8], list(range(10, 60))]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False), strict=True):
        assert_greedy_equal(path, prompt, out.outputs[0].token_ids, 16)


def test_one_row_steps_run_their_own_path_and_still_equal_hf(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """Made-up timings give the shapes each one-row arrangement: the GEMV beside packed
    weights, the GEMV on a plain layout, MKL's sgemv beside packed weights, packed alone.
    Single-stream decode runs one-row steps, two prompts run two-row ones: HF's greedy
    output either way."""
    path = tiny_checkpoints["llama"]
    shapes = sorted(
        float_weights_by_shape(load_model(path, torch.float32, CPU, 64, linear_path="plain"))
    )
    arrangements = [
        (("packed", "gemv"), one_row_timed(3e-5, 2e-5, 1e-5)),
        (("plain", "gemv"), one_row_timed(2e-5, 3e-5, 1e-5, many=(1e-5, 2e-5))),
        (("packed", "plain"), one_row_timed(1e-5, 2e-5, 1.5e-5)),
        (("packed", None), one_row_timed(3e-5, 1e-5, 2e-5)),
    ]
    wanted = {shape: arrangements[i % len(arrangements)] for i, shape in enumerate(shapes)}
    cache = TimingCache(tmp_path / CACHE_FILE)
    for shape, (_, timings) in wanted.items():
        cache.put(f"linear {shape[0]}x{shape[1]}", timings)
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path))
    # As for a family whose layers do not run fused at one row (model/one_row_decode.py).
    monkeypatch.setattr(loader, "_fusable_shapes", lambda model: frozenset())
    llm = LLM(path, num_gpu_blocks_override=128, max_model_len=256)
    gemv_calls = []
    kernel = numba_ops._gemv
    monkeypatch.setattr(numba_ops, "_gemv", lambda *a: gemv_calls.append(1) or kernel(*a))
    seen = set()
    for module in llm.engine.runner.model.modules():
        shape = (getattr(module, "out_features", 0), getattr(module, "in_features", 0))
        if not hasattr(module, "one_row_path") or shape not in wanted:
            continue
        seen.add(shape)
        (layout, one_row), _ = wanted[shape]
        assert module.one_row_path == one_row, shape
        assert (
            module.one_row is {None: None, "gemv": linear_one_row, "plain": plain_linear}[one_row]
        )
        assert (getattr(module, "packed", None) is not None) == (layout == "packed"), shape
        assert (module.weight is not None) == (layout == "plain" or one_row is not None), shape
    assert seen == set(shapes)

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for batch in ([[5, 9, 33, 2, 71, 8]], [[7, 7, 1, 40], list(range(10, 40))]):
        for prompt, out in zip(batch, llm.generate(batch, greedy, use_tqdm=False), strict=True):
            assert_greedy_equal(path, prompt, out.outputs[0].token_ids, 12)
        if len(batch) == 1:  # single-stream decode ran the GEMV where it was chosen
            assert gemv_calls


def test_a_cache_that_cannot_be_written_still_lets_the_engine_choose(tmp_path):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    cache = TimingCache(blocked / CACHE_FILE)  # its parent is a file: no write can succeed
    timings, _ = cached_timings(cache, "linear 8x4", lambda: timed((2.0, 1.0)))
    assert choose(PATHS, "plain", timings).name == "packed"
    assert cache.get("linear 8x4") is None


def test_a_bad_linear_path_is_refused_naming_the_flag(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"--linear-path.*auto, packed, plain"):
        LLM(tiny_checkpoints["llama"], linear_path="fastest", num_gpu_blocks_override=16)
    parser = argparse.ArgumentParser()  # the CLI offers the same three
    add_serve_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--linear-path", "fastest"])
    assert parser.parse_args(["serve", "m", "--linear-path", "plain"]).linear_path == "plain"


def test_a_measurement_with_a_failed_candidate_is_used_once_but_not_kept(tmp_path):
    """A passing failure (oneDNN refusing once) must not pin the default for good."""
    cache = TimingCache(tmp_path / CACHE_FILE)
    failed = timed((1.0, None))
    timings, source = cached_timings(cache, "linear 8x4", lambda: failed)
    assert timings == failed and "not kept" in source
    assert cache.get("linear 8x4") is None


def test_engines_starting_together_measure_a_shape_once(tmp_path):
    """The second engine waits for the first one's measurement and reads it back."""
    first_started, second_waiting, release = (threading.Event() for _ in range(3))
    calls, sources = [], {}

    class Second(TimingCache):
        def measuring(self):
            second_waiting.set()  # past its first look: it found nothing and goes to the lock
            return super().measuring()

    def slow_measure():
        calls.append("first")
        first_started.set()
        assert release.wait(30)
        return timed((1.0, 2.0))

    def start(name, cache, measure):
        sources[name] = cached_timings(cache, "linear 8x4", measure)[1]

    first = threading.Thread(
        target=start, args=("first", TimingCache(tmp_path / CACHE_FILE), slow_measure)
    )
    first.start()
    assert first_started.wait(30)
    second = threading.Thread(
        target=start,
        args=(
            "second",
            Second(tmp_path / CACHE_FILE),
            lambda: calls.append("second") or timed((1.0, 2.0)),
        ),
    )
    second.start()
    assert second_waiting.wait(30)
    release.set()
    first.join(30)
    second.join(30)
    assert calls == ["first"]
    assert "measured now" in sources["first"]
    assert "measured by another engine" in sources["second"]


def test_the_rotation_stays_within_its_bytes(monkeypatch):
    monkeypatch.setattr(plan_module, "ROTATION_BYTES", 3 * 8 * 4 * 4)  # three 8x4 weights
    weights = [torch.randn(8, 4) for _ in range(5)]
    assert [w.data_ptr() for w in rotation(weights)] == [w.data_ptr() for w in weights[:3]]
    big = torch.randn(100, 4)  # one weight over the cap: its first rows, a view
    rows = rotation([big])
    assert len(rows) == 1 and rows[0].shape == (24, 4) and rows[0].data_ptr() == big.data_ptr()


@pytest.mark.parametrize("seam_wins", ["every-shape", "some-shapes"])
def test_moe_experts_are_packed_only_where_packed_won_every_measured_shape(
    moe_checkpoints, tmp_path, seam_wins
):
    """The experts' shapes are not measured: they follow the seam only where packed won it all."""
    path = moe_checkpoints["qwen3_moe"]
    plain = load_model(path, torch.float32, CPU, 64, linear_path="plain")
    shapes = sorted(float_weights_by_shape(plain))
    wins = set(shapes) if seam_wins == "every-shape" else set(shapes[:1])
    write_made_up_timings(tmp_path, shapes, wins)
    plan = linear_plan("auto", float_weights_by_shape(plain), TimingCache(tmp_path / CACHE_FILE))
    assert plan.others == (seam_wins == "every-shape")
    plain.process_weights(plan)  # processed once: the plan's seam choices stand
    experts = [m for m in plain.modules() if hasattr(m, "packed") and hasattr(m, "shard")]
    assert experts
    assert all((e.packed is not None) == plan.others for e in experts)


# ---------------------------------------------------------------- the attention backend

TINY_DECODE = DecodeShape(4, 2, 16, 16, torch.float32, torch.float32)


def test_auto_times_both_attention_backends_on_the_decode_shape_and_keeps_them(tmp_path):
    cache = TimingCache(tmp_path / CACHE_FILE)
    choice = cpu_backend_choice(TINY_DECODE, cache)
    timings = cache.get(TINY_DECODE.subject())
    assert [t.label for t in timings] == ["rows=1", "rows=16", "rows=64"]
    assert all(set(t.seconds) == {"torch", "numba"} for t in timings)
    assert all(s > 0 for t in timings for s in t.seconds.values())
    assert choice.name == choose(("torch", "numba"), "torch", timings).name
    assert "measured now" in choice.reason


def test_a_pool_the_kernel_cannot_read_stays_on_torch_unmeasured(tmp_path):
    cache = TimingCache(tmp_path / CACHE_FILE)
    fp8 = DecodeShape(4, 2, 16, 16, torch.float32, torch.float8_e4m3fn)
    choice = cpu_backend_choice(fp8, cache)
    assert choice.name == "torch"
    assert "does not read torch.float8_e4m3fn" in choice.reason
    assert cache.get(fp8.subject()) is None


@pytest.mark.parametrize("faster", ["torch", "numba"])
def test_an_engine_runs_the_attention_backend_its_cached_timings_favour(
    tiny_checkpoints, tmp_path, monkeypatch, caplog, faster
):
    path = tiny_checkpoints["llama"]
    model = load_model(path, torch.float32, CPU, 64, linear_path="plain")
    subject = model.decode_shape(16, torch.float32).subject()
    monkeypatch.setenv("PAGEFLEET_CACHE", str(tmp_path))
    seconds = {"torch": 3e-5, "numba": 3e-5, faster: 1e-5}
    TimingCache(tmp_path / CACHE_FILE).put(
        subject, [Timed(f"rows={r}", dict(seconds)) for r in (1, 16, 64)]
    )
    with caplog.at_level(logging.INFO, logger="pagefleet.engine.attention.cpu_auto"):
        llm = LLM(path, num_gpu_blocks_override=128, max_model_len=256, linear_path="plain")
    assert llm.engine.runner.backend.name == faster
    assert any(
        f"attention backend for {subject}: {faster}" in r.message
        and "measured earlier on this machine" in r.message
        for r in caplog.records
    )
    llm.engine.close()
    # The flag overrides what was measured.
    other = "numba" if faster == "torch" else "torch"
    llm = LLM(
        path,
        num_gpu_blocks_override=128,
        max_model_len=256,
        attention_backend=other,
        linear_path="plain",
    )
    assert llm.engine.runner.backend.name == other
    llm.engine.close()


def test_a_kernel_that_cannot_be_built_keeps_torch_and_is_not_kept(tmp_path, monkeypatch):
    from pagefleet.engine.attention import numba_paged

    def broken(*_):
        raise ImportError("numba and NumPy disagree")

    monkeypatch.setattr(numba_paged, "warm_up", broken)
    cache = TimingCache(tmp_path / CACHE_FILE)
    choice = cpu_backend_choice(TINY_DECODE, cache)
    assert choice.name == "torch"
    assert "the measurement of numba at rows=1 failed (None)" in choice.reason
    assert cache.get(TINY_DECODE.subject()) is None  # measured again at the next start


def test_the_measured_decode_shape_is_this_ranks(tiny_checkpoints):
    """Under tensor parallelism each rank measures the heads it keeps, also where KV heads are
    replicated over more ranks than there are KV heads."""
    from pagefleet.engine.model.parallel import TPLayout

    model = load_model(tiny_checkpoints["llama"], torch.float32, CPU, 64, linear_path="plain")
    cfg = model.config
    whole = model.decode_shape(16, torch.bfloat16)
    assert (whole.num_heads, whole.num_kv_heads) == (cfg.num_heads, cfg.num_kv_heads)
    assert (whole.dtype, whole.kv_dtype, whole.block_size) == (torch.float32, torch.bfloat16, 16)
    size = 2 * cfg.num_kv_heads  # replicated KV heads
    layout = TPLayout.of(cfg, 0, size)
    model.tp = argparse.Namespace(layout=layout)
    rank = model.decode_shape(16, torch.float32)
    assert (rank.num_heads, rank.num_kv_heads) == (cfg.num_heads // size, 1)
