#!/usr/bin/env python3
"""The expert cache's eviction policies side by side under a partial cache: LRU, the learned hot set, set dueling.

One skewed synthetic OLMoE checkpoint (engines/bench/stream_bench.py's router-skewed variant, at a reduced size),
one cache size, two decode workloads: teacher-forced tokens that revisit recent ones (the bench's) and free greedy
decoding (a random model's greedy decoding falls into loops). Each run is a fresh engine started as ``coli run``
would start it for a partial cache (prefetch on), differing only in ``--pin`` (off / on / duel); policies rotate
round by round, and every run starts from a copy of the same hot-set sidecar, learned by one unmeasured run on
another prompt. Prints one JSON line per run (decode tok/s, decode hit rate, bytes read per decode token, the
1-minute load average) and a summary of medians per workload and policy. Not a test: it asserts nothing.

    COLIBRI_BENCH_CACHE=/tmp/bench .nox/tests/bin/python tools/policy_ab.py [--rounds 3] [--cap 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engines" / "bench"))

import stream_bench as sb  # noqa: E402
from engine_ab import geometry_args, use_geometry  # noqa: E402

PINS = {"lru": False, "hot": True, "duel": None}      # launch.Streaming(pin=...): None is the default, set dueling


def run_once(model: Path, cap: int, pin: bool | None, hotset: Path, prompt: list[int],
             forced: list[int] | None, tokens: int) -> dict:
    from colibri import launch
    from colibri.engine import Engine
    from colibri.model import resolve_model

    spec = launch.prepare(resolve_model(str(model), None), ctx=512, cap=cap, threads=2,
                          streaming=launch.Streaming(pin=pin))
    argv = [*spec.argv, "--hotset", str(hotset)]
    load_avg = os.getloadavg()[0]
    with Engine(argv, env=spec.env, ready_timeout=600) as eng:
        result = eng.generate(prompt, max_tokens=tokens, forced=forced)
    done = dict(result.stats)
    decode = done.get("decode") or {}
    steps = max(1, int(decode.get("steps") or 1))
    return {"decode_tps": done.get("decode_tps"), "decode_hit_rate": decode.get("hit_rate"),
            "read_mb_per_token": round((decode.get("bytes_read") or 0) / steps / 1e6, 2),
            "policy_reported": done.get("policy"), "duel_lru_layers": done.get("duel_lru_layers"),
            "load_avg": load_avg}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    geometry_args(ap, rounds=3, layers=8, experts=64, decode=32)
    ap.add_argument("--cap", type=int, default=16, help="cache slots per MoE layer")
    args = ap.parse_args(argv)
    g = use_geometry(args)
    model = sb.build_checkpoint(sb.CACHE / f"olmoe-skew-{g['layers']}l-{g['hidden']}h-{g['experts']}e", skew=True,
                                experts_from=None)
    prompt, forced = sb.workload(g["vocab"], locality=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="policy-ab-") as tmp:
        learned = Path(tmp) / "learned"
        warm_prompt, warm_forced = sb.workload(g["vocab"], locality=True, seed=99)
        run_once(model, args.cap, True, learned, warm_prompt, warm_forced, args.decode)   # the sidecar, unmeasured
        for r in range(args.rounds):
            order = list(PINS)[r % 3:] + list(PINS)[:r % 3]
            for workload in ("teacher-forced", "greedy"):
                for policy in order:
                    hotset = Path(tmp) / f"hotset-{policy}"
                    shutil.copyfile(learned, hotset)
                    rec = run_once(model, args.cap, PINS[policy], hotset, prompt,
                                   forced if workload == "teacher-forced" else None, args.decode)
                    runs.setdefault((workload, policy), []).append(rec)
                    print(json.dumps({"round": r, "workload": workload, "policy": policy, **rec,
                                      "time": time.strftime("%H:%M:%S")}), flush=True)
    summary = {f"{w} {p}": {k: round(statistics.median(x[k] for x in recs), 3)
                            for k in ("decode_tps", "decode_hit_rate", "read_mb_per_token", "load_avg")}
               for (w, p), recs in runs.items()}
    print(json.dumps({"summary": summary, "geometry": dict(g, cap=args.cap, decode=args.decode)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
