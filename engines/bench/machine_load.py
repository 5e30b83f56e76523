"""What else the machine did while a benchmark ran: the 1-minute load average at the start of a run and the share of
the machine's CPU time that other processes took during it (from /proc/stat, minus the benchmark's own processes).

On a shared machine a number is only as good as the quiet it was measured in; each run records both, so a slow run
can be told from a busy machine.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot; idle and I/O wait are not busy."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])   # guest time is already counted in user time
    return total - idle, total


def process_ticks(pid: int) -> int:
    """User + system ticks of process ``pid`` (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat[stat.rindex(")") + 2:].split()   # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])


class OwnCpuGroup:
    """A cgroup v1 ``cpuacct`` group this process moves into, so every process it starts (and those they start,
    e.g. a Ray cluster's raylets and actors, which are not our children by pid) is counted as ours. Needs root;
    ``OwnCpuGroup.create()`` returns None without it."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls) -> OwnCpuGroup | None:
        path = cls.ROOT / f"colibri-bench-{os.getpid()}"
        try:
            path.mkdir(exist_ok=True)
            (path / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            return None
        group = cls(path)
        atexit.register(group.close)
        return group

    def close(self) -> None:
        """Back to the root group, and the group removed (it stays if a process we started outlived us)."""
        try:
            (self.ROOT / "cgroup.procs").write_text(str(os.getpid()))
            self.path.rmdir()
        except OSError:
            pass

    def ticks(self) -> int:
        """CPU time of the group's processes in clock ticks (cpuacct.usage is in nanoseconds)."""
        return int((self.path / "cpuacct.usage").read_text()) * os.sysconf("SC_CLK_TCK") // 1_000_000_000


class LoadWindow:
    """Measures one run: ``with LoadWindow(engine_pids) as w: ...`` then ``w.load_average`` and ``w.other_cpu_share``
    (other processes' busy ticks over all the machine's ticks, 0..1; this process and ``own_pids`` are ours, or
    everything in ``group`` when one is given)."""

    def __init__(self, own_pids: tuple[int, ...] = (), group: OwnCpuGroup | None = None):
        self.pids = (os.getpid(), *own_pids)
        self.group = group
        self.load_average = 0.0
        self.other_cpu_share = 0.0

    def _ours(self) -> int:
        if self.group is not None:
            return self.group.ticks()
        return sum(process_ticks(pid) for pid in self.pids)

    def __enter__(self) -> LoadWindow:
        self.load_average = os.getloadavg()[0]
        self._start = (*machine_ticks(), self._ours())
        return self

    def __exit__(self, *exc: object) -> None:
        (busy, total), ours = machine_ticks(), self._ours()
        d_busy, d_total, d_ours = busy - self._start[0], total - self._start[1], ours - self._start[2]
        self.other_cpu_share = max(0.0, d_busy - d_ours) / d_total if d_total > 0 else 0.0
