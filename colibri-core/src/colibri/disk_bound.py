"""The disk bound: the decode speed this machine's disk allows at an observed expert hit rate.

bound tok/s = disk bandwidth / ((1 - decode hit rate) x routed bytes per token), the formula docs/benchmarks.md
uses. The bandwidth is ``--disk-bw`` when given, else the ``coli tune`` profile's (measured at the queue depth the
engine then reads with), else an earlier ``coli plan --measure-disk`` on that disk; without any of them the bound is
unknown and every report says so (``None``), never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 1e9
UNKNOWN = "unknown: run coli tune (or pass --disk-bw GB/s)"


@dataclass(frozen=True)
class DiskBound:
    """What the disk allows: its read bandwidth (bytes/s, 0 = unknown), where that figure came from, and the bytes
    of routed experts one token reads when every one misses (the plan's)."""

    bandwidth: float = 0.0
    source: str = "unknown"
    routed_bytes_per_token: int = 0

    def tokens_per_s(self, hit_rate: float) -> float | None:
        miss_bytes = (1.0 - hit_rate) * self.routed_bytes_per_token
        return self.bandwidth / miss_bytes if self.bandwidth > 0 and miss_bytes > 0 else None

    def as_json(self) -> dict[str, Any]:
        return {"bandwidth_bytes_per_s": self.bandwidth or None, "source": self.source,
                "routed_bytes_per_token": self.routed_bytes_per_token,
                "cold_tokens_per_s": self.tokens_per_s(0.0)}

    def share(self, done: dict[str, Any]) -> dict[str, Any]:
        """The fields a ``done`` event gains: the bound at its decode hit rate, decode speed as a share of it (both
        None when unknown or when nothing was read), and where the bandwidth came from."""
        decode = done.get("decode") if isinstance(done.get("decode"), dict) else {}
        hit = _number(decode, "hit_rate") if decode else _number(done, "hit_rate")
        bound = self.tokens_per_s(hit)
        tps = _number(done, "decode_tps")
        return {"disk_bound_tps": bound, "share_of_disk_bound": tps / bound if bound and tps > 0 else None,
                "disk_bound_source": self.source}


def _number(event: dict[str, Any], name: str) -> float:
    value = event.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def disk_bound_for(spec: Any, disk_bw: float | None = None) -> DiskBound:
    """The bound of a launch (``colibri.launch.LaunchSpec``): ``disk_bw`` (GB/s), its tune profile, an earlier
    measurement of the model's disk, else unknown."""
    from .cli.inspect import disk_bandwidth

    routed = spec.plan.routed_bytes_per_token
    if disk_bw is None and spec.tune is not None:
        return DiskBound(spec.tune.choices.disk_bandwidth,
                         f"coli tune at queue depth {spec.tune.choices.io_threads}", routed)
    bandwidth, source = disk_bandwidth(spec.facts, disk_bw)
    return DiskBound(bandwidth, source if bandwidth else UNKNOWN, routed)


def share_text(stats: dict[str, Any]) -> str | None:
    """The stats line's part, or None when ``stats`` carries no disk-bound fields."""
    if "disk_bound_tps" not in stats:
        return None
    share, bound = stats.get("share_of_disk_bound"), stats.get("disk_bound_tps")
    if isinstance(share, (int, float)) and isinstance(bound, (int, float)):
        return f"{100 * share:.0f}% of the disk bound ({bound:.2f} tok/s at this hit rate)"
    if str(stats.get("disk_bound_source", "")).startswith("unknown"):
        return "disk bound unknown (run coli tune)"
    return "disk bound: no expert read from disk"
