"""``coli convert --repo``: convert while downloading, one source shard at a time, so the disk never holds the
release and the container together.

The source directory starts as a header-only copy of the repo (every shard's real header and a hole up to its real
size; the small files whole), which is all ``coli convert`` needs to plan every byte it will write. The conversion
then runs unchanged; just before it writes each output shard, the real bytes of the source shards that output
shard reads are fetched (resumable, checksummed: ``hub.fetch_file``), and every real source shard no later output
shard reads is turned back into its header-only form. Since releases are cut in layer order and the container is
written layer by layer, about one source shard is real at a time.

A swapped file keeps the size and modification time its header-only copy had (recorded once in
``.colibri-stream.json``), so the converter's check that its source did not change between an interrupted run and
its resumption holds: the bytes that come in are the hub's, verified against its checksum, for the same commit.
Kill -9 at any point and the same command resumes: the download from its partial file, the conversion from its
receipts, and the result is byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from . import hub
from .cachedir import cache_root
from .header_copy import remote_header_copy

STAMPS = ".colibri-stream.json"


class _Silent:
    def start(self, total_bytes: int, shards: int) -> None: ...
    def shard(self, plan, resumed: bool) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def finish(self) -> None: ...


def _make_sparse(path: Path) -> None:
    """Keep only ``path``'s safetensors header; the data region becomes a hole of the same size."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        fh.seek(0)
        head = fh.read(8 + n)
    size = path.stat().st_size
    tmp = path.with_name(path.name + ".sparse")
    with open(tmp, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
    os.replace(tmp, path)


def _is_real(path: Path) -> bool:
    st = path.stat()
    return st.st_blocks * 512 >= st.st_size // 2


class StreamingSource:
    """The source directory, and which of its shards hold real bytes."""

    def __init__(self, ref: str, directory: Path | None = None):
        repo_id, revision = hub.parse_ref(ref)
        probe = hub.remote_repo(repo_id, revision)
        self.dir = directory or cache_root() / "convert-sources" / f"{repo_id}@{probe.commit}"
        self.dir, self.repo = remote_header_copy(ref, self.dir)
        for f in self.repo.files:            # tokenizer, chat template and the like: copied into the container
            if not f.name.endswith(".safetensors") and not (self.dir / f.name).exists():
                hub.fetch_file(self.repo, f, self.dir, lambda n: None)
        self.files = {f.name: f for f in self.repo.files if f.name.endswith(".safetensors")}
        stamps_file = self.dir / STAMPS
        try:
            self.mtimes = json.loads(stamps_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.mtimes = {name: (self.dir / name).stat().st_mtime_ns for name in self.files}
            tmp = stamps_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.mtimes), encoding="utf-8")
            os.replace(tmp, stamps_file)

    def _restamp(self, path: Path) -> None:
        ns = int(self.mtimes[path.name])
        os.utime(path, ns=(ns, ns))

    def fetch(self, path: Path) -> None:
        if not _is_real(path):
            hub.fetch_file(self.repo, self.files[path.name], self.dir, lambda n: None)
        self._restamp(path)

    def release(self, path: Path) -> None:
        if _is_real(path):
            _make_sparse(path)
            self._restamp(path)

    def real_bytes(self) -> int:
        return sum((self.dir / n).stat().st_blocks * 512 for n in self.files)


class StreamingReporter:
    """Wraps convert's reporter: before each output shard, the sources it reads come in and the spent ones go."""

    def __init__(self, inner: Any, source: StreamingSource, needs: list[set[Path]]):
        self.inner, self.source, self.needs = inner, source, needs
        self.peak_source_bytes = 0

    def start(self, total_bytes: int, shards: int) -> None:
        self.inner.start(total_bytes, shards)

    def shard(self, plan, resumed: bool) -> None:
        if not resumed:
            later = set().union(*self.needs[plan.index - 1:])
            for name in self.source.files:
                if self.source.dir / name not in later:
                    self.source.release(self.source.dir / name)
            for path in sorted(self.needs[plan.index - 1]):
                self.source.fetch(path)
            self.peak_source_bytes = max(self.peak_source_bytes, self.source.real_bytes())
        self.inner.shard(plan, resumed)

    def advance(self, nbytes: int) -> None:
        self.inner.advance(nbytes)

    def finish(self) -> None:
        for name in self.source.files:
            self.source.release(self.source.dir / name)
        self.inner.finish()


def convert_repo(ref: str, out: Path, experts: str = "int8", dense: str = "bf16", family: str | None = None,
                 reporter: Any = None, source_dir: Path | None = None):
    """Convert the hub repo ``ref`` into a container at ``out``, fetching its shards one by one."""
    from .convert.run import convert, make_plan
    from .model import resolve_model

    source = StreamingSource(ref, source_dir)
    model = resolve_model(source.dir, family)
    plan, _index = make_plan(model, experts, dense)
    needs = [{it.source.file for it in s.items} | {it.scale.file for it in s.items if it.scale is not None}
             for s in plan.shards]
    streaming = StreamingReporter(reporter or _Silent(), source, needs)
    result = convert(model, out, experts=experts, dense=dense, reporter=streaming)
    shutil.rmtree(source.dir, ignore_errors=True)    # the header-only copy has served its purpose
    return result, streaming.peak_source_bytes
