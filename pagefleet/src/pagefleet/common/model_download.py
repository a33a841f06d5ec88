"""Fetch a model from a Hugging Face endpoint into the shared model cache, once: `pagefleet
download hf://ORG/NAME[@REVISION] --cache-dir DIR [--tokenizer-only]`, the init container of
engine and router pods. The URI rules and the cache layout are pure (the operator imports them
without huggingface_hub); the download runs under a file lock beside the model's folder so
replicas sharing a ReadWriteMany claim fetch each file once, and a marker file records a
complete copy so that a pinned commit restarts without the network."""

from __future__ import annotations

import argparse
import errno
import fcntl
import fnmatch
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

SCHEME = "hf://"
DEFAULT_REVISION = "main"
MARKER = ".pagefleet-complete"
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
TERMINATION_LIMIT = 4000  # the kubelet keeps 4096 bytes of a termination message
EXIT_FAILED = 2
TOKEN_SETTING = "the ModelDeployment's model.hf.tokenSecret"
# Hugging Face's rules for a namespace or a repo name (huggingface_hub's validate_repo_id): ASCII
# letters, digits, '-', '_', '.'; starts and ends with a letter or digit; no '--' or '..'.
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_MAX_REPO_ID = 96
# A branch, a tag or a commit: one path segment (it names a folder of the cache).
_REVISION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,126}[A-Za-z0-9])?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# What a tokenizer (and the router's prompt rendering) reads; no weights.
TOKENIZER_PATTERNS = (
    "tokenizer*.json",
    "tokenizer.model",
    "*.tiktoken",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "config.json",
    "generation_config.json",
    "chat_template.json",
    "*.jinja",
)
SCOPE_FULL = "full"
SCOPE_TOKENIZER = "tokenizer"


@dataclass(frozen=True)
class HfSource:
    """A model on a Hugging Face endpoint: `org/name` at a branch, tag or commit."""

    repo: str
    revision: str = DEFAULT_REVISION

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.repo}@{self.revision}"


@dataclass(frozen=True)
class Marker:
    """What a complete copy holds: the commit it came from and whether it has the weights."""

    commit: str
    scope: str

    def covers(self, scope: str) -> bool:
        return self.scope == SCOPE_FULL or self.scope == scope


class DownloadError(Exception):
    """A download that cannot succeed; its message is one line a user can act on."""


# --- pure: URIs, paths, file selection, error messages -------------------------------------


def parse_hf_uri(uri: str) -> HfSource:
    """`hf://ORG/NAME[@REVISION]` -> HfSource; ValueError says what is wrong."""
    if not isinstance(uri, str) or not uri.startswith(SCHEME):
        raise ValueError(f"model URI {uri!r} must start with {SCHEME} (hf://ORG/NAME[@REVISION])")
    rest = uri[len(SCHEME) :]
    repo, at, revision = rest.partition("@")
    if at and not revision:
        raise ValueError(f"model URI {uri!r} has an empty revision after '@'")
    _check_repo(uri, repo)
    if at:
        _check_revision(uri, revision)
    return HfSource(repo=repo, revision=revision or DEFAULT_REVISION)


def _check_repo(uri: str, repo: str) -> None:
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"model URI {uri!r} must name a repo as ORG/NAME, got {repo!r}")
    if len(repo) > _MAX_REPO_ID:
        raise ValueError(f"model URI {uri!r}: repo id longer than {_MAX_REPO_ID} characters")
    for part in parts:
        if ".." in part or "--" in part:
            raise ValueError(f"model URI {uri!r}: {part!r} contains '..' or '--'")
        if not _NAME.fullmatch(part):
            raise ValueError(
                f"model URI {uri!r}: {part!r} may hold only letters, digits, '-', '_' and '.', "
                "and must start and end with a letter or digit"
            )
    if parts[1].endswith(".git"):
        raise ValueError(f"model URI {uri!r}: a repo name cannot end in '.git'")


def _check_revision(uri: str, revision: str) -> None:
    if ".." in revision or not _REVISION.fullmatch(revision) or revision.endswith(".lock"):
        raise ValueError(
            f"model URI {uri!r}: revision {revision!r} must be a branch, tag or commit sha of "
            "letters, digits, '-', '_' and '.' (no '/', no '..', not ending in '.lock'; "
            "pin a pull request by its commit sha)"
        )


def cache_path(cache_dir: str | Path, source: HfSource) -> Path:
    """Where a source's files live in the model cache: `<cache_dir>/hf/<org>/<name>/<revision>`
    (the engine's `--model`)."""
    org, name = source.repo.split("/")
    return Path(cache_dir) / "hf" / org / name / source.revision


def lock_path(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


def is_commit(revision: str) -> bool:
    return _COMMIT.fullmatch(revision) is not None


def select_files(files: Sequence[str], patterns: Sequence[str] | None) -> list[str]:
    """The files a download fetches: all of them, or those matching a pattern (fnmatch, as
    huggingface_hub's allow_patterns)."""
    if patterns is None:
        return list(files)
    return [f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)]


