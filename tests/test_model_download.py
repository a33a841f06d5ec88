"""`pagefleet download hf://ORG/NAME[@REVISION] --cache-dir DIR`, the init container that fills
the model cache: the URI rules and cache layout the operator relies on, and the real command
against a stand-in Hugging Face endpoint on 127.0.0.1 (tests/hf_stand_in.py) serving a tiny
checkpoint this file writes: public and gated models, tokens, missing repos and revisions, an
unreachable endpoint, two replicas at once, restarts without the network, the router's
tokenizer-only fetch."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hf_stand_in import HfStandIn, files_of
from pagefleet.common.model_download import (
    MARKER,
    TOKENIZER_PATTERNS,
    HfSource,
    Marker,
    cache_path,
    format_marker,
    parse_hf_uri,
    parse_marker,
    select_files,
)
from server_utils import free_port, wait_until

PAGEFLEET = str(Path(sys.executable).parent / "pagefleet")
REPO = "tiny-org/tiny-llama"
GOOD_TOKEN = "hf_granted_0123456789abcdef"
WEIGHTS = ".safetensors"


# --- the URI and the cache layout (pure) ---------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "repo", "revision"),
    [
        ("hf://meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", "main"),
        ("hf://Qwen/Qwen2.5-0.5B@v1.0", "Qwen/Qwen2.5-0.5B", "v1.0"),
        (
            "hf://a/b@" + "0123456789abcdef" * 2 + "01234567",
            "a/b",
            "0123456789abcdef" * 2 + "01234567",
        ),
        (
            "hf://org_1/name.with_dots-and-dashes@release_2",
            "org_1/name.with_dots-and-dashes",
            "release_2",
        ),
        ("hf://x/y", "x/y", "main"),
    ],
)
def test_good_uris_parse_to_repo_and_revision(uri, repo, revision):
    assert parse_hf_uri(uri) == HfSource(repo=repo, revision=revision)


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("meta-llama/Llama-3.1-8B", "must start with hf://"),
        ("https://huggingface.co/org/name", "must start with hf://"),
        ("hf://name-only", "ORG/NAME"),
        ("hf://a/b/c", "ORG/NAME"),
        ("hf://a//b", "ORG/NAME"),
        ("hf:///b", "ORG/NAME"),
        ("hf://a/", "ORG/NAME"),
        ("hf://", "ORG/NAME"),
        ("hf://a/b@", "empty revision"),
        ("hf://../b", "'..'"),
        ("hf://a/..", "'..'"),
        ("hf://a/b..c", "'..'"),
        ("hf://a/b--c", "'--'"),
        ("hf://a/-b", "start and end with a letter or digit"),
        ("hf://a/b.", "start and end with a letter or digit"),
        ("hf://a/b c", "letters, digits"),
        ("hf://a/café", "letters, digits"),
        ("hf://a/b\n", "letters, digits"),
        ("hf://a/b.git", ".git"),
        ("hf://a/" + "x" * 100, "longer than 96"),
        ("hf://a/b@../../etc", "revision"),
        ("hf://a/b@refs/pr/1", "no '/'"),
        ("hf://a/b@-main", "revision"),
        ("hf://a/b@main.lock", ".lock"),
        ("hf://a/b@v1..2", "revision"),
        ("hf://a/b@" + "x" * 200, "revision"),
        ("hf://a/b@c@d", "revision"),
    ],
)
def test_bad_uris_are_refused_with_the_reason(uri, says):
    with pytest.raises(ValueError, match="model URI") as refused:
        parse_hf_uri(uri)
    assert says in str(refused.value)


def test_cache_path_is_the_engine_model_path():
    source = parse_hf_uri("hf://meta-llama/Llama-3.1-8B-Instruct")
    assert cache_path("/model-cache", source) == Path(
        "/model-cache/hf/meta-llama/Llama-3.1-8B-Instruct/main"
    )
    pinned = parse_hf_uri("hf://Qwen/Qwen2.5-0.5B@" + "a" * 40)
    assert cache_path(Path("/c"), pinned) == Path("/c/hf/Qwen/Qwen2.5-0.5B/" + "a" * 40)


def test_the_operator_can_use_the_uri_rules_without_huggingface_hub():
    """The operator image has no huggingface_hub: importing the module must not need it."""
    code = (
        "import sys\n"
        "sys.modules['huggingface_hub'] = None\n"
        "from pagefleet.common.model_download import parse_hf_uri, cache_path\n"
        "print(cache_path('/m', parse_hf_uri('hf://o/n@v1')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "/m/hf/o/n/v1"


def test_tokenizer_patterns_take_tokenizer_and_config_files_and_no_weights():
    files = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "qwen.tiktoken",
        "chat_template.jinja",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "README.md",
    ]
    assert select_files(files, TOKENIZER_PATTERNS) == files[:10]
    assert select_files(files, None) == files


def test_marker_round_trips_and_garbage_is_no_marker():
    marker = Marker("f" * 40, "full")
    assert parse_marker(format_marker(marker)) == marker
    assert marker.covers("tokenizer") and not Marker("f" * 40, "tokenizer").covers("full")
    for text in ("", "main\nfull\n", "f" * 40 + "\nweights\n", "f" * 39 + "\nfull\n"):
        assert parse_marker(text) is None


def test_engine_and_router_images_install_huggingface_hub_and_the_command():
    """The init container runs in the engine or router image: both install pagefleet-common's
    `tokenizer` extra, which must bring huggingface_hub; pagefleet-common registers the command."""
    root = Path(__file__).resolve().parent.parent
    common = tomllib.loads((root / "pagefleet" / "pyproject.toml").read_text())["project"]
    assert any(
        d.startswith("huggingface_hub>=") for d in common["optional-dependencies"]["tokenizer"]
    )
    assert not any(d.startswith("huggingface_hub") for d in common["dependencies"])  # operator
    commands = common["entry-points"]["pagefleet.commands"]
    assert commands["download"] == "pagefleet.common.model_download:add_download_parser"
    for role in ("engine", "router"):
        deps = tomllib.loads((root / role / "pyproject.toml").read_text())["project"][
            "dependencies"
        ]
        assert any(d.startswith("pagefleet-common[tokenizer]") for d in deps), role


# --- the command against the stand-in endpoint ----------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny llama checkpoint in two safetensors shards, tokenizer and config."""
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    folder = tmp_path_factory.mktemp("hf-source") / "tiny-llama"
    return write_tiny_checkpoint(folder, "LlamaForCausalLM", max_shard_size="100KB")


