"""System One decisions per second: colibri's Laya engine vs the ``laya`` package's own inference (``nox -s
bench_decide``; never a default session).

The model: a Laya checkpoint built with laya's classes (colibri_decision.tiny) at about 300 M parameters (a
ModernBERT of 22 layers at width 1024, GeGLU 2048, vocabulary 50368, a 2-layer decision head), random weights from a
seed, fp32, cached under ``$COLIBRI_BENCH_CACHE`` (default ``~/.cache/colibri/bench``).

The workload: one request = a state of about 200 tokens and 4 questions (noul, choice of 3, score of 5 levels,
choice of 2), i.e. 4 decisions. colibri answers through ``LayaDecider.decide`` on a running engine: the engine's
``decide`` op over the protocol, which is what ``POST /v1/systemone`` runs minus HTTP. laya answers with
``Agent.predict`` (eager, fp32, its questions padded into one batch). Both get the same threads. Each round times
REQUESTS requests on each engine, the engines alternated (which goes first flips every round), after a warm-up
request; the report gives the median decisions/s over the rounds and the load average at each run, and checks
that the two agree on every probability.

``--quick``: the small test-sized model, 1 round, 2 requests; the table goes to bench-results/ only (a check that
the session works end to end, not a measurement). ``--rounds N``, ``--requests N``, ``--threads N`` change the run.
Writes ``bench-results/decide_bench.json`` and, unless ``--quick``, its section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from stream_bench import write_section

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri" / "bench"))
RESULTS = ROOT / "bench-results"
SECTION, TITLE = "decide-bench", "System One decisions: colibri's Laya engine vs laya (`nox -s bench_decide`)"
FULL = dict(vocab_size=50368, hidden_size=1024, num_hidden_layers=22, num_attention_heads=16, intermediate_size=2048,
            max_position_embeddings=512, local_attention=128, global_attn_every_n_layers=3, head_layers=2,
            max_len=512, head_max_len=192)
QUICK: dict = {}
STATE = ("Hello, I ordered a laptop three weeks ago (order 4417) and it still has not shipped. The tracking page "
         "says 'label created' since the 3rd. I paid for express delivery and need it for a trip on Friday. "
         "If it cannot arrive by Thursday I want a refund of the shipping cost, or the whole order cancelled. "
         "I have been a customer for six years and this is the first time something like this happened. ") * 2
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "topic": {"type": "choice", "instructions": "What is the message about?",
              "criteria": {"shipping": "delivery and tracking", "billing": None, "product": "a defect"}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["no rush", "this month", "this week", "in two days", "today"]},
    "tone": {"type": "choice", "instructions": "What is the tone?", "criteria": {"calm": None, "angry": None}},
}


def log(msg: str) -> None:
    print(f"[bench_decide {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def probabilities(answers: dict) -> dict[str, float]:
    out = {}
    for name, a in answers.items():
        for option, p in ({"true": a["noul"]} if a["type"] == "noul" else a["probabilities"]).items():
            out[f"{name}.{option}"] = float(p)
    return out


def timed(run, requests: int) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    for _ in range(requests):
        answers = run()
    seconds = time.perf_counter() - t0
    return {"decisions_per_s": requests * len(QUESTIONS) / seconds, "seconds": seconds, "load_average": load,
            "answers": answers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, 1 round, 2 requests, no docs")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    requests = args.requests or (2 if args.quick else 4)

    import laya
    import torch
    from colibri import hooks, launch
    from colibri.model import resolve_model
    from colibri.testing.tiny import tiny_model

    torch.set_num_threads(args.threads)
    log("building (or reusing) the checkpoint")
    built = tiny_model("laya", CACHE / "decide", seed=0, **(QUICK if args.quick else FULL))
    log(f"{built.path}: {built.num_parameters / 1e6:.1f} M parameters")
    agent = laya.Agent(str(built.path), device="cpu")
    resolved = resolve_model(built.path)
    decider = hooks.decider(resolved, None)
    ctx = decider.config.max_len
    runs: dict[str, list[dict]] = {"colibri": [], "laya": []}
    with launch.open_engine(resolved, ctx=ctx, threads=args.threads) as engine:
        engines = {"colibri": lambda: decider.decide(engine, STATE, QUESTIONS, ctx=ctx).answers,
                   "laya": lambda: agent.predict(STATE, QUESTIONS)["answers"]}
        with torch.no_grad():
            for run in engines.values():
                run()   # warm-up: page cache, allocator, torch's first-call work
            for r in range(rounds):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for name in order:
                    runs[name].append(timed(engines[name], requests))
                    log(f"round {r + 1}/{rounds} {name}: {runs[name][-1]['decisions_per_s']:.2f} decisions/s "
                        f"(load {runs[name][-1]['load_average']:.2f})")
    ours, theirs = probabilities(runs["colibri"][-1]["answers"]), probabilities(runs["laya"][-1]["answers"])
    agreement = max(abs(ours[k] - theirs[k]) for k in theirs)
    report(built, args, rounds, requests, runs, agreement)
    return 0


def report(built, args, rounds: int, requests: int, runs: dict, agreement: float) -> None:
    medians = {name: statistics.median(r["decisions_per_s"] for r in rs) for name, rs in runs.items()}
    results = {"model": str(built.path), "parameters": built.num_parameters, "threads": args.threads,
               "rounds": rounds, "requests_per_run": requests, "questions_per_request": len(QUESTIONS),
               "quick": args.quick, "machine": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "max_probability_difference": agreement, "medians": medians,
               "runs": {n: [{k: v for k, v in r.items() if k != "answers"} for r in rs] for n, rs in runs.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decide_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    loads = {n: ", ".join(f"{r['load_average']:.2f}" for r in rs) for n, rs in runs.items()}
    per_run = {n: ", ".join(f"{r['decisions_per_s']:.2f}" for r in rs) for n, rs in runs.items()}
    lines = [
        f"A Laya checkpoint built with laya's classes, {built.num_parameters / 1e6:.1f} M parameters (random weights, "
        f"seed 0, fp32), {args.threads} threads on {os.cpu_count()} CPUs; one request = a ~200-token state and "
        f"{len(QUESTIONS)} questions (noul, choice of 3, score of 5, choice of 2). colibri: `LayaDecider.decide` on "
        "the engine's `decide` op (what `/v1/systemone` runs, minus HTTP); laya: `Agent.predict` (eager fp32). "
        f"{rounds} rounds of {requests} requests per engine, alternated; median decisions/s.", "",
        "| engine | decisions/s (median) | per run | load average per run |", "| --- | --- | --- | --- |",
        *(f"| {n} | {medians[n]:.2f} | {per_run[n]} | {loads[n]} |" for n in runs), "",
        f"colibri / laya: {medians['colibri'] / medians['laya']:.2f}x; the largest difference between their "
        f"probabilities: {agreement:.1e}.", ""]
    target = RESULTS / "benchmarks-quick.md" if args.quick else ROOT / "docs" / "benchmarks.md"
    write_section(target, SECTION, "\n".join(lines), title=TITLE)
    log(f"wrote {target} and {RESULTS / 'decide_bench.json'}")


if __name__ == "__main__":
    sys.exit(main())
