"""``coli convert``: a resumable, deterministic, bounded-memory conversion into a colibri-quant container.

Crash safety: every output file is written under ``DST/.colibri-convert/`` and renamed into place only when
complete and fsynced; each finished shard gets a receipt (size + SHA-256). A rerun recomputes the same plan
(a pure function of the source headers and the options), keeps shards whose receipt matches, and redoes the rest.
The index and then ``config.json`` are written last, so a directory with ``config.json`` and no work directory is
a finished container; the work directory is removed at the very end.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .. import hooks
from ..checkpoint import TensorIndex
from ..errors import CheckpointError, FamilyError, UsageError
from ..records import ResolvedModel
from .container import (
    CONTAINER_NAME, CONTAINER_VERSION, INDEX_NAME, KEY_CONTAINER, KEY_JOB, KEY_VERSION, ContainerError,
    open_container,
)
from .io import produce
from .plan import Fallback, JobPlan, ShardPlan, build_plan
from .schemes import BY_OPTION, FLOAT_SCHEMES, NonFiniteError, ScaleOverflowError
from .spec import DENSE_SCHEMES, EXPERT_SCHEMES
from .verify import VerifyResult

WORK_DIR = ".colibri-convert"
JOB_FILE = "job.json"
LOCK_FILE = "lock"
EXPERT_OPTIONS = EXPERT_SCHEMES
DENSE_OPTIONS = DENSE_SCHEMES        # f32 / bf16 keep dense matrices as floats; int8 / int4 quantize them


class Reporter(Protocol):
    def start(self, total_bytes: int, shards: int) -> None: ...
    def shard(self, plan: ShardPlan, resumed: bool) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def finish(self) -> None: ...


class _Silent:
    def start(self, total_bytes: int, shards: int) -> None: ...
    def shard(self, plan: ShardPlan, resumed: bool) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def finish(self) -> None: ...


@dataclass
class ConvertResult:
    out: Path
    shards: int
    written_shards: int                 # 0 when everything was already there
    source_bytes: int
    output_bytes: int
    seconds: float
    peak_rss_bytes: int
    already_done: bool = False
    verified: VerifyResult | None = None   # when --verify ran
    copied_files: list[str] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)   # tensors stored with another scheme than asked


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, work: Path) -> None:
    tmp = work / (path.name + ".partial")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def check_options(model: ResolvedModel, experts: str, dense: str):
    """The family's converter spec, after refusing flags it (or colibri) does not support."""
    if experts not in EXPERT_OPTIONS:
        raise UsageError(f"--experts {experts}: unknown scheme", f"choose one of {', '.join(EXPERT_OPTIONS)}")
    if dense not in DENSE_OPTIONS:
        raise UsageError(f"--dense {dense}: unknown scheme", f"choose one of {', '.join(DENSE_OPTIONS)}")
    spec = hooks.converter_spec(model)
    if spec is None:
        raise FamilyError(f"family {model.family!r} ({model.model_type}) has no converter: it names no routed "
                          "experts to quantize", "run this checkpoint as it is; it needs no conversion")
    if experts not in spec.expert_schemes:
        raise UsageError(f"--experts {experts}: family {model.family!r} does not support it",
                         f"it supports {', '.join(spec.expert_schemes) or 'none'}")
    if dense not in spec.dense_schemes:
        raise UsageError(f"--dense {dense}: family {model.family!r} does not support it",
                         f"it supports {', '.join(spec.dense_schemes) or 'none'}")
    return spec


def refuse_unsound_source(model: ResolvedModel) -> None:
    """Never write a container from a checkpoint ``coli doctor --deep`` fails: run its checks, refuse the first."""
    from ..doctor import failures, model_checks

    failed = failures(model_checks(model, deep=True))
    if failed:
        first = failed[0]
        problem = first.problems[0] if first.problems else first.detail
        more = f" (and {len(failed) - 1} more failed check(s))" if len(failed) > 1 else ""
        raise CheckpointError(f"{model.path}: not converted: {first.name}: {problem}{more}",
                              f"coli doctor --deep --model {model.path} lists every problem; fix the source first")


