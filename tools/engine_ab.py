#!/usr/bin/env python3
"""A/B a family engine built from two revisions, alternated round by round on one checkpoint (default: OLMoE).

For a refactor that must not cost speed ("within noise") on a shared machine where a full ``nox -s bench`` is too
long: both binaries are built here from ``git archive`` of each revision (runtime + olmoe.c, colibri.compiler's
flags), then run A B A B ... on the same prompt (prefill) and the same teacher-forced decode steps, each run a fresh
engine process whose page cache is already warm. Every run records the 1-minute load average, so a reader can see
how loaded the machine was; the summary is each side's median, the B/A ratio of the medians and the median of
the per-round B/A ratios (A and B of a round ran back to back), per phase.

    .nox/tests/bin/python tools/engine_ab.py --base d1c4f15 [--head HEAD] [--rounds 5] [--layers 4] [--precision int8]
    .nox/tests/bin/python tools/engine_ab.py --base d1c4f15 --engine colibri-qwen/src/colibri_qwen/engine/qwen.c \
        --model DIR

``--engine`` names another family's C source (built with the files of its folder) and ``--model`` the checkpoint
it runs (a directory its plugin resolves, e.g. ``colibri.testing.tiny.tiny_model(kind, root, hidden_size=512)``);
without ``--model`` the checkpoint is the bench's OLMoE geometry (engines/bench/stream_bench.py) at a reduced
size, cached under ``$COLIBRI_BENCH_CACHE`` (default ``~/.cache/colibri/bench``), never in the repository;
``--precision int8|int4`` runs its colibri-quant container instead (converted once by ``coli convert``, cached
beside it), for the integer kernels. Prints one JSON line per run and a summary; writes nothing else. Not a test: it
asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engines" / "bench"))

import stream_bench as sb  # noqa: E402

RUNTIME = "colibri-core/src/colibri/runtime"
OLMOE = "colibri-olmoe/src/colibri_olmoe/engine/olmoe.c"


def build(rev: str, out: Path, engine: str = OLMOE) -> Path:
    """The engine ``engine`` (a C source path in the repository) of ``rev``, compiled as colibri's builder does
    (same flags, every runtime source, the engine folder's headers on the include path)."""
    from colibri.compiler import CFLAGS, find_compiler

    src = out / f"src-{rev}"
    src.mkdir(parents=True)
    folder = str(Path(engine).parent)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, RUNTIME, folder], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    binary = out / f"colibri-{Path(engine).stem}-{rev}"
    runtime = src / RUNTIME
    cc = find_compiler()
    subprocess.run([*cc.argv, *CFLAGS, f"-I{runtime}", f"-I{src / folder}", *map(str, sorted(runtime.glob("*.c"))),
                    str(src / engine), "-o", str(binary), "-lm"], check=True)
    return binary


def run_once(binary: Path, model: Path, prompt: list[int], forced: list[int]) -> dict:
    from colibri import launch
    from colibri.engine import Engine
    from colibri.model import resolve_model

    ctx = max(512, len(prompt) + len(forced))   # a 512-token prompt still fits with its decode steps
    spec = launch.prepare(resolve_model(str(model), None), ram_gib=None, ctx=ctx, threads=2)
    argv = [str(binary), *spec.argv[1:]]
    load_avg = os.getloadavg()[0]
    with Engine(argv, env=spec.env, ready_timeout=600) as eng:
        result = eng.generate(prompt, max_tokens=len(forced), forced=forced)
    stats = dict(result.stats)
    return {"prefill_tps": stats.get("prefill_tps"), "decode_tps": stats.get("decode_tps"), "load_avg": load_avg}


def geometry_args(ap: argparse.ArgumentParser, rounds: int, layers: int, experts: int, decode: int) -> None:
    """The reduced bench geometry and workload flags (tools/policy_ab.py shares them)."""
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=experts)
    ap.add_argument("--prompt", type=int, default=64, help="prefill tokens")
    ap.add_argument("--decode", type=int, default=decode, help="decode steps")


def use_geometry(args: argparse.Namespace) -> dict:
    """Set stream_bench's geometry and workload lengths from geometry_args' flags; returns the geometry."""
    sb.GEOM.update(layers=args.layers, hidden=args.hidden, heads=args.hidden // 128, inter=args.hidden // 2,
                   experts=args.experts, top_k=8, vocab=32000)
    sb.PROMPT_TOKENS, sb.DECODE_TOKENS = args.prompt, args.decode
    return sb.GEOM


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="revision A (e.g. the branch point)")
    ap.add_argument("--head", default="HEAD", help="revision B (default HEAD)")
    geometry_args(ap, rounds=5, layers=4, experts=32, decode=16)
    ap.add_argument("--engine", default=OLMOE, help="the family's C source, relative to the repository")
    ap.add_argument("--model", type=Path, help="the checkpoint directory (default: the synthetic OLMoE one)")
    ap.add_argument("--precision", choices=("bf16", *sb.PRECISIONS), default="bf16",
                    help="bf16: the native checkpoint; int8/int4: its colibri-quant container")
    args = ap.parse_args(argv)
    g = use_geometry(args)
    if args.model:
        model = args.model
        vocab = json.loads((model / "config.json").read_text()).get("vocab_size") or g["vocab"]
    else:
        model = sb.CACHE / f"olmoe-ab-{g['layers']}l-{g['hidden']}h-{g['experts']}e"
        sb.build_checkpoint(model, skew=False, experts_from=None)
        vocab = g["vocab"]
    if args.precision != "bf16":
        model = sb.ensure_container(model, args.precision)
    prompt, forced = sb.workload(vocab, locality=False)
    with tempfile.TemporaryDirectory(prefix="engine-ab-") as tmp:
        sides = {"A": build(args.base, Path(tmp), args.engine), "B": build(args.head, Path(tmp), args.engine)}
        for binary in sides.values():   # one unmeasured run each: page cache warm, binaries paged in
            run_once(binary, model, prompt, forced)
        runs: dict[str, list[dict]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for side in ("AB" if r % 2 == 0 else "BA"):
                rec = run_once(sides[side], model, prompt, forced)
                runs[side].append(rec)
                print(json.dumps({"round": r, "side": side, "rev": args.base if side == "A" else args.head, **rec,
                                  "time": time.strftime("%H:%M:%S")}), flush=True)
    summary = {}
    for phase in ("prefill_tps", "decode_tps"):
        a = statistics.median(x[phase] for x in runs["A"])
        b = statistics.median(x[phase] for x in runs["B"])
        spread = {s: (min(x[phase] for x in runs[s]), max(x[phase] for x in runs[s])) for s in runs}
        # Each round's A and B ran back to back, so their ratio cancels the machine's slow drift in load.
        paired = statistics.median(y[phase] / x[phase] for x, y in zip(runs["A"], runs["B"]))
        summary[phase] = {"A_median": round(a, 2), "B_median": round(b, 2), "B_over_A": round(b / a, 3),
                          "paired_B_over_A_median": round(paired, 3),
                          "A_range": [round(v, 2) for v in spread["A"]], "B_range": [round(v, 2) for v in spread["B"]]}
    summary["load_avg_median"] = round(statistics.median(x["load_avg"] for s in runs for x in runs[s]), 2)
    summary["geometry"] = (dict(g, prompt=args.prompt, decode=args.decode, precision=args.precision) if not args.model
                           else {"model": str(model), "engine": args.engine, "prompt": args.prompt,
                                 "decode": args.decode, "precision": args.precision})
    print(json.dumps({"summary": summary, "A": args.base, "B": args.head}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
