"""``coli tune``: measure this machine's disk and expert kernels once, and keep a profile ``run``/``serve`` use.

What is measured (docs/benchmarks.md, "The disk bound"):

- expert-sized random reads (``pread`` at aligned random offsets, one thread per read in flight) at queue depths
  1, 2, 4 and 8, each with and without ``O_DIRECT`` (when the filesystem accepts it), as bandwidth and median
  latency per read. Buffered reads drop what they read from the page cache so every read reaches the device, as an
  expert cache miss does.
- one routed expert's matmuls (gate/up, then down) with the runtime's own kernels, for one row (decode) and for a
  batch of rows (prefill), by a small probe compiled with the runtime (``tune_probe/tune_probe.c``); each call takes
  the next of enough copies of the expert to overflow the last-level cache, because decode streams its experts'
  weights from memory (one expert timed over and over stays cache-hot and measured 3.5x too fast).

What is chosen from it (:func:`choose`, each rule a comparison of measured figures):

- I/O threads: the shallowest queue depth whose bandwidth is within :data:`DEPTH_GAIN` of the fastest depth's.
- read mode: direct when the filesystem accepts it and its bandwidth at that depth is at least the buffered one's.
- staging buffers: two per I/O thread (one being filled while one waits for its compute), at least ``MIN_STAGES``.
- prefill chunk: a prefill pass reads each routed expert once and applies it to the rows routed to it; the chunk is
  the power of two (32-512) whose rows per expert make the expert's compute last as long as its read.
- lookahead pays when a layer's routed compute (top-k experts' decode matmuls) lasts at least
  :data:`LOOKAHEAD_COVER` of one expert's transfer at the chosen bandwidth: the next layer's predicted experts are
  read while this layer's experts compute, so that is the time there is to hide reads behind; below it, a wrong
  guess only takes bandwidth from the reads the token needs.

The profile is JSON under the config dir, one per filesystem (keyed by the device of the directory measured), so a
model on another disk never uses this one's figures.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ColibriError, UsageError

PROFILE_VERSION = 1
DEPTHS = (1, 2, 4, 8)
ALIGN = 4096
DEPTH_GAIN = 1.10            # a deeper queue counts when it reads at least 10 % faster than every shallower one
LOOKAHEAD_COVER = 0.25       # a layer's routed decode compute over one expert's transfer: lookahead pays above
CHUNK_MIN, CHUNK_MAX = 32, 512
PREFILL_PROBE_ROWS = 32
DEFAULT_EXPERT_BYTES = 3 * 2048 * 1024      # one OLMoE-1B-7B int8 expert (gate, up, down of 2048 x 1024)
DEFAULT_GEOMETRY = (2048, 1024, "q8", 64, 8)  # hidden, expert width, scheme, experts, top-k when no model is given
DEFAULT_FILE_BYTES = 256 * 1024 * 1024
DEFAULT_SECONDS = 8.0


@dataclass(frozen=True)
class ReadPoint:
    """Random expert-sized reads at one queue depth: bytes/s over the whole run and the median seconds per read."""

    depth: int
    direct: bool
    bytes_per_s: float
    latency_s: float
    reads: int


@dataclass(frozen=True)
class Choices:
    io_threads: int
    io: str                    # the engine's --io value: "direct" or "buffered"
    staging_buffers: int
    prefill_chunk: int
    lookahead: bool
    disk_bandwidth: float      # bytes/s at io_threads in that mode: the disk bound's numerator
    rules: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TuneProfile:
    device: int
    directory: str
    measured_on: str
    expert_bytes: int
    direct_supported: bool
    reads: tuple[ReadPoint, ...]
    expert_s: float            # one expert, one row (decode)
    expert_batch_s: float      # one expert, PREFILL_PROBE_ROWS rows
    qpath: str
    choices: Choices
    created: float = 0.0

    def as_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["reads"] = [asdict(p) for p in self.reads]
        return {"version": PROFILE_VERSION, **body}


# ---------------------------------------------------------------------------------------------- reads

class TuneError(ColibriError):
    """A measurement that could not be taken (unreadable file, probe that did not build or run)."""


def _open(path: Path, direct: bool) -> int:
    return os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))


def direct_supported(path: Path, block: int) -> bool:
    """Whether ``path``'s filesystem takes an aligned ``O_DIRECT`` read (tmpfs and some overlays refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = _open(path, True)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, block) as buf:
            return os.preadv(fd, [buf], 0) > 0
    except OSError:
        return False
    finally:
        os.close(fd)


