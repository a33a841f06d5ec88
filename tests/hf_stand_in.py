"""A stand-in Hugging Face Hub endpoint for tests: a real HTTP server (one thread) that serves
the calls huggingface_hub makes for `snapshot_download` (model info with `sha` and `siblings`,
the recursive tree listing, HEAD and GET of `/resolve/`), with the Hub's error headers
(`X-Error-Code`) for a missing repo, revision or file and for a gated repo. It counts requests
per file so a test can tell how often each file's content was sent.

    with HfStandIn() as hub:                      # 127.0.0.1, a free port
        hub.add_repo("org/tiny", checkpoint_dir)  # -> commit sha
        env = {"HF_ENDPOINT": hub.endpoint}
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

MAX_URL = 4096  # the stand-in only ever answers huggingface_hub: refuse anything larger
HOLD_LIMIT = 120.0  # seconds a held file GET waits at most (a test that forgot to release)
API = "/api"  # the request counters' key for API calls (no repo file's path starts with "/")


@dataclass
class StandInRepo:
    """One model repo: commits (sha -> files) and the branches that point at them."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    gated_tokens: frozenset[str] | None = None  # None: public; else the tokens granted access

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.branches.get(revision)


def files_of(folder: Path) -> dict[str, bytes]:
    """Every regular file under `folder`, keyed by its '/'-separated relative path."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def commit_sha(repo_id: str, files: dict[str, bytes], parent: str | None) -> str:
    digest = hashlib.sha1(f"{repo_id}\0{parent}".encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha1(files[name]).digest())
    return digest.hexdigest()


def etag(content: bytes) -> str:
    return f'"{hashlib.sha1(content).hexdigest()}"'


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def error_reply(status: int, code: str | None, message: str) -> Reply:
    headers = {"X-Error-Message": message, "Content-Type": "application/json"}
    if code:
        headers["X-Error-Code"] = code
    return Reply(status, json.dumps({"error": message}).encode(), headers)


def json_reply(doc) -> Reply:
    return Reply(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})


class HfStandIn:
    """The endpoint's state (repos, request counts) and its server thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.repos: dict[str, StandInRepo] = {}
        self.requests: Counter[tuple[str, str, str]] = Counter()  # (method, repo, file or API)
        self._lock = threading.Lock()
        self._files_open = threading.Event()  # cleared: GETs of files wait (see hold_files)
        self._files_open.set()
        self._server = _Server((host, port), _Handler)
        self._server.stand_in = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(
        self,
        repo_id: str,
        files: Path | dict[str, bytes],
        *,
        branch: str = "main",
        gated_tokens: frozenset[str] | set[str] | None = None,
    ) -> str:
        """Publish `files` (a folder, or name -> bytes) as a new commit on `branch` of
        `repo_id` and return its sha. `gated_tokens` gates the repo: only those bearer tokens
        fetch its files."""
        content = files_of(files) if isinstance(files, Path) else dict(files)
        with self._lock:
            repo = self.repos.setdefault(repo_id, StandInRepo())
            if gated_tokens is not None:
                repo.gated_tokens = frozenset(gated_tokens)
            sha = commit_sha(repo_id, content, repo.branches.get(branch))
            repo.commits[sha] = content
            repo.branches[branch] = sha
        return sha

    def gets(self, repo_id: str, filename: str) -> int:
        """How many times the file's content was sent (GETs of its /resolve/ URL)."""
        return self.requests[("GET", repo_id, filename)]

    def file_gets(self, repo_id: str) -> Counter[str]:
        """GETs of each of the repo's files (API calls left out)."""
        return Counter(
            {
                f: n
                for (m, r, f), n in self.requests.items()
                if m == "GET" and r == repo_id and f != API
            }
        )

    def hold_files(self) -> None:
        """File GETs wait (counted already) until release_files: a download stays in flight."""
        self._files_open.clear()

    def release_files(self) -> None:
        self._files_open.set()

    def start(self) -> HfStandIn:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._files_open.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> HfStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def answer(self, method: str, path: str, authorization: str | None) -> Reply:
        """The reply to one request (pure over the stand-in's state)."""
        parts = [unquote(p) for p in urlsplit(path).path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._answer_api(method, f"{parts[2]}/{parts[3]}", parts[4:], authorization)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._answer_file(
                method, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), authorization
            )
        return error_reply(404, None, "Not Found")

    def _count(self, method: str, repo_id: str, what: str) -> None:
        with self._lock:
            self.requests[(method, repo_id, what)] += 1

    def _find(self, repo_id: str, revision: str, authorization: str | None):
        repo = self.repos.get(repo_id)
        if repo is None:
            # The Hub answers 401 to an anonymous caller (a private repo looks the same).
            status = 404 if authorization else 401
            return None, error_reply(status, "RepoNotFound", "Repository not found")
        sha = repo.resolve(revision)
        if sha is None:
            return None, error_reply(404, "RevisionNotFound", "Invalid rev id: " + revision)
        return (repo, sha), None

    def _answer_api(
        self, method: str, repo_id: str, rest: list[str], authorization: str | None
    ) -> Reply:
        self._count(method, repo_id, API)
        if method != "GET":
            return error_reply(405, None, "Method not allowed")
        if not rest:
            rest = ["revision", "main"]
        if len(rest) < 2 or rest[0] not in ("revision", "tree"):
            return error_reply(404, None, "Not Found")
        found, error = self._find(repo_id, rest[1], authorization)
        if error:
            return error
        repo, sha = found
        files = repo.commits[sha]
        if rest[0] == "tree":
            under = "/".join(rest[2:])
            return json_reply(
                [
                    {"type": "file", "path": name, "size": len(data), "oid": etag(data)[1:-1]}
                    for name, data in files.items()
                    if not under or name.startswith(under + "/")
                ]
            )
        return json_reply(
            {
                "_id": sha[:24],
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": False,
                "gated": "manual" if repo.gated_tokens is not None else False,
                "disabled": False,
                "tags": [],
                "siblings": [{"rfilename": name} for name in files],
            }
        )

    def _answer_file(
        self, method: str, repo_id: str, revision: str, name: str, authorization: str | None
    ) -> Reply:
        self._count(method, repo_id, name)
        if method not in ("GET", "HEAD"):
            return error_reply(405, None, "Method not allowed")
        found, error = self._find(repo_id, revision, authorization)
        if error:
            return error
        repo, sha = found
        if repo.gated_tokens is not None:
            denied = gate(repo_id, repo.gated_tokens, authorization)
            if denied:
                return denied
        data = repo.commits[sha].get(name)
        if method == "GET" and not self._files_open.wait(timeout=HOLD_LIMIT):
            return error_reply(503, None, "held too long")
        if data is None:
            reply = error_reply(404, "EntryNotFound", "Entry not found")
            reply.headers["X-Repo-Commit"] = sha
            return reply
        headers = {
            "X-Repo-Commit": sha,
            "ETag": etag(data),
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "none",
        }
        return Reply(200, data, headers)


def gate(repo_id: str, granted: frozenset[str], authorization: str | None) -> Reply | None:
    """The Hub's answers for a gated repo's files: 401 to an anonymous caller, 403 to a token
    that was not granted access, nothing (go on) for a granted one."""
    if not authorization:
        return error_reply(
            401,
            "GatedRepo",
            f"Access to model {repo_id} is restricted. You must have access to it and be "
            "authenticated to access it. Please log in.",
        )
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or token not in granted:
        return error_reply(
            403,
            "GatedRepo",
            f"Access to model {repo_id} is restricted and you are not in the authorized list.",
        )
    return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._reply("GET")

    def do_HEAD(self) -> None:
        self._reply("HEAD")

    def _reply(self, method: str) -> None:
        if len(self.path) > MAX_URL:
            reply = error_reply(414, None, "URI too long")
        else:
            stand_in: HfStandIn = self.server.stand_in  # type: ignore[attr-defined]
            reply = stand_in.answer(method, self.path, self.headers.get("Authorization"))
        self.send_response(reply.status)
        for key, value in reply.headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if method == "GET":
            self.wfile.write(reply.body)

    def log_message(self, *args) -> None:  # quiet: tests read the counters instead
        pass