@pytest.fixture
def hub():
    with HfStandIn() as stand_in:
        yield stand_in


@pytest.fixture
def termination_log(tmp_path) -> Path:
    path = tmp_path / "termination-log"
    path.write_text("")  # the kubelet creates it; the command only writes an existing one
    return path


def download_env(endpoint: str, home: Path, token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HUB_OFFLINE="0",  # what the operator sets (the images set 1)
        HF_HOME=str(home / "hf"),  # no token stored by a developer's `hf auth login`
        HOME=str(home),
        HF_HUB_DISABLE_PROGRESS_BARS="1",
    )
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def download(
    uri: str,
    cache: Path,
    endpoint: str,
    *extra: str,
    token: str | None = None,
    termination_log: Path | None = None,
) -> subprocess.CompletedProcess:
    args = [PAGEFLEET, "download", uri, "--cache-dir", str(cache), *extra]
    if termination_log is not None:
        args += ["--termination-log", str(termination_log)]
    env = download_env(endpoint, cache.parent, token)
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def error_line(out: subprocess.CompletedProcess) -> str:
    """The command's one error line (stderr may hold progress lines before it)."""
    lines = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_public_model_lands_at_the_contract_path_and_the_engine_loads_it(hub, checkpoint, tmp_path):
    import torch

    from pagefleet.common.tokenizer import load_tokenizer
    from pagefleet.engine.model.loader import load_model

    sha = hub.add_repo(REPO, checkpoint)
    cache = tmp_path / "model-cache"
    out = download(f"hf://{REPO}", cache, hub.endpoint)
    assert out.returncode == 0, out.stderr
    path = cache / "hf" / "tiny-org" / "tiny-llama" / "main"
    assert out.stdout.strip() == str(path)
    served = {k: v for k, v in files_of(path).items() if not k.startswith(".")}
    assert served == files_of(checkpoint)
    assert sum(name.endswith(WEIGHTS) for name in served) >= 2
    assert parse_marker((path / MARKER).read_text()) == Marker(sha, "full")
    text = "the quick brown fox"
    assert load_tokenizer(path).encode(text) == load_tokenizer(checkpoint).encode(text)
    model = load_model(path, torch.float32, torch.device("cpu"), max_positions=64)
    reference = load_model(checkpoint, torch.float32, torch.device("cpu"), max_positions=64)
    assert torch.equal(model.embed_tokens.weight, reference.embed_tokens.weight)


