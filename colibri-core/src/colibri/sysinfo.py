"""What the machine offers the planner: available RAM (within cgroup limits), free disk, disk read bandwidth.

``ROOT`` is the filesystem root the /proc and /sys paths are read under; tests point it at a fake tree.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

ROOT = Path("/")

CGROUP_MOUNT = "sys/fs/cgroup"
# cgroup v1 reports "no limit" as a page-rounded LONG_MAX; anything this large is no limit at all.
UNLIMITED_THRESHOLD = 1 << 60


@dataclass(frozen=True)
class MemoryInfo:
    """Where the RAM figure came from, so ``coli plan`` can say why it chose it."""

    available_bytes: int          # what colibri may use: min(MemAvailable, cgroup headroom)
    mem_available: int            # /proc/meminfo MemAvailable
    mem_total: int
    cgroup_limit: int | None      # the tightest limit of this process's memory cgroup and its ancestors
    cgroup_usage: int | None
    cgroup_version: int | None

    @property
    def source(self) -> str:
        if self.cgroup_limit is not None and self.available_bytes < self.mem_available:
            return f"cgroup v{self.cgroup_version} limit"
        return "MemAvailable"


def _read(rel: str | PurePosixPath) -> str | None:
    try:
        return (ROOT / str(rel).lstrip("/")).read_text()
    except OSError:
        return None


def _read_int(rel: str | PurePosixPath) -> int | None:
    """An integer file; ``None`` when absent, ``"max"`` or not a number."""
    text = _read(rel)
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED_THRESHOLD else value


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    for line in (_read("proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def own_cgroups() -> tuple[str | None, str | None]:
    """This process's (v2 path, v1 memory-controller path) from /proc/self/cgroup."""
    v2 = v1 = None
    for line in (_read("proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path or "/"
        elif "memory" in controllers.split(","):
            v1 = path or "/"
    return v2, v1


def _ancestors(path: str) -> list[PurePosixPath]:
    """``/a/b`` -> [/a/b, /a, /]: a limit on any ancestor bounds us too."""
    p = PurePosixPath("/") / path.lstrip("/")
    return [p, *p.parents]


def _tightest(base: str, cgroup_path: str, limit_file: str, usage_file: str) -> tuple[int | None, int | None]:
    """The smallest limit along the cgroup's ancestry, and the usage of the cgroup that set it.

    Inside a container the cgroup namespace makes /proc/self/cgroup say ``/`` while the container's own cgroup
    is what is mounted at the base, so the base directory itself is always consulted too.
    """
    best: tuple[int | None, int | None] = (None, None)
    for ancestor in _ancestors(cgroup_path):
        directory = PurePosixPath(base) / str(ancestor).lstrip("/")
        limit = _read_int(directory / limit_file)
        if limit is not None and (best[0] is None or limit < best[0]):
            best = (limit, _read_int(directory / usage_file))
    return best


def cgroup_memory() -> tuple[int | None, int | None, int | None]:
    """(limit, usage, version) of the tightest memory cgroup limit on this process, or Nones."""
    v2, v1 = own_cgroups()
    if v2 is not None:
        limit, usage = _tightest(CGROUP_MOUNT, v2, "memory.max", "memory.current")
        if limit is not None:
            return limit, usage, 2
    if v1 is not None:
        limit, usage = _tightest(f"{CGROUP_MOUNT}/memory", v1, "memory.limit_in_bytes", "memory.usage_in_bytes")
        if limit is not None:
            return limit, usage, 1
    return None, None, None


def memory() -> MemoryInfo:
    """RAM colibri may plan with: MemAvailable, lowered to the cgroup's remaining headroom when that is less."""
    info = meminfo()
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", info.get("MemFree", 0))
    limit, usage, version = cgroup_memory()
    usable = available
    if limit is not None:
        # The planner's own process is small; what else the cgroup holds (page cache included) may be reclaimed,
        # but a hard limit is hard: plan within limit - usage, never above the limit itself.
        headroom = max(0, limit - (usage or 0))
        usable = min(available, headroom) if available else headroom
    return MemoryInfo(usable, available, total, limit, usage, version)


def free_disk_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def measure_read_bandwidth(path: Path, max_bytes: int = 256 * 1024 * 1024, max_seconds: float = 2.0) -> float:
    """Bytes per second of a sequential read from the start of ``path``, page cache dropped first.

    ``posix_fadvise(DONTNEED)`` asks the kernel to evict the file's clean pages so the read hits the device
    (pages still dirty from a recent write stay cached, so a just-written file may read faster than the disk).
    Stops after ``max_bytes`` or ``max_seconds``, whichever comes first.
    """
    chunk = 4 * 1024 * 1024
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        done = 0
        start = time.perf_counter()
        while done < max_bytes:
            data = os.read(fd, min(chunk, max_bytes - done))
            if not data:
                break
            done += len(data)
            if time.perf_counter() - start > max_seconds:
                break
        elapsed = time.perf_counter() - start
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return done / elapsed if done and elapsed > 0 else 0.0


def _bandwidth_cache_file(path: Path) -> Path:
    from .cachedir import cache_root

    return cache_root() / "disk" / f"read-bandwidth-dev{os.stat(path).st_dev}.json"


def cached_read_bandwidth(path: Path) -> float | None:
    """A bandwidth measured earlier (``coli plan --measure-disk``) on the device holding ``path``, if any."""
    try:
        data = json.loads(_bandwidth_cache_file(path).read_text(encoding="utf-8"))
        value = float(data["bytes_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if value > 0 else None


def remember_read_bandwidth(path: Path, bytes_per_s: float) -> None:
    """Keep a measurement for the device holding ``path`` (atomic write: a crash leaves the old value or none)."""
    target = _bandwidth_cache_file(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"bytes_per_s": bytes_per_s, "measured_on": str(path)}), encoding="utf-8")
    os.replace(tmp, target)
