"""``coli pull``: a repo from the hub into colibri's model directory, resumable, verified, disk checked first.

Order of work, so that nothing is written before it is known to fit: list the repo (sizes and checksums from the
hub), subtract what is already here (complete files whose checksum was verified, and partial files), compare with
the free space of the destination's filesystem, and only then create the directory and fetch file by file, small
files first (``config.json`` arrives before the shards, so ``coli info`` works on a copy still downloading).
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from . import hub, models_dir
from .console import human_bytes
from .hub import DiskFullError, RemoteFile, RemoteRepo

PER_FILE_SLACK = 4096
"""A file occupies whole blocks: count one more block per file than its bytes."""


class PullReporter(Protocol):
    def start(self, repo: RemoteRepo, total_bytes: int, done_bytes: int) -> None: ...
    def file(self, f: RemoteFile) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def file_done(self, f: RemoteFile) -> None: ...
    def finish(self) -> None: ...


class _Silent:
    def start(self, repo: RemoteRepo, total_bytes: int, done_bytes: int) -> None: ...
    def file(self, f: RemoteFile) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def file_done(self, f: RemoteFile) -> None: ...
    def finish(self) -> None: ...


@dataclass(frozen=True)
class PullResult:
    dest: Path
    repo: RemoteRepo | None
    fetched_files: int
    fetched_bytes: int
    already_complete: bool
    offline: bool = False


def is_complete(dest: Path, f: RemoteFile, record: dict | None) -> bool:
    """A file already here: its size matches and its checksum was verified for this ETag (or verifies now)."""
    path = dest / f.name
    try:
        if path.stat().st_size != f.size:
            return False
    except OSError:
        return False
    known = ((record or {}).get("files") or {}).get(f.name) or {}
    return known.get("etag") == f.etag or hub.checksum_ok(path, f)


def existing_ancestor(path: Path) -> Path:
    """The nearest directory that exists, whose filesystem the new files will land on."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_space(dest: Path, needed: int) -> None:
    """Refuse before writing a byte when the destination's filesystem cannot hold what is left to fetch."""
    where = existing_ancestor(dest)
    free = shutil.disk_usage(where).free
    if needed > free:
        raise DiskFullError(f"{dest}: needs {human_bytes(needed)} more but {where} has {human_bytes(free)} free",
                            "free some space, pull elsewhere with --dir DIR, or narrow the files with --include")


def _record(repo: RemoteRepo, include: list[str] | None, done: dict[str, str], complete: bool) -> dict:
    return {"repo_id": repo.repo_id, "revision": repo.revision, "commit": repo.commit, "endpoint": hub.endpoint(),
            "include": include or [], "complete": complete,
            "files": {f.name: {"size": f.size, "etag": f.etag} for f in repo.files if f.name in done}}


def pull(ref: str, include: list[str] | None = None, dest: Path | None = None,
         reporter: PullReporter | None = None) -> PullResult:
    """Bring ``Org/Name[@REV]`` into ``dest`` (default: the model directory) and return what was done."""
    repo_id, revision = hub.parse_ref(ref)
    dest = dest or models_dir.default_dest(repo_id, revision)
    reporter = reporter or _Silent()
    record = models_dir.read_record(dest) if dest.is_dir() else None
    if hub.offline():
        if record and record.get("complete"):
            return PullResult(dest, None, 0, 0, already_complete=True, offline=True)
    repo = hub.remote_repo(repo_id, revision, include)
    # small files first: config, tokenizer and index arrive before the shards
    files = sorted(repo.files, key=lambda f: (f.size, f.name))
    done = {f.name: f.etag for f in files if is_complete(dest, f, record)}
    todo = [f for f in files if f.name not in done]
    left = sum(f.size - hub.partial_bytes(dest, f) for f in todo)
    check_space(dest, left + PER_FILE_SLACK * len(todo))
    dest.mkdir(parents=True, exist_ok=True)
    models_dir.write_record(dest, _record(repo, include, done, complete=not todo))
    reporter.start(repo, repo.total_bytes, repo.total_bytes - left)
    fetched = 0
    for f in todo:
        reporter.file(f)
        try:
            hub.fetch_file(repo, f, dest, reporter.advance)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(f"{dest}: the disk filled up while writing {f.name}",
                                    "free some space and rerun the same command: it resumes") from None
            raise
        fetched += f.size
        done[f.name] = f.etag
        models_dir.write_record(dest, _record(repo, include, done, complete=len(done) == len(files)))
        reporter.file_done(f)
    partial_dir = dest / hub.PARTIAL_DIR
    if partial_dir.is_dir():
        shutil.rmtree(partial_dir, ignore_errors=True)   # leftovers of files whose ETag changed upstream
    reporter.finish()
    return PullResult(dest, repo, len(todo), fetched, already_complete=not todo)