def test_gated_model_needs_a_token_with_access_and_never_prints_it(
    hub, checkpoint, tmp_path, termination_log
):
    hub.add_repo(REPO, checkpoint, gated_tokens={GOOD_TOKEN})
    cache = tmp_path / "model-cache"
    uri = f"hf://{REPO}"

    anonymous = download(uri, cache, hub.endpoint, termination_log=termination_log)
    assert anonymous.returncode == 2
    line = error_line(anonymous)
    assert f"model {REPO} is gated: it needs a Hugging Face token with access" in line
    assert "model.hf.tokenSecret" in line
    assert termination_log.read_text().strip() == line.split("error: ", 1)[1]

    wrong = "hf_not_granted_fedcba9876543210"
    refused = download(uri, cache, hub.endpoint, token=wrong, termination_log=termination_log)
    assert refused.returncode == 2
    assert f"has no access to model {REPO}" in error_line(refused)
    assert "model.hf.tokenSecret" in error_line(refused)
    assert not (cache_path(cache, parse_hf_uri(uri)) / MARKER).exists()

    granted = download(uri, cache, hub.endpoint, token=GOOD_TOKEN)
    assert granted.returncode == 0, granted.stderr
    assert (Path(granted.stdout.strip()) / "config.json").is_file()
    for out in (anonymous, refused, granted):
        assert wrong not in out.stdout + out.stderr and GOOD_TOKEN not in out.stdout + out.stderr
    assert wrong not in termination_log.read_text()


def test_missing_repo_and_missing_revision_fail_with_what_is_missing(
    hub, checkpoint, tmp_path, termination_log
):
    hub.add_repo(REPO, checkpoint)
    cache = tmp_path / "model-cache"

    missing = download("hf://tiny-org/no-such-model", cache, hub.endpoint)
    assert missing.returncode == 2
    line = error_line(missing)
    assert f"model tiny-org/no-such-model was not found at {hub.endpoint}" in line
    assert "private model needs a token" in line

    with_token = download("hf://tiny-org/no-such-model", cache, hub.endpoint, token=GOOD_TOKEN)
    assert "or the token has no access to it" in error_line(with_token)

    revision = download(f"hf://{REPO}@v9", cache, hub.endpoint, termination_log=termination_log)
    assert revision.returncode == 2
    assert f"model {REPO} has no revision 'v9' at {hub.endpoint}" in error_line(revision)
    assert "no revision 'v9'" in termination_log.read_text()
    assert hub.file_gets(REPO) == {}


def test_unreachable_endpoint_fails_clearly(tmp_path, termination_log):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = download(f"hf://{REPO}", tmp_path / "c", endpoint, termination_log=termination_log)
    assert out.returncode == 2
    assert f"cannot reach the Hugging Face endpoint {endpoint}" in error_line(out)
    assert "HF_ENDPOINT" in termination_log.read_text()


def test_a_bad_uri_exits_2_with_the_reason(tmp_path, termination_log):
    out = download("hf://org/x@../../etc", tmp_path / "c", "http://127.0.0.1:9",
                   termination_log=termination_log)  # fmt: skip
    assert out.returncode == 2
    assert "revision '../../etc'" in error_line(out)
    assert "revision '../../etc'" in termination_log.read_text()
    assert not (tmp_path / "c").exists()


