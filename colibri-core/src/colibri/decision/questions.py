"""The questions of a System One request: validation (each error names the question and field) and answers.

Shapes (as transformers' ``transformers.decision`` reads them):

- ``noul``: ``instructions``, optional ``criteria`` ``{"true": ..., "false": ...}``; answer P(true);
- ``choice``: ``criteria`` maps each option to a description (or null); answer the likeliest option, its
  probabilities and a confidence;
- ``score``: ``criteria`` lists the levels lowest first; answer the expected level, the legend, probabilities and a
  confidence.

Content (instructions, descriptions) is a string, an object or an array; objects and arrays reach the prompt as JSON.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import UsageError

TYPES = ("noul", "choice", "score")
MAX_QUESTIONS = 64
DEFAULT_NOUL_LABELS = ("Yes", "No")
DEFAULT_LABELS = tuple(string.ascii_uppercase)
EXAMPLES = {
    "noul": '{"type": "noul", "instructions": "Is this spam?", "criteria": {"true": "ads", "false": "a real message"}}',
    "choice": '{"type": "choice", "instructions": "What is the tone?", "criteria": {"calm": null, "angry": null}}',
    "score": '{"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]}',
}


class DecisionInputError(UsageError):
    """A request the decision API refuses (HTTP 422): ``field`` is where, e.g. ``questions.spam.criteria``."""

    def __init__(self, field: str, message: str, hint: str | None = None):
        super().__init__(f"{field}: {message}", hint)
        self.field = field


@dataclass(frozen=True)
class Question:
    """One question with its options in prompt order, the label token each is read by, and their descriptions."""

    name: str
    type: str
    instructions: Any
    options: tuple[str, ...]
    labels: tuple[str, ...]
    descriptions: tuple[Any, ...]

    def template_view(self) -> dict[str, Any]:
        """The question as decision templates read it (``question.options``, ``question.labels``, ...)."""
        return {"name": self.name, "type": self.type, "instructions": self.instructions,
                "options": list(self.options), "labels": list(self.labels), "descriptions": list(self.descriptions)}

    def answer(self, probabilities: Sequence[float]) -> dict[str, Any]:
        """The System One answer from the options' probabilities (in option order)."""
        by_option = dict(zip(self.options, (float(p) for p in probabilities)))
        n = len(self.options)
        if self.type == "noul":
            return {"type": "noul", "noul": by_option["true"]}
        best = max(by_option, key=lambda option: by_option[option])
        if self.type == "choice":
            chance = 1.0 / n
            confidence = 1.0 if n == 1 else max(0.0, (by_option[best] - chance) / (1.0 - chance))
            return {"type": "choice", "choice": best, "confidence": confidence, "probabilities": by_option}
        probs = list(by_option.values())
        # Confidence: how much closer the mass sits to the likeliest level than a uniform spread would.
        spread = sum(p * abs(level - int(best)) for level, p in enumerate(probs))
        uniform = sum(abs(level - (n - 1) / 2) for level in range(n)) / n
        confidence = 1.0 if n == 1 else max(0.0, 1.0 - spread / uniform)
        return {"type": "score", "score": sum(level * p for level, p in enumerate(probs)),
                "legend": dict(zip(self.options, self.descriptions)), "confidence": confidence,
                "probabilities": by_option}


def _is_content(value: Any, nullable: bool = True) -> bool:
    return (value is None and nullable) or isinstance(value, (str, dict, list))


def _check_keys(where: str, kind: str, question: Mapping[str, Any]) -> None:
    allowed = {"type", "instructions", "criteria"}
    extra = sorted(set(question) - allowed)
    if extra:
        raise DecisionInputError(f"{where}.{extra[0]}", f"unknown field of a {kind} question",
                                 f"a {kind} question looks like {EXAMPLES[kind]}")
    if not _is_content(question.get("instructions")):
        raise DecisionInputError(f"{where}.instructions", "must be a string, an object or an array")


def _criteria(where: str, kind: str, question: Mapping[str, Any],
              noul_options: Sequence[str]) -> dict[str, Any]:
    criteria = question.get("criteria")
    hint = f"a {kind} question looks like {EXAMPLES[kind]}"
    if kind == "noul":
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, dict):
            raise DecisionInputError(f"{where}.criteria", "must map 'true' and 'false' to descriptions", hint)
        for key, value in criteria.items():
            if key not in ("true", "false"):
                raise DecisionInputError(f"{where}.criteria.{key}", "a noul question has only 'true' and 'false'",
                                         hint)
            if not _is_content(value):
                raise DecisionInputError(f"{where}.criteria.{key}", "must be a string, an object, an array or null")
        return {option: criteria.get(option) for option in noul_options}
    if kind == "choice":
        if not isinstance(criteria, dict) or len(criteria) < 2:
            raise DecisionInputError(f"{where}.criteria", "a choice question needs at least 2 options (an object "
                                     "mapping each option to its description or null)", hint)
        for key, value in criteria.items():
            if not _is_content(value):
                raise DecisionInputError(f"{where}.criteria.{key}", "must be a string, an object, an array or null")
        return dict(criteria)
    if not isinstance(criteria, list) or len(criteria) < 2:
        raise DecisionInputError(f"{where}.criteria", "a score question needs at least 2 levels (an array, lowest "
                                 "first)", hint)
    for i, level in enumerate(criteria):
        if not _is_content(level, nullable=False):
            raise DecisionInputError(f"{where}.criteria[{i}]", "a level must be a string, an object or an array")
    return {str(i): level for i, level in enumerate(criteria)}


def parse_question(name: str, question: Any, labels: Mapping[str, Sequence[str]],
                   noul_options: Sequence[str] = ("true", "false")) -> Question:
    where = f"questions.{name}"
    if not isinstance(question, dict):
        raise DecisionInputError(where, "must be an object with a type (noul, choice or score)")
    kind = question.get("type")
    if kind not in TYPES:
        raise DecisionInputError(f"{where}.type", f"must be one of noul, choice, score (got {kind!r})",
                                 f"e.g. {EXAMPLES['noul']}")
    _check_keys(where, kind, question)
    criteria = _criteria(where, kind, question, noul_options)
    names = tuple(labels.get(kind) or (DEFAULT_NOUL_LABELS if kind == "noul" else DEFAULT_LABELS))
    if len(names) < len(criteria):
        raise DecisionInputError(f"{where}.criteria", f"this model reads at most {len(names)} options of a {kind} "
                                 f"question, got {len(criteria)}", "ask with fewer options")
    return Question(name, kind, question.get("instructions"), tuple(criteria), names[:len(criteria)],
                    tuple(criteria.values()))


def parse_questions(questions: Any, labels: Mapping[str, Sequence[str]] | None = None,
                    noul_options: Sequence[str] = ("true", "false")) -> list[Question]:
    """The request's questions in request order; the first invalid one raises :class:`DecisionInputError`."""
    if not isinstance(questions, dict):
        raise DecisionInputError("questions", "must be an object mapping question ids to questions")
    if not 1 <= len(questions) <= MAX_QUESTIONS:
        raise DecisionInputError("questions", f"holds {len(questions)} questions; ask 1 to {MAX_QUESTIONS}",
                                 "split the questions over several requests" if questions else None)
    return [parse_question(str(name), q, labels or {}, noul_options) for name, q in questions.items()]