def parse_marker(text: str) -> Marker | None:
    lines = text.split()
    if len(lines) == 2 and is_commit(lines[0]) and lines[1] in (SCOPE_FULL, SCOPE_TOKENIZER):
        return Marker(commit=lines[0], scope=lines[1])
    return None


def format_marker(marker: Marker) -> str:
    return f"{marker.commit}\n{marker.scope}\n"


@dataclass(frozen=True)
class Failure:
    """What went wrong, in terms the message needs (no exception objects, no token)."""

    # gated, not_found, revision, bad_token, forbidden, unreachable, offline, disk, incomplete, http
    kind: str
    status: int | None = None
    detail: str = ""


def failure_message(
    failure: Failure, source: HfSource, *, endpoint: str, has_token: bool, target: Path
) -> str:
    """One line a user can act on; never the token."""
    model = f"model {source.repo}"
    kind = failure.kind
    if kind in ("gated", "bad_token", "forbidden") and not has_token:
        gated = " is gated: it" if kind == "gated" else ""
        return (
            f"{model}{gated} needs a Hugging Face token with access: set {TOKEN_SETTING} (HF_TOKEN)"
        )
    if kind in ("gated", "forbidden"):
        return (
            f"the Hugging Face token (HF_TOKEN) has no access to {model}: accept the model's "
            "conditions on its page with the token's account, or set another token in "
            f"{TOKEN_SETTING}"
        )
    if kind == "not_found":
        hint = (
            "or the token has no access to it"
            if has_token
            else f"a private model needs a token: set {TOKEN_SETTING}"
        )
        return f"{model} was not found at {endpoint} ({hint})"
    if kind == "revision":
        return f"{model} has no revision {source.revision!r} at {endpoint}"
    if kind == "bad_token":
        return (
            f"{endpoint} rejected the Hugging Face token (HF_TOKEN) for {model}: check the "
            f"Secret named by {TOKEN_SETTING}"
        )
    if kind == "unreachable":
        return (
            f"cannot reach the Hugging Face endpoint {endpoint} for {model} ({failure.detail}): "
            "check HF_ENDPOINT, DNS and the pod's egress"
        )
    if kind == "offline":
        return (
            f"{model} has no complete copy at {target} and HF_HUB_OFFLINE is on: "
            "run pagefleet download with HF_HUB_OFFLINE=0"
        )
    if kind == "disk":
        return f"cannot write {model} to {target}: {failure.detail}"
    if kind == "incomplete":
        return f"{model} downloaded incompletely to {target}: missing {failure.detail}"
    return f"downloading {model} from {endpoint} failed: HTTP {failure.status}"


# --- I/O: the lock, the marker, huggingface_hub --------------------------------------------