def make_plan(model: ResolvedModel, experts: str, dense: str) -> tuple[JobPlan, TensorIndex]:
    if open_container(model.path) is not None:
        raise UsageError(f"{model.path}: is already a {CONTAINER_NAME} container",
                         "convert the original (f32/bf16) checkpoint instead")
    refuse_unsound_source(model)
    spec = check_options(model, experts, dense)
    layout = hooks.tensor_layout(model)
    if layout is None:
        raise FamilyError(f"family {model.family!r} gives no tensor layout for {model.model_type}",
                          "the family plugin cannot describe this checkpoint; it cannot be converted")
    shard_sets = hooks.weight_files(model)
    if len(shard_sets) != 1 or not shard_sets[0].files:
        raise CheckpointError(f"{model.path}: no safetensors weights to convert" if not shard_sets or not
                              shard_sets[0].files else f"{model.path}: {len(shard_sets)} weight components",
                              "convert handles one safetensors checkpoint (with or without an index)")
    index = TensorIndex(shard_sets)
    config = model.path / "config.json"
    config_bytes = config.read_bytes() if config.exists() else b""
    return build_plan(index, layout, spec, experts, dense, config_bytes), index


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _prepare_out(src: Path, out: Path, plan: JobPlan) -> str:
    """'fresh', 'resume' or 'done'; refuses any directory that is not empty and not this very job."""
    src_r, out_r = src.resolve(), out.resolve()
    if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
        raise UsageError(f"--out {out}: overlaps the source checkpoint {src}",
                         "pick an output directory outside the source")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file", "pick a directory (it is created if missing)")
    work = out / WORK_DIR
    job_file = work / JOB_FILE
    entries = list(out.iterdir()) if out.exists() else []
    if not entries or (entries == [work] and not job_file.exists()):
        return "fresh"          # new, empty, or killed before the job file landed
    if job_file.exists():
        try:
            job = json.loads(job_file.read_text(encoding="utf-8")).get("job")
        except (OSError, ValueError, AttributeError):
            job = None
        if job == plan.job:
            return "resume"
        raise UsageError(f"--out {out}: holds an unfinished conversion of another source or with other options",
                         f"rerun that conversion, or delete {out} first")
    try:
        existing = open_container(out)
    except CheckpointError:
        existing = None
    if existing is not None and existing.job == plan.job and (out / "config.json").exists():
        return "done"
    what = "another colibri-quant container" if existing is not None else (
        "another checkpoint" if any(out.glob("*.safetensors")) or (out / "config.json").exists()
        else "other files")
    raise UsageError(f"--out {out}: already holds {what}", "pick an empty or new directory, or delete it first")


def _source_stamps(index: TensorIndex) -> dict[str, list[int]]:
    """Size and mtime of every source shard: headers alone cannot tell that the weights were replaced."""
    out = {}
    for header in index.headers:
        st = header.file.stat()
        out[str(header.file.resolve())] = [st.st_size, st.st_mtime_ns]
    return out


def _check_source_unchanged(job_file: Path, index: TensorIndex) -> None:
    try:
        recorded = json.loads(job_file.read_text(encoding="utf-8")).get("source_files")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded != _source_stamps(index):
        raise UsageError(f"--out {job_file.parent.parent}: the source shards changed since the interrupted "
                         "conversion began", f"delete {job_file.parent.parent} and convert again")


def _receipt_path(work: Path, shard: ShardPlan) -> Path:
    return work / f"{shard.file_name}.receipt.json"


