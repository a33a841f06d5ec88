"""The trained demo model (SmolLM2-135M-Instruct, a Q4_1 GGUF of 30 layers): `pagefleet up`
prepares it once from a package index (a stand-in on loopback serving the wheel `make
demo-model` kept) and answers; then quality on real text through that one served engine: greedy
chat equal to transformers loading the same GGUF, the fp8 KV cache against the float cache,
n-gram speculation's acceptance, and lm-evaluation-harness's `local-completions` against its
`hf` backend. One fleet, one transformers model and one fp8 engine serve every test here."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from pagefleet.common.demo_model import SMOLLM2
from pagefleet.fleet.up import free_port
from server_utils import running_server

BIN = Path(sys.executable).parent
WHEEL = BIN.parent / "demo-wheel" / SMOLLM2.wheel  # kept by `make demo-model`
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
CHATS = ["What is the capital of France?", "Write one sentence about the moon."]
# fp8 e4m3 cache (scales 1.0) against the float cache, two chats of 48 tokens: see the test.
MIN_FP8_TOP1_AGREEMENT = 0.9
MAX_FP8_MEAN_ABS_DELTA_LOGPROB = 0.08
# lm-eval through a server that dequantizes the file at load (--quantization none), as
# transformers does: the same float32 weights, so the loglikelihoods agree to rounding. (The
# demo serves the Q4_1 codes with bfloat16 activations, ~0.1 nats away: issue 31's benchmark
# measures that path's accuracy.)
MAX_LOGLIKELIHOOD_DELTA = 1e-4


class _Index:
    """A PEP 503 simple index on 127.0.0.1 holding the one wheel; counts wheel downloads."""

    def __init__(self, wheel: Path) -> None:
        self.wheel, self.downloads = wheel, 0
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.rstrip("/") == f"/simple/{SMOLLM2.package}":
                    link = f"/files/{wheel.name}#sha256={SMOLLM2.sha256}"
                    body = f'<html><body><a href="{link}">{wheel.name}</a></body></html>'
                    self._send(body.encode(), "text/html")
                elif self.path == f"/files/{wheel.name}":
                    index.downloads += 1
                    self._send(wheel.read_bytes(), "application/octet-stream")
                else:
                    self.send_error(404)

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def index() -> _Index:
    assert WHEEL.is_file(), f"{WHEEL} is missing: run `make demo-model` (make test does)"
    idx = _Index(WHEEL)
    yield idx
    idx.server.shutdown()


def _pip_env(idx: _Index, cache: Path) -> dict:
    """pip sees the stand-in index only (no user config, links or cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PAGEFLEET_CACHE=str(cache),
        PIP_INDEX_URL=idx.url,
        PIP_CONFIG_FILE=os.devnull,
        PIP_CACHE_DIR=str(cache.parent / "pip-cache"),
        HF_HUB_OFFLINE="1",
    )
    return env