def read_marker(target: Path) -> Marker | None:
    try:
        return parse_marker((target / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None


def write_marker(target: Path, marker: Marker) -> None:
    tmp = target / (MARKER + ".tmp")
    tmp.write_text(format_marker(marker))
    os.replace(tmp, target / MARKER)  # atomic: a reader sees no marker or a whole one


@contextmanager
def exclusive_lock(path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """An exclusive POSIX lock on `path` (lockf: honoured across NFS clients, the usual
    ReadWriteMany backend); `on_wait` runs once when another process holds it."""
    with open(path, "a+b") as handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            on_wait()
            fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Fetched:
    path: Path
    commit: str
    reused: bool  # a complete copy was already there
    stale: bool = False  # the endpoint was unreachable: a branch's earlier commit is served


@dataclass(frozen=True)
class Hub:
    """The endpoint this process talks to, as huggingface_hub sees it (HF_ENDPOINT, HF_TOKEN)."""

    endpoint: str
    has_token: bool


def _log(message: str) -> None:
    print(f"pagefleet download: {message}", file=sys.stderr, flush=True)


def fetch(source: HfSource, cache_dir: str | Path, *, tokenizer_only: bool = False) -> Fetched:
    """Make `cache_path(cache_dir, source)` a complete copy of the source (or of its tokenizer
    and config files); DownloadError, with a message for the user, when it cannot."""
    target = cache_path(cache_dir, source)
    scope = SCOPE_TOKENIZER if tokenizer_only else SCOPE_FULL
    done = read_marker(target)
    if _pinned_and_done(source, done, scope):
        return Fetched(target, done.commit, reused=True)  # no lock, no network: offline-safe
    hub = _hub()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        waiting = partial(_log, f"waiting for another download into {target}")
        with exclusive_lock(lock_path(target), waiting):
            return _fetch_locked(source, target, scope, hub)
    except DownloadError:
        raise
    except Exception as e:
        failure = classify(e)
        raise DownloadError(
            failure_message(
                failure, source, endpoint=hub.endpoint, has_token=hub.has_token, target=target
            )
        ) from None


def _hub() -> Hub:
    try:
        from huggingface_hub import constants, get_token
    except ImportError:
        raise DownloadError(
            "pagefleet download needs huggingface_hub: pip install 'pagefleet-common[tokenizer]'"
        ) from None
    return Hub(endpoint=constants.ENDPOINT, has_token=get_token() is not None)


def _pinned_and_done(source: HfSource, done: Marker | None, scope: str) -> bool:
    return (
        done is not None
        and is_commit(source.revision)
        and done.commit == source.revision
        and done.covers(scope)
    )


def _fetch_locked(source: HfSource, target: Path, scope: str, hub: Hub) -> Fetched:
    from huggingface_hub import HfApi, snapshot_download

    done = read_marker(target)
    if _pinned_and_done(source, done, scope):
        return Fetched(target, done.commit, reused=True)  # the replica we waited for fetched it
    try:
        info = HfApi().model_info(source.repo, revision=source.revision)
    except Exception as e:
        if done and done.covers(scope) and classify(e).kind in ("unreachable", "offline"):
            # A restart while the endpoint is down keeps serving the last complete copy.
            _log(f"{hub.endpoint} unreachable: using commit {done.commit} already in {target}")
            return Fetched(target, done.commit, reused=True, stale=True)
        raise
    commit = info.sha
    if done and done.commit == commit and done.covers(scope):
        return Fetched(target, commit, reused=True)
    patterns = list(TOKENIZER_PATTERNS) if scope == SCOPE_TOKENIZER else None
    wanted = select_files([s.rfilename for s in info.siblings or []], patterns)
    (target / MARKER).unlink(missing_ok=True)  # an interrupted update is not a complete copy
    _log(f"fetching {len(wanted)} files of {source.repo} at {commit} into {target}")
    snapshot_download(source.repo, revision=commit, local_dir=target, allow_patterns=patterns)
    missing = [f for f in wanted if not (target / f).is_file()]
    if missing:
        failure = Failure("incomplete", detail=", ".join(missing[:5]))
        raise DownloadError(
            failure_message(
                failure, source, endpoint=hub.endpoint, has_token=hub.has_token, target=target
            )
        )
    write_marker(target, Marker(commit, scope))
    return Fetched(target, commit, reused=False)


def _exception_chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level errors of whichever HTTP client this huggingface_hub uses (httpx2,
    httpx or requests, by version)."""
    import importlib

    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "ConnectionError"),
        ("requests", "Timeout"),
    ):
        with suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


def classify(error: BaseException) -> Failure:
    """The first cause in `error`'s chain that says what went wrong."""
    from huggingface_hub.utils import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    transport = _transport_errors()
    for cause in _exception_chain(error):
        if isinstance(cause, GatedRepoError):
            return Failure("gated")
        if isinstance(cause, RepositoryNotFoundError):
            return Failure("not_found")
        if isinstance(cause, RevisionNotFoundError):
            return Failure("revision")
        if isinstance(cause, OfflineModeIsEnabled):
            return Failure("offline")
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            return _http_failure(cause.response.status_code)
        if isinstance(cause, transport):
            return Failure("unreachable", detail=type(cause).__name__)
        if isinstance(cause, OSError) and not isinstance(cause, LocalEntryNotFoundError):
            return Failure("disk", detail=cause.strerror or str(cause))
    # huggingface_hub's "cannot find the files and cannot reach the Hub", with no cause left.
    return Failure("unreachable", detail=type(error).__name__)


def _http_failure(status: int) -> Failure:
    if status == 401:
        return Failure("bad_token", status)
    if status == 403:
        return Failure("forbidden", status)
    return Failure("http", status)


# --- the command ---------------------------------------------------------------------------


def add_download_parser(sub) -> None:
    p = sub.add_parser(
        "download",
        help="fetch hf://ORG/NAME[@REVISION] into a model cache, once (the init container of "
        "engine and router pods); prints the model's folder",
    )
    p.add_argument("uri", help="hf://ORG/NAME[@REVISION] (REVISION: branch, tag or commit; main)")
    p.add_argument(
        "--cache-dir",
        required=True,
        help="the model cache; files land in CACHE_DIR/hf/ORG/NAME/REVISION",
    )
    p.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="fetch tokenizer, config and chat-template files only, no weights (the router)",
    )
    p.add_argument(
        "--termination-log",
        default=TERMINATION_LOG,
        help="a failure's message also goes to this file when it exists and is writable "
        f"(Kubernetes' terminationMessagePath; {TERMINATION_LOG})",
    )
    p.set_defaults(func=run_download_command)


def run_download_command(args: argparse.Namespace) -> int:
    try:
        source = parse_hf_uri(args.uri)
        fetched = fetch(source, args.cache_dir, tokenizer_only=args.tokenizer_only)
    except (ValueError, DownloadError) as e:
        print(f"pagefleet download: error: {e}", file=sys.stderr, flush=True)
        report_termination(Path(args.termination_log), str(e))
        return EXIT_FAILED
    state = "already complete" if fetched.reused else "downloaded"
    _log(f"{source.uri} (commit {fetched.commit}) {state} in {fetched.path}")
    print(fetched.path, flush=True)
    return 0


def report_termination(path: Path, message: str) -> None:
    """Kubernetes shows this file's text in the pod's status (kubectl describe pod). Written
    only where it already exists: outside a pod, nothing is created under /dev."""
    if not (path.is_file() and os.access(path, os.W_OK)):
        return
    with suppress(OSError):  # the message is on stderr too
        path.write_text(message[:TERMINATION_LIMIT] + "\n")
