"""System One decisions per second, colibri against each reference in one run (``nox -s bench_decide``; never a
default session). Two scenarios, each about 300 M parameters, random weights from a seed, fp32, built once and cached
under ``$COLIBRI_BENCH_CACHE`` (default ``~/.cache/colibri/bench``):

* ``laya``: a Laya checkpoint built with laya's classes (colibri_decision.tiny; a ModernBERT of 22 layers at width
  1024, GeGLU 2048, vocabulary 50368, a 2-layer decision head) against the ``laya`` package's ``Agent.predict``
  (eager, fp32, its questions padded into one batch).
* ``transformers``: a ``JevForDecision`` built with transformers' classes (colibri_decision.jev_tiny: a linear
  decision head over a ``qwen3_5_text`` backbone of 16 layers at width 1024, Gated DeltaNet and gated attention 3:1,
  MLP 3456, O(1)-scale weights re-drawn) against transformers' ``DecisionPipeline`` (``JevForDecision.decide``
  per prompt, then ``Question.answer``: transformers' ``decide`` path, eager fp32).

The workload: one request = a state of about 200 words and 4 questions (noul, choice of 3, score of 5 levels, choice
of 2), i.e. 4 decisions. colibri answers through the family's decider on a running engine (``hooks.decider(...)
.decide``: the engine's ``decide`` op over the protocol, which is what ``POST /v1/systemone`` runs minus HTTP). On
the causal JEV model colibri pins the state's KV and prefills only each further question; every request of a run
carries another ticket number at the front of its state, so no request reuses an earlier request's state (the
number of what a pinned state saves across requests is not what this measures). Both engines get the same threads
and the same requests. Each round times REQUESTS requests on each engine, the engines alternated (which goes first
flips every round), after a warm-up request; each run records the load average at its start and the share of the
machine's CPU that other processes took during it; the report gives the median decisions/s over the rounds and the
largest difference between the two engines' probabilities (the run fails above 1e-4).

``--quick``: the small test-sized models, 1 round, 2 requests; the tables go to bench-results/ only (a check that
the session works end to end, not a measurement). ``--rounds N``, ``--requests N``, ``--threads N`` change the run,
``--scenario laya|transformers`` runs one. Writes ``bench-results/decide_bench.json`` and, unless ``--quick``, its
section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from machine_load import LoadWindow
from stream_bench import write_section

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri" / "bench"))
RESULTS = ROOT / "bench-results"
SECTION, TITLE = "decide-bench", "System One decisions: colibri vs laya and transformers (`nox -s bench_decide`)"
TOL = 1e-4
LAYA_FULL = dict(vocab_size=50368, hidden_size=1024, num_hidden_layers=22, num_attention_heads=16,
                 intermediate_size=2048, max_position_embeddings=512, local_attention=128,
                 global_attn_every_n_layers=3, head_layers=2, max_len=512, head_max_len=192)
# Qwen3.5's own proportions at width 1024 (head_dim 256 with 2 KV heads, Gated DeltaNet heads of 128); the tests'
# 512-token vocabulary keeps the embedding small, so the parameters are in the layers that do the work.
JEV_FULL = dict(n=16, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8,
                linear_num_value_heads=16, intermediate_size=3456,
                decision={"temperature": {"noul": 0.5, "choice": 2.0}})
JEV_QUICK = dict(decision={"temperature": {"noul": 0.5, "choice": 2.0}})
JEV_CTX = 2048
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


@dataclass
class Scenario:
    """colibri and one reference on one model: ``engines`` maps each name to a function answering one state."""

    name: str
    reference: str
    built: Any
    description: str
    engines: dict[str, Callable[[Any], dict]]
    own_pids: tuple[int, ...] = ()
    distinct_states: bool = False
    runs: dict[str, list[dict]] = field(default_factory=dict)
    agreement: float = 0.0


def probabilities(answers: dict) -> dict[str, float]:
    out = {}
    for name, a in answers.items():
        for option, p in ({"true": a["noul"]} if a["type"] == "noul" else a["probabilities"]).items():
            out[f"{name}.{option}"] = float(p)
    return out


def states_of(scenario: Scenario, round_index: int, requests: int) -> list[Any]:
    if not scenario.distinct_states:
        return [STATE] * requests
    return [f"Ticket {round_index + 1}-{i + 1}. {STATE}" for i in range(requests)]


def timed(run: Callable[[Any], dict], states: list[Any], own_pids: tuple[int, ...]) -> dict:
    with LoadWindow(own_pids) as window:
        t0 = time.perf_counter()
        for state in states:
            answers = run(state)
        seconds = time.perf_counter() - t0
    return {"decisions_per_s": len(states) * len(QUESTIONS) / seconds, "seconds": seconds,
            "load_average": window.load_average, "other_cpu_share": window.other_cpu_share, "answers": answers}


def alternate(scenario: Scenario, rounds: int, requests: int) -> None:
    """Time every engine each round, which goes first flipping every round; the agreement of the last runs (the
    same requests on both engines)."""
    import torch

    scenario.runs = {name: [] for name in scenario.engines}
    with torch.no_grad():
        for run in scenario.engines.values():
            run("Warm-up. " + STATE)   # page cache, allocator, torch's first-call work
        for r in range(rounds):
            order = list(scenario.engines) if r % 2 == 0 else list(reversed(scenario.engines))
            for name in order:
                got = timed(scenario.engines[name], states_of(scenario, r, requests), scenario.own_pids)
                scenario.runs[name].append(got)
                log(f"{scenario.name} round {r + 1}/{rounds} {name}: {got['decisions_per_s']:.2f} decisions/s "
                    f"(load {got['load_average']:.2f}, other processes {got['other_cpu_share']:.0%} of the CPU)")
    ours = probabilities(scenario.runs["colibri"][-1]["answers"])
    theirs = probabilities(scenario.runs[scenario.reference][-1]["answers"])
    if ours.keys() != theirs.keys():
        raise SystemExit(f"{scenario.name}: the engines answered different options: {sorted(ours)} vs {sorted(theirs)}")
    scenario.agreement = max(abs(ours[k] - theirs[k]) for k in theirs)


def run_laya(args: argparse.Namespace, rounds: int, requests: int) -> Scenario:
    import laya
    from colibri import hooks, launch
    from colibri.model import resolve_model
    from colibri.testing.tiny import tiny_model

    built = tiny_model("laya", CACHE / "decide", seed=0, **({} if args.quick else LAYA_FULL))
    log(f"laya: {built.path}: {built.num_parameters / 1e6:.1f} M parameters")
    agent = laya.Agent(str(built.path), device="cpu")
    resolved = resolve_model(built.path)
    decider = hooks.decider(resolved, None)
    ctx = decider.config.max_len
    with launch.open_engine(resolved, ctx=ctx, threads=args.threads) as engine:
        scenario = Scenario(
            "laya", "laya", built,
            f"A Laya checkpoint built with laya's classes, {built.num_parameters / 1e6:.1f} M parameters (random "
            "weights, seed 0, fp32). colibri: `LayaDecider.decide` on the engine's `decide` op (what `/v1/systemone` "
            "runs, minus HTTP); laya: `Agent.predict` (eager fp32).",
            {"colibri": lambda state: decider.decide(engine, state, QUESTIONS, ctx=ctx).answers,
             "laya": lambda state: agent.predict(state, QUESTIONS)["answers"]},
            own_pids=(engine.proc.pid,))
        alternate(scenario, rounds, requests)
    return scenario


def run_transformers(args: argparse.Namespace, rounds: int, requests: int) -> Scenario:
    import torch
    import transformers
    from colibri import hooks, launch
    from colibri.model import resolve_model
    from colibri.testing.tiny import tiny_model

    built = tiny_model("jev", CACHE / "decide", seed=0, **(JEV_QUICK if args.quick else JEV_FULL))
    log(f"transformers: {built.path}: {built.num_parameters / 1e6:.1f} M parameters")
    model = transformers.JevForDecision.from_pretrained(built.path, dtype=torch.float32).eval()
    pipe = transformers.pipeline("decision", model=model,
                                 tokenizer=transformers.AutoTokenizer.from_pretrained(built.path))
    resolved = resolve_model(built.path)
    decider = hooks.decider(resolved, None)
    with launch.open_engine(resolved, ctx=JEV_CTX, threads=args.threads) as engine:
        scenario = Scenario(
            "transformers", "transformers", built,
            f"A `JevForDecision` (a decision head over a `qwen3_5_text` backbone) built with transformers' classes, "
            f"{built.num_parameters / 1e6:.1f} M parameters (O(1)-scale random weights, seed 0, fp32). colibri: "
            "`JevDecider.decide` on the engine's `decide` op (what `/v1/systemone` runs, minus HTTP; the state's KV "
            "pinned and reused by the request's further questions); transformers: `DecisionPipeline` "
            "(`JevForDecision.decide` per prompt, eager fp32). Every request's state starts with another ticket "
            "number, so no request reuses an earlier one's state.",
            {"colibri": lambda state: decider.decide(engine, state, QUESTIONS, ctx=JEV_CTX).answers,
             "transformers": lambda state: pipe({"state": state, "questions": QUESTIONS})},
            own_pids=(engine.proc.pid,), distinct_states=True)
        alternate(scenario, rounds, requests)
    return scenario


SCENARIOS = {"laya": run_laya, "transformers": run_transformers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, 1 round, 2 requests, no docs")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append",
                        help="run only this scenario (repeatable; default: all)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    requests = args.requests or (2 if args.quick else 4)

    import torch

    torch.set_num_threads(args.threads)
    scenarios = [SCENARIOS[name](args, rounds, requests) for name in (args.scenario or SCENARIOS)]
    report(scenarios, args, rounds, requests)
    worst = max(scenarios, key=lambda s: s.agreement)
    if worst.agreement > TOL:
        log(f"error: {worst.name}: colibri and {worst.reference} differ by {worst.agreement:.1e} in a probability "
            f"(more than {TOL:.0e})")
        return 1
    return 0


def medians_of(scenario: Scenario) -> dict[str, float]:
    return {name: statistics.median(r["decisions_per_s"] for r in rs) for name, rs in scenario.runs.items()}


def section_lines(scenario: Scenario) -> list[str]:
    medians = medians_of(scenario)

    def per_run(name: str, key: str, spec: str) -> str:
        return ", ".join(format(r[key], spec) for r in scenario.runs[name])

    return [
        f"### colibri vs {scenario.reference}", "", scenario.description, "",
        "| engine | decisions/s (median) | per run | load average per run | other processes' CPU share per run |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {n} | {medians[n]:.2f} | {per_run(n, 'decisions_per_s', '.2f')} | "
          f"{per_run(n, 'load_average', '.2f')} | {per_run(n, 'other_cpu_share', '.0%')} |" for n in scenario.runs),
        "", f"colibri / {scenario.reference}: {medians['colibri'] / medians[scenario.reference]:.2f}x; the largest "
        f"difference between their probabilities: {scenario.agreement:.1e}.", ""]


def report(scenarios: list[Scenario], args: argparse.Namespace, rounds: int, requests: int) -> None:
    results = {"threads": args.threads, "rounds": rounds, "requests_per_run": requests,
               "questions_per_request": len(QUESTIONS), "quick": args.quick,
               "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "scenarios": {s.name: {
                   "reference": s.reference, "model": str(s.built.path), "parameters": s.built.num_parameters,
                   "max_probability_difference": s.agreement, "medians": medians_of(s),
                   "runs": {n: [{k: v for k, v in r.items() if k != "answers"} for r in rs]
                            for n, rs in s.runs.items()}} for s in scenarios}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decide_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        f"{args.threads} threads on {os.cpu_count()} CPUs; one request = a ~200-word state and {len(QUESTIONS)} "
        "questions (noul, choice of 3, score of 5, choice of 2). Per scenario, "
        f"{rounds} rounds of {requests} requests per engine, alternated; median decisions/s; each run's load "
        "average at its start and the share of the machine's CPU other processes took during it.", ""]
    for scenario in scenarios:
        lines += section_lines(scenario)
    target = RESULTS / "benchmarks-quick.md" if args.quick else ROOT / "docs" / "benchmarks.md"
    write_section(target, SECTION, "\n".join(lines), title=TITLE)
    log(f"wrote {target} and {RESULTS / 'decide_bench.json'}")


if __name__ == "__main__":
    sys.exit(main())