def _drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def measure_depth(path: Path, block: int, depth: int, direct: bool, seconds: float, seed: int = 0) -> ReadPoint:
    """``depth`` threads each reading ``block`` bytes at random aligned offsets of ``path`` until ``seconds``
    pass (each thread reads at least once, so a tiny budget still measures)."""
    size = path.stat().st_size
    slots = max(1, (size - block) // ALIGN + 1)
    latencies: list[float] = []
    total = [0]
    lock = threading.Lock()
    errors: list[OSError] = []
    fd = _open(path, direct)
    _drop_cache(fd)

    def reader(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        mine: list[float] = []
        done = 0
        try:
            with mmap.mmap(-1, block) as buf:
                while True:
                    offset = rng.randrange(slots) * ALIGN
                    t0 = time.perf_counter()
                    got = os.preadv(fd, [buf], offset)
                    mine.append(time.perf_counter() - t0)
                    done += got
                    if not direct:
                        _drop_cache(fd, offset, block)   # the next read of this range must reach the disk too
                    if time.perf_counter() >= deadline or got <= 0:
                        break
        except OSError as exc:
            errors.append(exc)
        with lock:
            latencies.extend(mine)
            total[0] += done

    start = time.perf_counter()
    deadline = start + seconds
    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(depth)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    if errors:
        raise TuneError(f"{path}: reading at queue depth {depth}{' with O_DIRECT' if direct else ''} failed: "
                        f"{errors[0].strerror or errors[0]}", "check the file is readable, or pass another --dir")
    return ReadPoint(depth, direct, total[0] / elapsed if elapsed > 0 else 0.0,
                     statistics.median(latencies) if latencies else 0.0, len(latencies))


def measure_reads(path: Path, block: int, seconds: float, depths: tuple[int, ...] = DEPTHS
                  ) -> tuple[bool, tuple[ReadPoint, ...]]:
    """(O_DIRECT accepted, one point per depth and mode), ``seconds`` shared evenly among the points."""
    direct = direct_supported(path, block)
    modes = (False, True) if direct else (False,)
    each = seconds / (len(depths) * len(modes))
    points = tuple(measure_depth(path, block, d, m, each, seed=i)
                   for i, (m, d) in enumerate((m, d) for m in modes for d in depths))
    return direct, points


def write_scratch_file(directory: Path, size: int) -> Path:
    """A temporary file of ``size`` bytes in ``directory`` (on the filesystem measured), flushed to the device and
    dropped from the page cache; the caller deletes it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".colibri-tune-{os.getpid()}.tmp"
    chunk = random.Random(7).randbytes(1 << 20)
    try:
        with open(path, "wb") as out:
            left = size
            while left > 0:
                left -= out.write(chunk[:min(len(chunk), left)])
            out.flush()
            os.fsync(out.fileno())
            _drop_cache(out.fileno())
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise TuneError(f"{directory}: cannot write a {size}-byte scratch file: {exc.strerror or exc}",
                        "free some space, pass a smaller --file-size, or --dir another directory") from None
    return path


# ---------------------------------------------------------------------------------------------- compute

def probe_binary() -> Path:
    """The expert-kernel probe, compiled with the runtime (cached like every engine)."""
    from . import builder
    from .records import EngineSource

    source = Path(__file__).parent / "tune_probe" / "tune_probe.c"
    return builder.build(EngineSource(name="colibri-tune-probe", sources=(source,)))


def measure_expert(hidden: int, width: int, scheme: str, rows: int, threads: int, seconds: float,
                   binary: Path | None = None) -> tuple[float, str]:
    """(seconds for one expert's matmuls on ``rows`` input rows, the kernel path used)."""
    binary = binary or probe_binary()
    argv = [str(binary), str(hidden), str(width), scheme, str(rows), str(threads), repr(max(seconds, 0.001))]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60 + 10 * seconds, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TuneError(f"the expert-kernel probe {binary} did not run: {exc}", "coli doctor checks the compiler") \
            from None
    try:
        answer = json.loads(done.stdout)
        return float(answer["expert_s"]), str(answer["qpath"])
    except (ValueError, KeyError, TypeError):
        lines = done.stderr.strip().splitlines()
        raise TuneError(f"the expert-kernel probe failed (exit {done.returncode}): "
                        f"{lines[-1] if lines else 'no answer'}", "coli doctor checks the compiler") from None

# ---------------------------------------------------------------------------------------------- choices

def _best_depth(points: list[ReadPoint]) -> ReadPoint:
    """The shallowest depth that reads within DEPTH_GAIN of the fastest depth measured.

    Not "stop at the first step that gains less": on a virtual disk depth 2 may add 4 % and depth 4 another 20 %
    (measured here: 697, 724, then 865 MB/s), and stopping at 1 would leave a fifth of the disk unused. The
    shallowest depth near the best keeps the fewest threads (and staging buffers) for nearly all the bandwidth."""
    fastest = max(p.bytes_per_s for p in points)
    return next(p for p in points if p.bytes_per_s * DEPTH_GAIN >= fastest)


def _pow2_between(value: float, low: int, high: int) -> int:
    n = low
    while n < high and n < value:
        n *= 2
    return n


def choose(reads: tuple[ReadPoint, ...], expert_bytes: int, expert_s: float, expert_batch_s: float,
           experts_per_layer: int, top_k: int) -> Choices:
    """The settings :mod:`colibri.tune` documents, from the measured figures."""
    from .planner import MIN_STAGES

    buffered = _best_depth(sorted((p for p in reads if not p.direct), key=lambda p: p.depth))
    direct_points = sorted((p for p in reads if p.direct), key=lambda p: p.depth)
    best = buffered
    if direct_points:
        direct = _best_depth(direct_points)
        if direct.bytes_per_s >= buffered.bytes_per_s:
            best = direct
    read_s = expert_bytes / best.bytes_per_s * best.depth if best.bytes_per_s > 0 else float("inf")
    row_s = expert_batch_s / PREFILL_PROBE_ROWS
    rows_needed = read_s / row_s if row_s > 0 else float("inf")
    chunk = _pow2_between(rows_needed * max(1, experts_per_layer) / max(1, top_k), CHUNK_MIN, CHUNK_MAX)
    # The guesses stream at the disk's bandwidth, so they are measured by an expert's transfer time, not by one
    # read's latency at the queue depth (which grows with the depth and would make the choice follow its noise).
    transfer_s = expert_bytes / best.bytes_per_s if best.bytes_per_s > 0 else float("inf")
    lookahead = max(1, top_k) * expert_s >= LOOKAHEAD_COVER * transfer_s
    return Choices(
        io_threads=best.depth, io="direct" if best.direct else "buffered",
        staging_buffers=max(MIN_STAGES, 2 * best.depth), prefill_chunk=chunk, lookahead=lookahead,
        disk_bandwidth=best.bytes_per_s,
        rules={"io_threads": f"the shallowest depth within {DEPTH_GAIN:g}x of the fastest depth's bandwidth",
               "io": "direct when accepted and at least as fast as buffered at that depth",
               "staging_buffers": "two per I/O thread, at least the planner's minimum",
               "prefill_chunk": f"rows per expert whose compute ({row_s * 1e3:.3f} ms a row) lasts one read "
                                f"({read_s * 1e3:.2f} ms), times experts/top-k, as a power of two "
                                f"{CHUNK_MIN}-{CHUNK_MAX}",
               "lookahead": f"on when a layer's routed decode compute ({top_k} x {expert_s * 1e3:.3f} ms) is at "
                            f"least {LOOKAHEAD_COVER:g} of one expert's transfer ({transfer_s * 1e3:.2f} ms at "
                            f"{best.bytes_per_s / 1e9:.2f} GB/s)"})


# ---------------------------------------------------------------------------------------------- profile file

def profile_path(directory: Path) -> Path:
    """The profile of the filesystem holding ``directory``."""
    from .xdg import config_dir

    return config_dir() / "tune" / f"dev{os.stat(directory).st_dev}.json"


def save_profile(profile: TuneProfile, directory: Path) -> Path:
    """Write atomically: a crash leaves the old profile or none, never half of one."""
    target = profile_path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile.as_json(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, target)
    return target


def parse_profile(data: Any) -> TuneProfile:
    """A profile from its JSON, or ValueError/KeyError/TypeError naming what is wrong."""
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        raise ValueError(f"not a version-{PROFILE_VERSION} profile")
    c = data["choices"]
    choices = Choices(io_threads=int(c["io_threads"]), io=str(c["io"]), staging_buffers=int(c["staging_buffers"]),
                      prefill_chunk=int(c["prefill_chunk"]), lookahead=bool(c["lookahead"]),
                      disk_bandwidth=float(c["disk_bandwidth"]), rules=dict(c.get("rules") or {}))
    if not (1 <= choices.io_threads <= max(DEPTHS) and choices.io in ("direct", "buffered")
            and 2 <= choices.staging_buffers <= 64 and 1 <= choices.prefill_chunk <= 4096
            and choices.disk_bandwidth > 0):
        raise ValueError("choices out of range")
    reads = tuple(ReadPoint(int(p["depth"]), bool(p["direct"]), float(p["bytes_per_s"]), float(p["latency_s"]),
                            int(p["reads"])) for p in data["reads"])
    return TuneProfile(device=int(data["device"]), directory=str(data["directory"]),
                       measured_on=str(data["measured_on"]), expert_bytes=int(data["expert_bytes"]),
                       direct_supported=bool(data["direct_supported"]), reads=reads,
                       expert_s=float(data["expert_s"]), expert_batch_s=float(data["expert_batch_s"]),
                       qpath=str(data["qpath"]), choices=choices, created=float(data.get("created") or 0))


def load_profile(directory: Path) -> TuneProfile | None:
    """The profile of ``directory``'s filesystem, or None when there is none; a corrupt one is ignored with a
    one-line warning (it only ever tunes speed, so running untuned is always correct)."""
    from .console import print_warning

    try:
        path = profile_path(directory)
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    try:
        return parse_profile(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        print_warning(f"ignoring the tune profile {path}: {exc} (run coli tune again)")
        return None


# ---------------------------------------------------------------------------------------------- coli tune

def tune(directory: Path, *, model_file: Path | None, expert_bytes: int, geometry: tuple[int, int, str, int, int],
         file_size: int, seconds: float, threads: int) -> TuneProfile:
    """Measure and choose; ``model_file`` (a model's shard, only read) replaces the scratch file."""
    block = max(ALIGN, (expert_bytes + ALIGN - 1) // ALIGN * ALIGN)
    if seconds <= 0:
        raise UsageError(f"--seconds {seconds:g}: must be a positive number", "for example --seconds 8")
    scratch = None
    if model_file is None:
        if file_size < 2 * block:
            raise UsageError(f"--file-size {file_size}: must hold at least two {block}-byte reads",
                             f"pass --file-size {max(DEFAULT_FILE_BYTES, 2 * block)}")
        scratch = target = write_scratch_file(directory, file_size)
    else:
        target = model_file
        if target.stat().st_size < block:
            block = max(ALIGN, target.stat().st_size // ALIGN * ALIGN)
    try:
        direct, reads = measure_reads(target, block, seconds * 0.8)
    finally:
        if scratch is not None:
            scratch.unlink(missing_ok=True)
    hidden, width, scheme, experts, top_k = geometry
    binary = probe_binary()
    expert_s, qpath = measure_expert(hidden, width, scheme, 1, threads, seconds * 0.1, binary)
    batch_s, _ = measure_expert(hidden, width, scheme, PREFILL_PROBE_ROWS, threads, seconds * 0.1, binary)
    choices = choose(reads, block, expert_s, batch_s, experts, top_k)
    return TuneProfile(device=os.stat(directory).st_dev, directory=str(directory),
                       measured_on=str(model_file) if model_file else "a temporary file", expert_bytes=block,
                       direct_supported=direct, reads=reads, expert_s=expert_s, expert_batch_s=batch_s, qpath=qpath,
                       choices=choices, created=time.time())
