"""``coli decide``: System One questions about a state, answered with probabilities (no generation)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from ..console import emit_json, print_table
from ..errors import UsageError
from ..model import resolve_model
from ._app import app
from .options import FamilyOption, JsonOption, ModelOption

QUESTION_HELP = ("ID:TYPE:INSTRUCTIONS[:OPTIONS] — TYPE noul, choice or score; OPTIONS (choice options, or score "
                 "levels lowest first) separated by commas, e.g. 'tone:choice:What is the tone?:calm,pushy'. "
                 "Repeat for several questions.")


def read_state(value: str) -> Any:
    """--state: a file's text or the text itself; text that is a JSON object or array is sent as JSON."""
    path = Path(value)
    text = value
    if len(value) < 4096 and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--state {value}: cannot read it as UTF-8 text ({exc})", "pass a text file") from None
    if text.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def parse_question_flag(flag: str) -> tuple[str, dict[str, Any]]:
    parts = flag.split(":", 2)
    if len(parts) < 3 or not parts[0] or not parts[2]:
        raise UsageError(f"--question {flag!r}: expected ID:TYPE:INSTRUCTIONS[:OPTIONS]",
                         "e.g. --question 'spam:noul:Is this spam?'")
    name, kind, rest = parts
    question: dict[str, Any] = {"type": kind, "instructions": rest}
    if kind in ("choice", "score"):
        if ":" not in rest:
            raise UsageError(f"--question {flag!r}: a {kind} question needs its options after a last ':'",
                             f"e.g. --question '{name}:{kind}:{rest}:low,medium,high'")
        instructions, options = rest.rsplit(":", 1)
        names = [o.strip() for o in options.split(",") if o.strip()]
        question["instructions"] = instructions
        question["criteria"] = dict.fromkeys(names) if kind == "choice" else names
    return name, question


def gather_questions(flags: list[str], questions_file: Path | None) -> dict[str, Any]:
    questions: dict[str, Any] = {}
    if questions_file is not None:
        try:
            loaded = json.loads(questions_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"--questions {questions_file}: not a readable JSON file ({exc})",
                             'write an object such as {"spam": {"type": "noul", "instructions": "Is it spam?"}}') \
                from None
        if not isinstance(loaded, dict):
            raise UsageError(f"--questions {questions_file}: not a JSON object", "map question ids to questions")
        questions.update(loaded)
    for flag in flags:
        name, question = parse_question_flag(flag)
        questions[name] = question
    if not questions:
        raise UsageError("no question given", "pass --question 'spam:noul:Is this spam?' (or --questions FILE)")
    return questions


def answer_cells(answer: dict[str, Any]) -> tuple[str, str, str]:
    """(answer, confidence, probabilities) of one answer, as the table prints them."""
    if answer["type"] == "noul":
        return f"{answer['noul']:.4f}", "", f"true {answer['noul']:.4f}"
    probs = ", ".join(f"{k} {v:.4f}" for k, v in answer["probabilities"].items())
    shown = answer["choice"] if answer["type"] == "choice" else f"{answer['score']:.4f}"
    return shown, f"{answer['confidence']:.4f}", probs


@app.command("decide")
def decide_command(
    model: Optional[str] = ModelOption,
    family: Optional[str] = FamilyOption,
    state: str = typer.Option(..., "--state", metavar="FILE|TEXT", help="The state: a file or the text itself; a "
                              "JSON object or array is sent as JSON."),
    question: List[str] = typer.Option([], "--question", "-q", help=QUESTION_HELP),
    questions_file: Optional[Path] = typer.Option(None, "--questions", metavar="FILE",
                                                  help="A JSON object of questions, as /v1/systemone takes them."),
    normalize: bool = typer.Option(False, "--normalize", help="Join a state given as an array of text parts."),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context length in tokens (default 4096 or the model's)."),
    cap: Optional[int] = typer.Option(None, "--cap", help="Expert cache slots per MoE layer (default: from --ram)."),
    ram: Optional[float] = typer.Option(None, "--ram", metavar="GB", help="RAM budget in GiB."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads (default: all cores)."),
    as_json: bool = JsonOption,
) -> None:
    """Answer typed questions (noul, choice, score) about a state with probabilities, from one prefill each."""
    from .. import hooks, launch
    from ..decision import check_state

    questions = gather_questions(question, questions_file)
    value = check_state(read_state(state), normalize)
    resolved = resolve_model(model, family)
    decider = hooks.decider(resolved, None)
    decider.check(questions)   # refused before the engine loads
    spec = launch.prepare(resolved, ram_gib=ram, ctx=ctx, cap=cap, threads=threads)
    with launch.start(spec) as engine:
        if "decide" not in engine.ready.get("abilities", ()):
            raise UsageError(f"the {resolved.family} engine cannot decide", "coli families shows what each runs")
        decision = decider.decide(engine, value, questions, ctx=spec.ctx)
    if as_json:
        emit_json({"model": str(resolved.path), "answers": decision.answers,
                   "usage": {"input_tokens": decision.input_tokens, "output_tokens": 0,
                             "cached_tokens": decision.cached_tokens,
                             "prefilled_tokens": decision.prefilled_tokens}})
        return
    rows = [(name, a["type"], *answer_cells(a)) for name, a in decision.answers.items()]
    print_table(("question", "type", "answer", "confidence", "probabilities"), rows)
