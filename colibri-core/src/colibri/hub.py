"""Talking to a Hugging Face-compatible hub: what a repo holds, and fetching its files resumably and verified.

Everything goes through ``huggingface_hub`` (endpoint from ``HF_ENDPOINT``, token from ``HF_TOKEN`` or the token
file ``hf auth login`` writes, offline mode from ``HF_HUB_OFFLINE``). Its own ``hf_hub_download`` downloads into a
per-process temporary file it deletes on failure, so an interrupted multi-GB shard starts over; colibri keeps the
partial file instead (``<dest>/.colibri-partial/<name>.<etag>.part``) and asks for the rest with an HTTP Range
request on the library's own session (``http_stream_backoff``, its headers and its error mapping), then checks
the whole file against the hub's checksum (the LFS sha256, or git's blob sha1 for small files) before moving it
into place.
"""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from .errors import ColibriError, UsageError

PARTIAL_DIR = ".colibri-partial"
CHUNK_BYTES = 1 << 20
RETRIES = 3
LOGIN_HINT = "set HF_TOKEN, or run `hf auth login`"


class HubError(ColibriError):
    """The hub refused or could not answer: missing repo, gated repo, no network, interrupted transfer."""


class DiskFullError(ColibriError):
    """The destination cannot hold what is about to be downloaded or written."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at a commit, as the hub lists it."""

    name: str
    size: int
    sha256: str | None          # LFS files: the content's sha256 (also their ETag)
    blob_id: str | None         # git's blob sha1 (the ETag of a non-LFS file)

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id or ""


@dataclass(frozen=True)
class RemoteRepo:
    repo_id: str
    revision: str | None        # as asked (branch, tag or commit); None = the default branch
    commit: str                 # what it resolved to
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def parse_ref(text: str) -> tuple[str, str | None]:
    """``Org/Name[@REVISION]`` -> (repo id, revision or None); a clear error for anything else."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id, _, revision = text.partition("@")
    if not repo_id or (_ and not revision):
        raise UsageError(f"{text!r}: not a repo id",
                         "give Org/Name or Org/Name@REVISION, e.g. allenai/OLMoE-1B-7B-0924")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise UsageError(f"{text!r}: not a repo id ({str(exc).splitlines()[0]})",
                         "give Org/Name or Org/Name@REVISION") from None
    return repo_id, revision or None


@contextmanager
def hub_errors(repo_id: str, revision: str | None, filename: str | None = None) -> Iterator[None]:
    """Turn ``huggingface_hub``/transport exceptions into one-line colibri errors naming the repo and the fix."""
    try:
        yield
    except Exception as exc:
        mapped = _hub_error(exc, f"{repo_id}@{revision}" if revision else repo_id, revision, filename)
        if mapped is None:
            raise
        raise mapped from None


def _hub_error(exc: Exception, where: str, revision: str | None, filename: str | None) -> HubError | None:
    import httpx2
    from huggingface_hub import errors as hf

    known = (   # subclasses first: a gated repo is also a RepositoryNotFoundError
        (hf.GatedRepoError, f"{where} is gated on {endpoint()}: it needs a token of an account that accepted its terms",
         f"accept them on the model's page, then {LOGIN_HINT}"),
        (hf.RevisionNotFoundError, f"{where}: no revision {revision!r} on {endpoint()}",
         "give a branch, tag or commit that exists (or drop @REVISION)"),
        (hf.RemoteEntryNotFoundError, f"{where}: no file {filename!r} on {endpoint()}", "check --include"),
        (hf.RepositoryNotFoundError, f"{where}: no such model repository on {endpoint()} (or it is private)",
         f"check the name; for a private repo {LOGIN_HINT}"),
        (hf.OfflineModeIsEnabled, f"{where}: offline mode is on (HF_HUB_OFFLINE) and this is not pulled yet",
         "unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) to download it"),
    )
    for kind, message, hint in known:
        if isinstance(exc, kind):
            return HubError(message, hint)
    if isinstance(exc, hf.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        if status == 401:
            return HubError(f"{where}: the hub rejected the token (401)", f"renew it: {LOGIN_HINT}")
        if status == 403:
            return HubError(f"{where}: the token has no access (403)",
                            f"request access on the model's page or use another token ({LOGIN_HINT})")
        return HubError(f"{where}: the hub answered {status} ({_first_line(exc)})", "retry later")
    if isinstance(exc, (httpx2.ConnectError, httpx2.TimeoutException)):
        return HubError(f"cannot reach {endpoint()} for {where} ({_first_line(exc)})",
                        "check the network or HF_ENDPOINT; rerun to resume")
    if isinstance(exc, (httpx2.TransportError, ConnectionError)):
        return HubError(f"download of {filename or where} was interrupted ({_first_line(exc)})",
                        f"rerun `coli pull {where}` to resume where it stopped")
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def remote_repo(repo_id: str, revision: str | None, include: list[str] | None = None) -> RemoteRepo:
    """The repo's files at ``revision`` (with sizes and checksums), narrowed to the ``include`` globs."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    if offline():
        raise HubError(f"{repo_id}: offline mode is on (HF_HUB_OFFLINE), so the hub cannot be asked",
                       "unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) to download")
    with hub_errors(repo_id, revision):
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    siblings = list(filter_repo_objects(info.siblings or [], allow_patterns=include or None,
                                        key=lambda s: s.rfilename))
    if include and not siblings:
        raise UsageError(f"--include {' '.join(include)}: matches no file of {repo_id}",
                         f"files there: {', '.join(s.rfilename for s in (info.siblings or [])[:8]) or 'none'}")
    files = tuple(RemoteFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                             s.lfs.sha256 if s.lfs else None, s.blob_id) for s in siblings)
    return RemoteRepo(repo_id, revision, info.sha or revision or "main", files)