def test_two_replicas_at_once_fetch_each_file_once(hub, checkpoint, tmp_path):
    """Catches a download without the lock: the second replica would fetch every file too."""
    hub.add_repo(REPO, checkpoint)
    cache = tmp_path / "model-cache"
    args = [PAGEFLEET, "download", f"hf://{REPO}", "--cache-dir", str(cache)]
    # The held GET must outwait a second replica's start on a busy box (10 s by default).
    env = {**download_env(hub.endpoint, tmp_path, None), "HF_HUB_DOWNLOAD_TIMEOUT": "300"}
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    hub.hold_files()  # the first replica stays in flight, holding the lock
    procs = []
    try:
        with logs[0].open("w") as err:
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, env=env))
        wait_until(lambda: sum(hub.file_gets(REPO).values()) > 0, 120, "the first file GET")
        with logs[1].open("w") as err:
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, env=env))
        wait_until(
            lambda: "waiting for another download" in logs[1].read_text(),
            120,
            "the second replica to wait on the lock",
        )
    finally:
        hub.release_files()
    outs = [p.communicate(timeout=300)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [log.read_text() for log in logs]
    assert outs[0] == outs[1] == str(cache / "hf" / "tiny-org" / "tiny-llama" / "main")
    assert hub.file_gets(REPO) == dict.fromkeys(files_of(checkpoint), 1)
    assert "already complete" in logs[1].read_text()


def test_a_pinned_commit_restarts_without_the_endpoint(checkpoint, tmp_path):
    cache = tmp_path / "model-cache"
    with HfStandIn() as hub:
        sha = hub.add_repo(REPO, checkpoint)
        first = download(f"hf://{REPO}@{sha}", cache, hub.endpoint)
        assert first.returncode == 0, first.stderr
        endpoint = hub.endpoint
    # The endpoint is gone: a restart finds the marker and needs no network at all (not even
    # a failed attempt, which the fallback for branches would forgive).
    again = download(f"hf://{REPO}@{sha}", cache, endpoint)
    assert again.returncode == 0, again.stderr
    assert "unreachable" not in again.stderr
    with HfStandIn() as watching:
        assert download(f"hf://{REPO}@{sha}", cache, watching.endpoint).returncode == 0
        assert not watching.requests
    assert (
        again.stdout.strip() == first.stdout.strip() == str(cache_path(cache, HfSource(REPO, sha)))
    )
    # The router's tokenizer-only fetch of the same commit finds the full copy just as well.
    router = download(f"hf://{REPO}@{sha}", cache, endpoint, "--tokenizer-only")
    assert router.returncode == 0, router.stderr


def test_a_branch_restarts_on_its_last_complete_copy_when_the_endpoint_is_down(
    checkpoint, tmp_path
):
    cache = tmp_path / "model-cache"
    with HfStandIn() as hub:
        sha = hub.add_repo(REPO, checkpoint)
        assert download(f"hf://{REPO}", cache, hub.endpoint).returncode == 0
        endpoint = hub.endpoint
    out = download(f"hf://{REPO}", cache, endpoint)
    assert out.returncode == 0, out.stderr
    assert f"unreachable: using commit {sha}" in out.stderr
    never = download(f"hf://{REPO}@other", cache, endpoint)
    assert never.returncode == 2 and "cannot reach" in error_line(never)


def test_a_moved_branch_fetches_the_new_commit(hub, checkpoint, tmp_path):
    hub.add_repo(REPO, checkpoint)
    cache = tmp_path / "model-cache"
    assert download(f"hf://{REPO}", cache, hub.endpoint).returncode == 0
    changed = {**files_of(checkpoint), "generation_config.json": b'{"temperature": 0.5}'}
    sha = hub.add_repo(REPO, changed)
    out = download(f"hf://{REPO}", cache, hub.endpoint)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert (path / "generation_config.json").read_bytes() == b'{"temperature": 0.5}'
    assert parse_marker((path / MARKER).read_text()) == Marker(sha, "full")
    assert hub.gets(REPO, "generation_config.json") == 2
    assert all(hub.gets(REPO, f) == 1 for f in files_of(checkpoint) if f.endswith(WEIGHTS))


def test_tokenizer_only_fetches_no_weights_and_a_full_fetch_still_gets_them(
    hub, checkpoint, tmp_path
):
    from pagefleet.common.tokenizer import load_tokenizer

    sha = hub.add_repo(REPO, checkpoint)
    weights = [f for f in files_of(checkpoint) if f.endswith(WEIGHTS)]
    cache = tmp_path / "model-cache"
    out = download(f"hf://{REPO}", cache, hub.endpoint, "--tokenizer-only")
    assert out.returncode == 0, out.stderr
    path = cache / "hf" / "tiny-org" / "tiny-llama" / "main"
    assert out.stdout.strip() == str(path)
    assert not list(path.glob("*" + WEIGHTS))
    assert all(hub.gets(REPO, f) == 0 for f in weights)
    assert all(hub.requests[("HEAD", REPO, f)] == 0 for f in weights)
    assert load_tokenizer(path).encode("hello") == load_tokenizer(checkpoint).encode("hello")
    assert parse_marker((path / MARKER).read_text()) == Marker(sha, "tokenizer")
    # The engine sharing the cache must not take the router's copy for a complete one.
    full = download(f"hf://{REPO}", cache, hub.endpoint)
    assert full.returncode == 0, full.stderr
    assert all((path / f).read_bytes() == (checkpoint / f).read_bytes() for f in weights)
    assert parse_marker((path / MARKER).read_text()) == Marker(sha, "full")
    # And the router after the engine takes the full copy as it is.
    again = download(f"hf://{REPO}", cache, hub.endpoint, "--tokenizer-only")
    assert again.returncode == 0 and "already complete" in again.stderr