def _shard_is_done(out: Path, work: Path, shard: ShardPlan, job: str) -> bool:
    receipt_file, final = _receipt_path(work, shard), out / shard.file_name
    if not receipt_file.exists() or not final.exists():
        return False
    try:
        receipt = json.loads(receipt_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return receipt.get("job") == job and receipt.get("size") == final.stat().st_size


def _write_shard(out: Path, work: Path, shard: ShardPlan, job: str, reporter: Reporter) -> None:
    tmp = work / (shard.file_name + ".partial")
    digest = hashlib.sha256()
    header = shard.header_bytes()
    expected = len(header) + shard.data_bytes
    fds: dict[Path, int] = {}
    try:
        with open(tmp, "wb") as fh:
            fh.write(header)
            digest.update(header)
            for item in shard.items:
                src = item.source.file
                if src not in fds:
                    fds[src] = os.open(src, os.O_RDONLY)
                written = 0
                try:
                    for data, consumed in produce(item, fds[src]):
                        fh.write(data)
                        digest.update(data)
                        written += len(data)
                        if consumed:
                            reporter.advance(consumed)
                except NonFiniteError as exc:
                    raise CheckpointError(f"{src}: tensor {item.source.name!r} {exc}",
                                          "the source checkpoint is corrupted; it cannot be quantized") from None
                except ScaleOverflowError as exc:
                    raise CheckpointError(f"{src}: tensor {item.source.name!r}: {exc}",
                                          "this tensor cannot be stored with F16 scales") from None
                except OSError as exc:       # the source shrank or failed under us after it was validated
                    raise CheckpointError(f"{src}: tensor {item.source.name!r}: cannot read ({exc})",
                                          "the source changed or its disk failed; convert again") from None
                if written != item.nbytes:
                    raise AssertionError(f"{item.source.name}: wrote {written} bytes, planned {item.nbytes}")
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        for fd in fds.values():
            os.close(fd)
    size = tmp.stat().st_size
    if size != expected:
        raise AssertionError(f"{shard.file_name}: wrote {size} bytes, planned {expected}")
    os.replace(tmp, out / shard.file_name)
    _fsync_dir(out)
    receipt = {"job": job, "file": shard.file_name, "size": size, "sha256": digest.hexdigest()}
    _atomic_write(_receipt_path(work, shard), json.dumps(receipt, sort_keys=True).encode(), work)


def _index_bytes(plan: JobPlan) -> bytes:
    index = {
        "metadata": {"total_size": plan.total_size(), KEY_CONTAINER: CONTAINER_NAME, KEY_VERSION: CONTAINER_VERSION,
                     KEY_JOB: plan.job, "colibri.experts": BY_OPTION[plan.experts].name,
                     "colibri.dense": plan.dense if plan.dense in FLOAT_SCHEMES else BY_OPTION[plan.dense].name},
        "weight_map": dict(sorted(plan.weight_map().items())),
    }
    return (json.dumps(index, indent=2) + "\n").encode()


def _lock_work_dir(work: Path, out: Path) -> int:
    """An exclusive lock held for the whole run (the kernel drops it when the process dies, even by kill -9)."""
    fd = os.open(work / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"--out {out}: another coli convert is writing into it right now",
                         "wait for it to finish, or pick another directory") from None
    return fd


def _remove_work_dir(work: Path) -> None:
    """Remove receipts first and the job file last, so a kill midway still leaves a resumable directory."""
    for p in sorted(work.iterdir()):
        if p.name != JOB_FILE:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    (work / JOB_FILE).unlink(missing_ok=True)
    work.rmdir()


def _side_files(src: Path) -> list[Path]:
    """Every top-level file that is not a weight file: tokenizer, chat template, generation config, README..."""
    out = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        if p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json"):
            continue
        out.append(p)
    return out


def _run_job(model: ResolvedModel, out: Path, work: Path, plan: JobPlan, index: TensorIndex, state: str,
             reporter: Reporter) -> tuple[int, list[str]]:
    """Write every unfinished shard, then the side files, the index, config.json; then drop the work directory."""
    if state == "fresh":
        job = {"job": plan.job, "source": str(model.path.resolve()), "experts": plan.experts, "dense": plan.dense,
               "source_files": _source_stamps(index)}
        _atomic_write(work / JOB_FILE, json.dumps(job, sort_keys=True).encode(), work)
    else:
        _check_source_unchanged(work / JOB_FILE, index)
    written = 0
    reporter.start(plan.source_bytes, len(plan.shards))
    for shard in plan.shards:
        done = _shard_is_done(out, work, shard, plan.job)
        reporter.shard(shard, done)
        if done:
            reporter.advance(shard.source_bytes)
            continue
        _write_shard(out, work, shard, plan.job, reporter)
        written += 1
    reporter.finish()
    copied = []
    for side in _side_files(model.path):
        if side.name != "config.json":
            _atomic_write(out / side.name, side.read_bytes(), work)
            copied.append(side.name)
    _atomic_write(out / INDEX_NAME, _index_bytes(plan), work)
    _atomic_write(out / "config.json", (model.path / "config.json").read_bytes(), work)
    copied.append("config.json")
    _remove_work_dir(work)
    _fsync_dir(out)
    return written, copied


def convert(model: ResolvedModel, out: Path, experts: str = "int8", dense: str = "bf16", verify: bool = False,
            reporter: Reporter | None = None) -> ConvertResult:
    """Convert ``model`` into a container at ``out`` (resuming an interrupted run of the same job)."""
    reporter = reporter or _Silent()
    started = time.monotonic()
    out = Path(out)
    plan, index = make_plan(model, experts, dense)
    if not (model.path / "config.json").is_file():
        raise CheckpointError(f"{model.path}: has no config.json", "restore it from the original checkpoint")
    state = _prepare_out(model.path, out, plan)
    work = out / WORK_DIR
    written = 0
    copied: list[str] = []
    if state != "done":
        work.mkdir(parents=True, exist_ok=True)
        lock = _lock_work_dir(work, out)
        try:
            written, copied = _run_job(model, out, work, plan, index, state, reporter)
        finally:
            os.close(lock)
    elif work.exists():
        _remove_work_dir(work)     # a previous run was killed while cleaning up
    result = ConvertResult(out=out, shards=len(plan.shards), written_shards=written, source_bytes=plan.source_bytes,
                           output_bytes=sum((out / s.file_name).stat().st_size for s in plan.shards),
                           seconds=time.monotonic() - started, peak_rss_bytes=peak_rss_bytes(),
                           already_done=state == "done", copied_files=copied, fallbacks=plan.fallbacks)
    if verify:
        from .verify import verify_container

        result.verified = verify_container(out, index, model, plan)
        result.peak_rss_bytes = peak_rss_bytes()
    return result


__all__ = ["ContainerError", "ConvertResult", "convert", "make_plan", "peak_rss_bytes"]