@contextlib.contextmanager
def _up(env: dict, log: Path, *flags: str, timeout: float = 300.0):
    """`pagefleet up` until every child is healthy: yields {name: child}; stops it after."""
    state = log.with_suffix(".json")
    port = free_port()
    command = [str(BIN / "pagefleet"), "up", "--port", str(port), "--state-file", str(state)]
    with log.open("w") as out:
        proc = subprocess.Popen([*command, *flags], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while not state.exists():
            assert proc.poll() is None, f"pagefleet up exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "pagefleet up did not become healthy"
            time.sleep(0.2)
        yield {c["name"]: c for c in json.loads(state.read_text())}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.fixture(scope="module")
def fleet(index, tmp_path_factory):
    """The default `pagefleet up` from an empty cache (one colocated engine, n-gram speculation
    on: greedy output is the same with it, and its acceptance is measured here)."""
    root = tmp_path_factory.mktemp("trained")
    cache = root / "cache"
    env = _pip_env(index, cache)
    flags = ["--no-disaggregated", "--engine-arg=--speculative-config"]
    flags += [f"--engine-arg={json.dumps(NGRAM)}"]
    with _up(env, root / "first.log", *flags) as children:
        yield {"children": children, "env": env, "root": root, "cache": cache}


@pytest.fixture(scope="module")
def engine_url(fleet) -> str:
    return fleet["children"]["engine-0"]["url"]


@pytest.fixture(scope="module")
def gguf_file(fleet) -> Path:
    return fleet["cache"] / SMOLLM2.file_name


@contextlib.contextmanager
def _name_map_built_once():
    """transformers asks gguf for the same (pure) tensor-name map once per tensor, which is
    most of its load time on this model; built once, the reference loads in a few seconds."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


@pytest.fixture(scope="module")
def hf(gguf_file):
    """transformers' own GGUF loading (it dequantizes with the gguf library) in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    with _name_map_built_once():
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    return model, tokenizer


def _chat(url: str, content: str, max_tokens: int, **extra) -> dict:
    body = {
        "model": SMOLLM2.served_name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_up_prepares_the_demo_model_once_from_the_index_and_it_answers(fleet, index):
    assert index.downloads == 1
    log = (fleet["root"] / "first.log").read_text()
    assert "fetching the demo model SmolLM2-135M-Instruct once" in log
    assert f"{SMOLLM2.file_name} is ready" in log
    assert [p.name for p in fleet["cache"].iterdir() if p.suffix == ".whl"] == []  # not kept
    router = fleet["children"]["router"]["url"]
    models = httpx.get(f"{router}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [SMOLLM2.served_name]
    answer = _chat(router, "What is the capital of France?", 16)["choices"][0]["message"]
    assert "Paris" in answer["content"], answer


def test_a_second_start_uses_the_cache_and_fetches_nothing(fleet, index, monkeypatch, capsys):
    """What `pagefleet up` (and `demo`) decide to serve when they start again: the cached
    file, without asking the index for anything."""
    from pagefleet.engine.cache import model_to_serve

    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    for name, value in fleet["env"].items():
        monkeypatch.setenv(name, value)
    path, served = model_to_serve(None, False, None)
    assert (Path(path), served) == (fleet["cache"] / SMOLLM2.file_name, SMOLLM2.served_name)
    assert index.downloads == 1
    assert "fetching" not in capsys.readouterr().err


def test_greedy_chat_through_the_server_equals_transformers(engine_url, hf):
    model, tokenizer = hf
    for content in CHATS:
        served = _chat(engine_url, content, 24)
        messages = [{"role": "user", "content": content}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert served["usage"]["prompt_tokens"] == len(ids)  # our GGUF tokenizer = theirs
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)
        theirs = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        assert served["choices"][0]["message"]["content"] == theirs, content


def _score(url: str, token_ids: list[int]) -> list[dict | None]:
    """The served float engine's prompt logprobs of a token sequence (teacher-forced)."""
    body = {
        "model": SMOLLM2.served_name,
        "prompt": token_ids,
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["prompt_logprobs"]


def test_fp8_kv_cache_agrees_with_the_float_cache_on_real_text(gguf_file, engine_url, capsys):
    """Measured on this model (scales 1.0): top-1 agreement 0.96 and mean |delta logprob|
    0.04 over two chats of 48 tokens; the tiny random checkpoints give 0.90-0.98 with
    near-flat distributions. A cache read with the wrong scale or layout agrees on a few
    percent."""
    from pagefleet.engine.llm import LLM
    from pagefleet.engine.sampling_params import SamplingParams

    fp8 = LLM(str(gguf_file), kv_cache_dtype="fp8", max_model_len=512, kv_cache_memory=0.05)
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=0, ignore_eos=True)
    agree = total = 0
    delta = 0.0
    for content in ["Name three primary colors.", "Write one sentence about the moon."]:
        out = fp8.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
        prompt, tokens = out.prompt_token_ids, out.outputs[0].token_ids
        scored = _score(engine_url, prompt + tokens)
        for i, token in enumerate(tokens):
            ref = scored[len(prompt) + i]
            top = min(ref.items(), key=lambda item: item[1]["rank"])[0]
            agree += int(top) == token
            delta += abs(ref[str(token)]["logprob"] - out.outputs[0].logprobs[i][token].logprob)
            total += 1
    with capsys.disabled():
        print(f"\nfp8 KV on SmolLM2: top-1 {agree / total:.3f}, |dlogprob| {delta / total:.4f}")
    assert agree / total >= MIN_FP8_TOP1_AGREEMENT
    assert 0 < delta / total <= MAX_FP8_MEAN_ABS_DELTA_LOGPROB


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_ngram_speculation_acceptance_on_real_text_is_recorded(engine_url, capsys):
    drafted = _metric(engine_url, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(engine_url, "vllm:spec_decode_num_accepted_tokens_total")
    text = "The cat sat on the mat. The dog sat on the log. The cat sat on the"
    _chat(engine_url, f"Repeat this text exactly, twice: {text}", 48)
    drafted = _metric(engine_url, "vllm:spec_decode_num_draft_tokens_total") - drafted
    accepted = _metric(engine_url, "vllm:spec_decode_num_accepted_tokens_total") - accepted
    with capsys.disabled():
        print(f"\nn-gram speculation on SmolLM2: {accepted:.0f}/{drafted:.0f} drafts accepted")
    assert drafted > 0 and 0 < accepted <= drafted


# A multiple-choice task this test writes (no dataset download), on facts a chat model knows.
MC_QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid"], 0),
    ("How many days are in a week?", ["five", "seven", "ten"], 1),
    ("What colour is the sky on a clear day?", ["green", "red", "blue"], 2),
    ("Which animal barks?", ["a dog", "a fish", "a bird"], 0),
]
MC_TASK = """task: pagefleet_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _lm_eval(backend, tasks_dir: Path, **model_args) -> list[dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=backend,
        model_args=model_args or None,
        tasks=["pagefleet_facts"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        batch_size=1,
        log_samples=True,
    )
    return results["samples"]["pagefleet_facts"]


def test_lm_eval_local_completions_against_the_server_equals_its_hf_backend(
    gguf_file, hf, tmp_path, capsys
):
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = hf
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in MC_QUESTIONS]
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "facts.yaml").write_text(MC_TASK.format(data=tmp_path / "facts.jsonl"))
    tokenizer.save_pretrained(tmp_path / "tokenizer")  # both sides tokenize alike
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    flags = ("--quantization", "none", "--dtype", "float32", "--max-model-len", "512")
    with running_server(str(gguf_file), *flags, timeout=180) as (engine_url, _):
        served = _lm_eval(
            "local-completions",
            tmp_path,
            model="tiny",
            base_url=f"{engine_url}/v1/completions",
            tokenizer=str(tmp_path / "tokenizer"),
            tokenizer_backend="huggingface",
            num_concurrent=1,
            max_retries=1,
        )
    reference = _lm_eval(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), tmp_path)

    def loglikelihoods(samples):
        return {(s["doc_id"], i): float(r[0][0]) for s in samples for i, r in enumerate(s["resps"])}

    ours, theirs = loglikelihoods(served), loglikelihoods(reference)
    assert ours.keys() == theirs.keys() and len(ours) == 12
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    assert worst <= MAX_LOGLIKELIHOOD_DELTA, worst
    accuracy = [sorted((s["doc_id"], s["acc"]) for s in run) for run in (served, reference)]
    with capsys.disabled():
        correct = sum(acc for _, acc in accuracy[0])
        print(f"\nlm-eval on SmolLM2: max |dloglikelihood| {worst:.2e}, {correct:.0f}/4 correct")
    assert accuracy[0] == accuracy[1]
    assert sum(acc for _, acc in accuracy[0]) >= 3  # a trained model knows these


ROOT = Path(__file__).resolve().parents[1]
RUN_AS_WRITTEN = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def _commands(block: str) -> list[list[str]]:
    """A bash block's commands as words (continued lines and quotes spanning lines joined,
    comments dropped)."""
    commands, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quoted string goes on to the next line
            continue
        if words:
            commands.append(words)
        pending = ""
    assert not pending, f"unterminated command: {pending}"
    return commands


def _run_as_written(words: list[str], router: str, answers: list[dict]) -> None:
    """curl runs against the test's fleet (its port for 8000) and must print the page's
    answer; a make target must exist (`make -n`: the fleet above is what `make up` runs, and
    `make test` is this suite); a pagefleet command must parse with its real flags."""
    from pagefleet.common.cli import build_parser

    if words[0] == "curl":
        words = [w.replace("http://127.0.0.1:8000", router) for w in words]
        out = subprocess.run(words, capture_output=True, text=True, timeout=120, check=True)
        if "chat/completions" in words[2]:
            message = json.loads(out.stdout)["choices"][0]["message"]
            assert {k: message[k] for k in ("role", "content")} in answers, out.stdout
        else:
            assert out.stdout, words
    elif words[0] == "make":
        dry = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True)
        assert dry.returncode == 0 and dry.stdout, dry.stderr
    else:
        assert words[0] in ("pagefleet", ".venv/bin/pagefleet"), f"unknown command {words}"
        build_parser().parse_args(words[1:])


def test_readme_and_getting_started_commands_run_as_written(fleet):
    router = fleet["children"]["router"]["url"]
    for page in RUN_AS_WRITTEN:
        text = page.read_text()
        answers = [json.loads(block) for block in _blocks(text, "json")]
        commands = [words for block in _blocks(text, "bash") for words in _commands(block)]
        assert any(w[0] == "curl" and "chat/completions" in w[2] for w in commands), page
        for words in commands:
            _run_as_written(words, router, answers)
