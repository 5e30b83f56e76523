"""Prompts through an engine's ``decide`` op, and the option scores into answers.

All prompts of one request go to one slot, in order, each pinned at the shared state: the first computes the
state's KV (or, with recurrent state, checkpoints it there), every later one (and a later request about the same
state on that slot) prefills only its question.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..tokenizer import TextTokenizer
from .prompts import DecisionPrompt, build_prompts, check_context, shared_state_tokens
from .questions import Question, parse_questions
from .settings import DecisionSettings


@dataclass
class Decision:
    answers: dict[str, dict[str, Any]]
    input_tokens: int = 0          # prompt tokens of every prompt (what transformers counts)
    prefilled_tokens: int = 0      # of them, computed by the engine
    cached_tokens: int = 0         # of them, reused from the slot's KV
    shared_tokens: int = 0         # leading tokens every prompt of this state shares (where each is pinned)
    reused: list[int] = field(default_factory=list)   # tokens each prompt reused from the slot
    prompts: list[DecisionPrompt] = field(default_factory=list)


def probabilities(scores: Sequence[float], temperature: float) -> list[float]:
    """Softmax of the option scores after the temperature (the decision config's logits processor)."""
    scaled = [s / temperature for s in scores]
    top = max(scaled)
    exps = [math.exp(s - top) for s in scaled]
    total = sum(exps)
    return [e / total for e in exps]


def answer_all(settings: DecisionSettings, questions: Sequence[Question],
               scores: Sequence[Sequence[float]]) -> dict[str, dict[str, Any]]:
    return {q.name: q.answer(probabilities(s, settings.temperature_of(q.type))) for q, s in zip(questions, scores)}


def decide(engine: Any, tok: TextTokenizer, settings: DecisionSettings, state: Any, questions: Any, *,
           slot: int = 0, ctx: int | None = None,
           option_ids: Callable[[Question], list[int]] | None = None) -> Decision:
    """Answer ``questions`` about ``state`` with the engine's ``decide`` op on ``slot`` (blocking); ``option_ids``
    as :func:`~.prompts.build_prompts` takes it (default: the labels' tokens)."""
    parsed = parse_questions(questions, settings.labels, settings.noul_options)
    prompts = build_prompts(tok, settings, state, parsed, option_ids)
    if ctx is not None:
        check_context(prompts, ctx)
    pin = shared_state_tokens(tok, settings, state, prompts)
    decision = Decision({}, shared_tokens=pin, prompts=prompts)
    for prompt in prompts:
        result = engine.decide(prompt.ids, prompt.marks, prompt.options, slot=slot, pin=pin).wait()
        decision.answers.update(answer_all(settings, prompt.questions, result.scores))
        decision.input_tokens += len(prompt.ids)
        decision.prefilled_tokens += int(result.stats.get("prefilled_tokens", 0))
        decision.reused.append(int(result.accept.get("reused_tokens", 0)))
        decision.cached_tokens += decision.reused[-1]
    # answers in the request's order, whatever order the prompts ran in
    decision.answers = {q.name: decision.answers[q.name] for q in parsed}
    return decision
