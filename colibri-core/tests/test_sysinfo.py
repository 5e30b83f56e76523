"""RAM from /proc/meminfo within cgroup v1/v2 limits (on a fake /proc and /sys tree), disk bandwidth."""

from __future__ import annotations

import os

import pytest
from colibri import sysinfo

GIB = 1024**3


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    monkeypatch.setattr(sysinfo, "ROOT", tmp_path)

    def put(rel: str, text: str) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    put("proc/meminfo", f"MemTotal:       {16 * GIB // 1024} kB\nMemFree:         {GIB // 1024} kB\n"
                        f"MemAvailable:   {10 * GIB // 1024} kB\nHugePages_Total:       0\n")
    return put


def test_meminfo_only(fake_root):
    mem = sysinfo.memory()
    assert (mem.available_bytes, mem.mem_total, mem.cgroup_limit) == (10 * GIB, 16 * GIB, None)
    assert mem.source == "MemAvailable"


def test_cgroup_v2_own_limit_minus_usage(fake_root):
    fake_root("proc/self/cgroup", "0::/user.slice/app.scope\n")
    fake_root("sys/fs/cgroup/user.slice/app.scope/memory.max", f"{4 * GIB}\n")
    fake_root("sys/fs/cgroup/user.slice/app.scope/memory.current", f"{GIB}\n")
    fake_root("sys/fs/cgroup/user.slice/memory.max", "max\n")
    mem = sysinfo.memory()
    assert (mem.cgroup_limit, mem.cgroup_usage, mem.cgroup_version) == (4 * GIB, GIB, 2)
    assert mem.available_bytes == 3 * GIB and mem.source == "cgroup v2 limit"


def test_cgroup_v2_tighter_ancestor_wins(fake_root):
    fake_root("proc/self/cgroup", "0::/a/b\n")
    fake_root("sys/fs/cgroup/a/b/memory.max", "max\n")
    fake_root("sys/fs/cgroup/a/memory.max", f"{2 * GIB}\n")
    fake_root("sys/fs/cgroup/a/memory.current", f"{GIB // 2}\n")
    assert sysinfo.memory().available_bytes == GIB + GIB // 2


def test_cgroup_v2_namespace_root(fake_root):
    """Inside a container /proc/self/cgroup says "/" and the container's cgroup is mounted at the base."""
    fake_root("proc/self/cgroup", "0::/\n")
    fake_root("sys/fs/cgroup/memory.max", f"{6 * GIB}\n")
    assert sysinfo.memory().available_bytes == 6 * GIB


def test_cgroup_limit_above_meminfo_changes_nothing(fake_root):
    fake_root("proc/self/cgroup", "0::/big\n")
    fake_root("sys/fs/cgroup/big/memory.max", f"{64 * GIB}\n")
    mem = sysinfo.memory()
    assert mem.available_bytes == 10 * GIB and mem.source == "MemAvailable"


def test_cgroup_v1_memory_controller(fake_root):
    fake_root("proc/self/cgroup", "12:cpu,cpuacct:/docker/abc\n9:memory:/docker/abc\n1:name=systemd:/x\n")
    fake_root("sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{5 * GIB}\n")
    fake_root("sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", f"{2 * GIB}\n")
    mem = sysinfo.memory()
    assert (mem.available_bytes, mem.cgroup_version) == (3 * GIB, 1)
    assert mem.source == "cgroup v1 limit"


def test_cgroup_v1_unlimited_is_no_limit(fake_root):
    fake_root("proc/self/cgroup", "9:memory:/\n")
    fake_root("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert sysinfo.memory().cgroup_limit is None


def test_hybrid_prefers_v2_limit_then_v1(fake_root):
    fake_root("proc/self/cgroup", "9:memory:/lim\n0::/\n")
    fake_root("sys/fs/cgroup/memory/lim/memory.limit_in_bytes", f"{GIB}\n")
    # no v2 limit anywhere: fall back to the v1 memory controller's
    mem = sysinfo.memory()
    assert (mem.cgroup_limit, mem.cgroup_version) == (GIB, 1)


def test_garbage_files_are_ignored(fake_root):
    fake_root("proc/self/cgroup", "garbage\n0::/x\n")
    fake_root("sys/fs/cgroup/x/memory.max", "lots\n")
    assert sysinfo.memory().available_bytes == 10 * GIB


def test_real_machine_answers_something():
    mem = sysinfo.memory()
    assert 0 < mem.available_bytes <= mem.mem_total


def test_read_bandwidth_drops_the_cache_and_reads(tmp_path, monkeypatch):
    data = os.urandom(3 * 1024 * 1024 + 17)
    path = tmp_path / "shard.safetensors"
    path.write_bytes(data)
    advice = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: advice.append(how) or real(fd, off, n, how))
    reads = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    bw = sysinfo.measure_read_bandwidth(path, max_bytes=2 * 1024 * 1024 + 5)
    assert bw > 0
    assert advice[0] == os.POSIX_FADV_DONTNEED
    assert sum(reads) == 2 * 1024 * 1024 + 5  # stops at max_bytes


def test_free_disk(tmp_path):
    assert sysinfo.free_disk_bytes(tmp_path) > 0
