"""Router lookahead on and off under RAM caps, colibri alone (`nox -s bench_lookahead`; root, like `nox -s bench`).

Whether reading the next layer's predicted experts ahead pays depends on how much idle time the disk has, so it is
measured per cap: the int8 OLMoE-1B-7B-geometry container of `nox -s bench` (built here if missing), `coli tune`'s
profile, each run from a dropped page cache and no learned hot set, the two settings alternated over ROUNDS rounds
(the one that went first in a round goes second in the next), decode figures of the measured request only, and
runs where other processes took more than QUIET_OTHER_CPU of the CPU left out of the medians. Prints a table and
writes bench-results/lookahead_bench.json; docs/benchmarks.md quotes it by hand.

Knobs: COLIBRI_BENCH_LOOKAHEAD_CAPS (default "third,3GiB,5GiB,6GiB"), COLIBRI_BENCH_ROUNDS (3).
"""

from __future__ import annotations

import json
import os
import sys
import time

import stream_bench as sb
from machine_load import OwnCpuGroup

CAPS = tuple(os.environ.get("COLIBRI_BENCH_LOOKAHEAD_CAPS", "third,3GiB,5GiB,6GiB").split(","))
SETTINGS = {"off": "no-lookahead", "on": "lookahead"}   # stream_bench POLICIES: the default, lookahead off / on


def decode_row(setting: str, cap_name: str, r: int, stats: dict) -> dict:
    d = stats.get("decode") or {}
    steps = d.get("steps") or 0

    def per(key: str) -> float | None:
        return 1e3 * d[key] / steps if steps and key in d else None
    return {"setting": setting, "cap_name": cap_name, "round": r + 1, "decode_tps": stats.get("decode_tps"),
            "io_wait_ms": per("io_wait_s"), "expert_ms": per("expert_s"), "other_ms": per("other_s"),
            "read_mb": d["bytes_read"] / steps / 1e6 if steps else None,
            # staged reads beyond the misses: the wrong guesses (a right one is the miss's own read, staged early)
            "wrong_guesses": (d.get("prefetch_issued", 0) - d.get("reads", 0)) / steps if steps else None,
            "dropped": d.get("prefetch_dropped", 0) / steps if steps else None,
            "recall": d.get("lookahead_recall"), "load_average": stats.get("load_average"),
            "other_cpu_share": stats.get("other_cpu_share"), "error": stats.get("error"),
            "quiet": sb.quiet(stats)["quiet"] and "error" not in stats}


def main() -> int:
    from colibri import tune

    sb.OWN_CPU = OwnCpuGroup.create()
    sb.RESULTS.mkdir(exist_ok=True)
    base = sb.build_checkpoint(sb.CACHE / "olmoe-synth", skew=False, experts_from=None)
    container = sb.ensure_container(base, "int8")
    profile = tune.load_profile(container) or sb.run_tune(container)[0]
    rows: list[dict] = []
    sidecar = container / ".colibri-hotset"
    for cap_name in CAPS:
        cap = sb.cap_bytes_of(cap_name, sb.container_bytes(container))
        group = sb.CappedGroup(cap, f"lookahead-{cap_name}")
        try:
            sidecar.unlink(missing_ok=True)
            sb.measured(sb.run_colibri, container, cap, group, False, seed=77, tune=profile)   # unmeasured
            for r in range(sb.ROUNDS):
                for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    sb.drop_caches()
                    sidecar.unlink(missing_ok=True)
                    sb.log(f"lookahead {setting} at {cap_name} (round {r + 1})")
                    stats = sb.measured(sb.run_colibri, container, cap, group, False, SETTINGS[setting],
                                        tune=profile)
                    rows.append(decode_row(setting, cap_name, r, stats))
        finally:
            group.close()
    out = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": sb.machine(),
           "disk_bandwidth": profile.choices.disk_bandwidth, "io_threads": profile.choices.io_threads,
           "runs": rows}
    tmp = sb.RESULTS / ".lookahead_bench.json.tmp"
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, sb.RESULTS / "lookahead_bench.json")
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """Medians of the quiet runs, per cap and setting."""
    lines = ["| cap | lookahead | decode tok/s | I/O wait ms/token | expert ms | other ms | read MB/token | "
             "wrong guesses/token | of them dropped unread | runs |", "|---" * 10 + "|"]
    for cap_name in dict.fromkeys(r["cap_name"] for r in rows):
        for setting in SETTINGS:
            runs = [r for r in rows if r["cap_name"] == cap_name and r["setting"] == setting]
            kept = [r for r in runs if r["quiet"]]
            loads = [r["load_average"] for r in kept if r["load_average"] is not None]
            note = f"{len(kept)}/{len(runs)}" + (f", load {min(loads):.1f}-{max(loads):.1f}" if loads else "")
            keys = ("decode_tps", "io_wait_ms", "expert_ms", "other_ms", "read_mb", "wrong_guesses", "dropped")
            cells = [sb.fmt(sb.med(kept, key)) for key in keys]
            lines.append(f"| {cap_name} | {setting} | " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
