"""Header-only copies of a checkpoint: every shard's real safetensors header, its data region left sparse.

``info``, ``plan`` and ``doctor`` read headers and never weights, so a directory holding the repo's small JSON files
and, for each ``*.safetensors``, its true header followed by a hole up to the true file size (``truncate``; ~0 bytes
of disk) is everything they need. ``coli plan --repo`` builds one from the hub with two HTTP Range reads per shard
at most (the first 64 KiB, which usually hold the whole header, then the rest of a longer one); tests build them
from real published shapes (``write_sparse_shard``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from . import hub
from .cachedir import cache_root
from .checkpoint import MAX_HEADER_BYTES
from .errors import CheckpointError

FIRST_READ = 64 * 1024
SMALL_FILE_BYTES = 8 * 1024 * 1024     # JSON files up to this size are copied whole (config, index, tokenizer config)


def write_sparse_shard(path: Path, header: dict, data_bytes: int | None = None) -> Path:
    """A safetensors file with ``header`` (offsets as given) and a sparse data region of ``data_bytes``
    (default: the end of the last tensor)."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + (end if data_bytes is None else data_bytes))
    return path


def _range(url: str, headers: dict[str, str], first: int, last: int) -> bytes:
    from huggingface_hub.utils import get_session, hf_raise_for_status

    response = get_session().get(url, headers=dict(headers, Range=f"bytes={first}-{last}"), follow_redirects=True)
    hf_raise_for_status(response)
    data = response.content
    if response.status_code == 200:          # Range ignored: keep the asked slice of what came
        data = data[first:last + 1]
    return data


def fetch_header(repo: hub.RemoteRepo, f: hub.RemoteFile, dest: Path) -> Path:
    """Write ``dest/f.name`` as ``f``'s header plus a hole to its real size."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo.repo_id, f.name, revision=repo.commit)
    headers = build_hf_headers()
    with hub.hub_errors(repo.repo_id, repo.revision, f.name):
        head = _range(url, headers, 0, min(FIRST_READ, f.size) - 1)
        if len(head) < 8:
            raise CheckpointError(f"{repo.repo_id}: {f.name} is shorter than a safetensors header",
                                  "the file on the hub is not safetensors")
        n = int.from_bytes(head[:8], "little")
        if n > MAX_HEADER_BYTES or 8 + n > f.size:
            raise CheckpointError(f"{repo.repo_id}: {f.name} declares a {n}-byte header", "not a safetensors file")
        if len(head) < 8 + n:
            head += _range(url, headers, len(head), 8 + n - 1)
    target = dest / f.name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(head[:8 + n])
        fh.truncate(f.size)
    os.replace(tmp, target)
    return target


def header_only_copy(ref: str, dest: Path | None = None) -> Path:
    """The repo's small JSON files and every shard's header, in ``dest`` (default: the cache, per commit)."""
    return remote_header_copy(ref, dest)[0]


def remote_header_copy(ref: str, dest: Path | None = None) -> tuple[Path, hub.RemoteRepo]:
    """:func:`header_only_copy`, and the repo listing it was made from (sizes of every file)."""
    repo_id, revision = hub.parse_ref(ref)
    repo = hub.remote_repo(repo_id, revision)
    dest = dest or cache_root() / "headers" / f"{repo_id}@{repo.commit}"
    dest.mkdir(parents=True, exist_ok=True)
    for f in repo.files:
        target = dest / f.name
        if target.exists() and target.stat().st_size == f.size:
            continue      # kept from an earlier look at the same commit
        if f.name.endswith(".safetensors"):
            fetch_header(repo, f, dest)
        elif f.name.endswith(".json") and f.size <= SMALL_FILE_BYTES:
            hub.fetch_file(repo, f, dest, lambda n: None)
    shutil.rmtree(dest / hub.PARTIAL_DIR, ignore_errors=True)
    return dest, repo