# ------------------------------------------------------------------------------------------------- one file

def partial_path(dest: Path, f: RemoteFile) -> Path:
    return dest / PARTIAL_DIR / f"{f.name.replace('/', '__')}.{f.etag[:16] or 'noetag'}.part"


def partial_bytes(dest: Path, f: RemoteFile) -> int:
    """Bytes of ``f`` already downloaded into its partial file (0 when none)."""
    try:
        return min(partial_path(dest, f).stat().st_size, f.size)
    except OSError:
        return 0


def checksum_ok(path: Path, f: RemoteFile) -> bool:
    """Whether ``path`` has the hub's checksum for ``f`` (sha256 for LFS files, git blob sha1 otherwise)."""
    if f.sha256:
        digest = hashlib.sha256()
    elif f.blob_id:
        digest = hashlib.sha1()
        digest.update(f"blob {path.stat().st_size}\0".encode())
    else:
        return path.stat().st_size == f.size
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest() == (f.sha256 or f.blob_id)


def fetch_file(repo: RemoteRepo, f: RemoteFile, dest: Path, on_bytes: Callable[[int], None]) -> Path:
    """Download ``f`` into ``dest`` (resuming its partial file), verify its checksum, move it into place."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import get_hf_file_metadata
    from huggingface_hub.utils import build_hf_headers

    final = dest / f.name
    part = partial_path(dest, f)
    part.parent.mkdir(parents=True, exist_ok=True)
    url = hf_hub_url(repo.repo_id, f.name, revision=repo.commit)
    headers = build_hf_headers()
    with hub_errors(repo.repo_id, repo.revision, f.name):
        meta = get_hf_file_metadata(url, headers=headers)
        if meta.location and meta.location != url and not _same_host(url, meta.location):
            headers.pop("authorization", None)   # never hand the token to a CDN on another host
        with open(part, "ab") as fh:
            if fh.tell() > f.size:        # longer than the file: not a prefix of it, start over
                fh.truncate(0)
            _stream_into(meta.location or url, fh, f.size, headers, on_bytes)
    if not checksum_ok(part, f):
        part.unlink()
        raise HubError(f"{repo.repo_id}: {f.name} does not match the hub's checksum ({f.etag[:12]}…); "
                       "the corrupt copy was deleted", f"rerun `coli pull {repo.repo_id}` to download it again")
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, final)
    return final


def _stream_into(url: str, fh: BinaryIO, size: int, headers: dict[str, str], on_bytes: Callable[[int], None]) -> None:
    """Append the rest of the file to ``fh`` (opened for appending), asking for it with ``Range``.

    Chunks are small (``CHUNK_BYTES``) so a kill loses at most one of them. A connection that breaks after some
    bytes arrived is asked again for the rest at once; one that breaks ``RETRIES`` times running without a byte
    is an interrupted transfer (the partial file stays for the next run).
    """
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import hf_raise_for_status, http_stream_backoff

    have = fh.tell()
    failures = 0
    while have < size:
        ask = dict(headers, **({"Range": f"bytes={have}-"} if have else {}))
        try:
            with http_stream_backoff("GET", url, headers=ask, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                                     retry_on_exceptions=(), retry_on_status_codes=(408, 429)) as response:
                hf_raise_for_status(response)
                if have and response.status_code == 200:   # the server ignored Range: take it from the start
                    fh.truncate(0)
                    on_bytes(-have)
                    have = 0
                for chunk in response.iter_bytes(chunk_size=CHUNK_BYTES):
                    fh.write(chunk)
                    have += len(chunk)
                    on_bytes(len(chunk))
                    failures = 0
        except (httpx2.TransportError, httpx2.TimeoutException) as exc:
            failures += 1
            if failures >= RETRIES:
                fh.flush()
                raise ConnectionError(f"{_first_line(exc)}; {have} of {size} bytes kept") from None
            time.sleep(0.2 * failures)
        if have > size:
            raise ConnectionError(f"the hub sent {have} bytes of a {size}-byte file")


def _same_host(a: str, b: str) -> bool:
    from urllib.parse import urlparse

    return urlparse(a).netloc == urlparse(b).netloc
