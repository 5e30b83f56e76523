"""A small Hugging Face-compatible hub on 127.0.0.1, for testing ``coli pull`` with the real ``huggingface_hub``.

It answers what the client asks for a download: ``GET /api/models/{repo}[/revision/{rev}]`` (model info with
siblings, sizes, blob ids and LFS sha256 when ``blobs=True``), and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``
with ``ETag`` (quoted; the sha256 for LFS files, git's blob sha1 otherwise), ``X-Repo-Commit``, ``Content-Length``
and ``Range`` (206 + ``Content-Range``). Errors carry ``X-Error-Code`` as the hub's do (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``). Knobs for the tests: a byte rate (so a kill lands mid-file),
connection drops after N body bytes, and a log of every request with its Range header.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_MIN_BYTES = 1024   # files this big are "LFS" files: sha256 ETag, lfs block in the listing


@dataclass
class HubRepo:
    files: dict[str, bytes]
    gated: bool = False
    commit: str = ""
    tags: tuple[str, ...] = ()
    served: dict[str, bytes] = field(default_factory=dict)   # bytes sent instead of a file's (a corrupt mirror)

    def __post_init__(self) -> None:
        if not self.commit:
            digest = hashlib.sha1()
            for name in sorted(self.files):
                digest.update(name.encode() + b"\0" + hashlib.sha1(self.files[name]).digest())
            self.commit = digest.hexdigest()

    def etag(self, name: str) -> str:
        data = self.files[name]
        if len(data) >= LFS_MIN_BYTES:
            return hashlib.sha256(data).hexdigest()
        return blob_id(data)

    def sibling(self, name: str, blobs: bool) -> dict:
        if not blobs:
            return {"rfilename": name}
        data = self.files[name]
        out = {"rfilename": name, "size": len(data), "blobId": blob_id(data)}
        if len(data) >= LFS_MIN_BYTES:
            out["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return out


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubState:
    repos: dict[str, HubRepo]
    token: str | None = None                 # the token that opens gated repos
    bytes_per_s: float = 0                   # 0 = as fast as possible
    drops: list[int] = field(default_factory=list)   # the next GETs break after this many body bytes, in turn
    log: list[tuple[str, str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState

    def log_message(self, *args) -> None:  # quiet
        pass

    # ------------------------------------------------------------------------------------------ plumbing
    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorised(self, repo: HubRepo) -> bool:
        if not repo.gated:
            return True
        auth = self.headers.get("Authorization", "")
        return self.state.token is not None and auth == f"Bearer {self.state.token}"

    def _find(self, repo_id: str) -> HubRepo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository not found: {repo_id}")
            return None
        if not self._authorised(repo):
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                                          "and be authenticated to access it. Please log in.")
            return None
        return repo

    def _resolve_rev(self, repo: HubRepo, rev: str) -> bool:
        if rev in ("main", repo.commit) or rev in repo.tags:
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return False

    # ------------------------------------------------------------------------------------------ routes
    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def _route(self) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        with self.state.lock:
            self.state.log.append((self.command, path, self.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            return self._info(m.group(1), m.group(2) or "main", "blobs=True" in url.query or "blobs=true" in url.query)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._file(m.group(1), m.group(2), m.group(3))
        self._error(404, "NotFound", f"no route {path}")

    def _info(self, repo_id: str, rev: str, blobs: bool) -> None:
        repo = self._find(repo_id)
        if repo is None or not self._resolve_rev(repo, rev):
            return
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                           "gated": "manual" if repo.gated else False, "disabled": False,
                           "siblings": [repo.sibling(n, blobs) for n in sorted(repo.files)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _file(self, repo_id: str, rev: str, name: str) -> None:
        repo = self._find(repo_id)
        if repo is None or not self._resolve_rev(repo, rev):
            return
        if name not in repo.files:
            self._error(404, "EntryNotFound", f"{name} does not exist on {rev}", commit=repo.commit)
            return
        data = repo.served.get(name, repo.files[name])
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "") or "")
        if ranged:
            start = int(ranged.group(1))
            if start >= len(data) and data:
                self._error(416, "RangeNotSatisfiable", "range not satisfiable")
                return
        self.send_response(206 if ranged else 200)
        self.send_header("ETag", f'"{repo.etag(name)}"')
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        self._send_body(data[start:])

    def _send_body(self, body: bytes) -> None:
        state = self.state
        with state.lock:
            drop = state.drops.pop(0) if state.drops else None
        chunk = 16 * 1024
        sent = 0
        began = time.monotonic()
        while sent < len(body):
            piece = body[sent:sent + chunk]
            if drop is not None and sent + len(piece) > drop:
                self.wfile.write(piece[:max(0, drop - sent)])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)   # the transfer breaks mid-file
                return
            self.wfile.write(piece)
            sent += len(piece)
            if state.bytes_per_s:
                ahead = sent / state.bytes_per_s - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(min(ahead, 1.0))


class HubServer:
    """``with HubServer(repos) as hub:`` then ``HF_ENDPOINT=hub.url``."""

    def __init__(self, repos: dict[str, HubRepo], token: str | None = None) -> None:
        self.state = HubState(repos=repos, token=token)
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of ``name`` so far."""
        return [rng for method, path, rng in self.state.log if method == "GET" and path.endswith("/" + name)]

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
