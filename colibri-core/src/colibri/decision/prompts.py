"""A System One request as token prompts: the state and questions rendered, the positions to read and the label
tokens to read there, and how much of the prompts is the shared state.

Without a ``decision_template.jinja`` each question gets its own prompt: the generic decision text (the state,
the question, its labelled options, how to answer) as the user turn of the model's chat template, read at the
last token (the next token is the answer's label). A decision template is rendered instead of the chat template,
with ``state`` and ``question`` (one prompt per question) or ``questions`` (one prompt for all); it places
``<|mark|>`` after each token to read, and ``<|split|>`` where tokenization must break. Both are dropped from the
ids, as transformers' ``read_marks`` drops them.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .. import chat_template as ct
from ..errors import ConfigError, UsageError
from ..tokenizer import TextTokenizer
from . import sanitize
from .questions import DecisionInputError, Question
from .settings import DecisionSettings

MARK, SPLIT = "<|mark|>", "<|split|>"


class CannotDecide(UsageError):
    """The model cannot answer decisions (HTTP 400): no chat template, labels that are not single tokens, ..."""


@dataclass(frozen=True)
class DecisionPrompt:
    ids: list[int]
    marks: list[int]                  # tokens before each mark; the logits row read is mark - 1
    questions: list[Question]         # one per mark
    options: list[list[int]]          # the label token ids read at each mark


def content_text(value: Any) -> str:
    """Content as prompts print it: a string as is, anything else as JSON (as the templates' ``tojson``)."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def generic_text(state: Any, question: Question) -> str:
    """The decision text any chat model answers by the next token: the state, the instructions, one line per
    labelled option, and what to answer with (the text transformers' generic decision prompt renders)."""
    lines = [content_text(question.instructions)]
    default_noul = list(question.labels) == ["Yes", "No"]
    for option, label, description in zip(question.options, question.labels, question.descriptions):
        text = content_text(description)
        if question.type == "noul":
            text = text or ("" if default_noul else option)
            if text:
                lines.append(f"{label}: {text}")
        else:
            if question.type == "choice":
                text = f"{option}: {text}" if text else option
            lines.append(f"{label}. {text}")
    body = content_text(state) + "\n\n" + "\n".join(line for line in lines if line) + "\n"
    first, last = question.labels[0], question.labels[-1]
    if question.type == "noul":
        return body + f"Answer {first} or {question.labels[1]} only."
    letters = list(question.labels) == list(string.ascii_uppercase[:len(question.labels)])
    kind = "letter" if letters else "label"
    what = "option" if question.type == "choice" else "level"
    return body + f"Answer with the {kind} of the {what} that fits best ({first} to {last}) only."


def label_ids(tok: TextTokenizer, labels: Sequence[str]) -> list[int]:
    """The single token of each label; labels must be distinct known single tokens."""
    ids = []
    unk = tok.special_tokens.get("unk_token")
    unk_id = tok.backend.token_to_id(unk) if unk else None
    for label in labels:
        got = tok.encode(label, add_special_tokens=False)
        if len(got) != 1 or got[0] == unk_id:
            raise CannotDecide(f"the label {label!r} is not a single token of this model's tokenizer",
                               "set single-token labels in the checkpoint's decision.json ('labels')")
        ids.append(got[0])
    if len(set(ids)) != len(ids):
        raise CannotDecide(f"the labels {list(labels)} are not distinct tokens of this model",
                           "set distinct labels in decision.json ('labels')")
    return ids


def _template_variables(source: str) -> set[str]:
    import jinja2.meta

    try:
        return set(jinja2.meta.find_undeclared_variables(ct._build_environment().parse(source)))
    except Exception as exc:  # jinja2 raises its own errors for a template that does not parse
        raise ConfigError(f"decision_template.jinja does not parse ({exc})", "restore it from the checkpoint") \
            from None


MARK_ID, SPLIT_ID = -1, -2     # the sentinels' places among the ids until they are dropped


def _encode_with_sentinels(tok: TextTokenizer, text: str) -> list[int]:
    """Ids of text, the sentinels split out as added tokens are (``MARK_ID`` / ``SPLIT_ID`` in their place)."""
    ids: list[int] = []
    for piece in re.split(f"({re.escape(MARK)}|{re.escape(SPLIT)})", text):
        if piece == MARK:
            ids.append(MARK_ID)
        elif piece == SPLIT:
            ids.append(SPLIT_ID)
        elif piece:
            ids += tok.encode(piece, add_special_tokens=False)
    return ids


def _read_marks(ids: list[int]) -> tuple[list[int], list[int]]:
    """The ids without sentinels, and the token count before each ``<|mark|>`` (transformers' ``read_marks``)."""
    kept: list[int] = []
    marks: list[int] = []
    for i in ids:
        if i == MARK_ID:
            marks.append(len(kept))
        elif i != SPLIT_ID:
            kept.append(i)
    return kept, marks


def _template_source(tok: TextTokenizer, settings: DecisionSettings) -> str:
    if settings.template is not None:
        return settings.template
    chosen = ct.select_template(tok.templates, None, with_tools=False)
    return chosen.source if chosen is not None else ""


def _encode_marked(tok: TextTokenizer, settings: DecisionSettings, text: str) -> tuple[list[int], list[int]]:
    """The rendered prompt's ids and marks; with sanitizing, control tokens the request spelled are text."""
    def encode(piece: str) -> list[int]:
        return _encode_with_sentinels(tok, piece)

    if not settings.sanitize:
        return _read_marks(encode(text))
    tokens = sanitize.control_tokens(tok, _template_source(tok, settings))
    return _read_marks(sanitize.encode_marked(tok, text, tokens, encode))


def _user(tok: TextTokenizer, settings: DecisionSettings, value: Any) -> Any:
    """What the request wrote, as the template gets it: control tokens marked (or, unsanitized, sentinels cut)."""
    if not settings.sanitize:
        return _strip_sentinels(value)
    return sanitize.mark(value, sanitize.control_tokens(tok, _template_source(tok, settings)))


def _strip_sentinels(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace(MARK, "").replace(SPLIT, "")
    if isinstance(value, dict):
        return {k: _strip_sentinels(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_sentinels(v) for v in value]
    return value


def _render(tok: TextTokenizer, settings: DecisionSettings, state: Any, group: list[Question]) -> str:
    if settings.template is None:
        content = _user(tok, settings, generic_text(state, group[0]))
        return tok.render_chat([{"role": "user", "content": content}], add_generation_prompt=True,
                               enable_thinking=False)
    wanted = _template_variables(settings.template)
    inputs = {"state": state, "question": group[0].template_view(), "questions": [q.template_view() for q in group]}
    template = ct.ChatTemplate(settings.template, "decision_template.jinja")
    return ct.render(template, [{"role": "user", "content": ""}], special_tokens=tok.special_tokens,
                     add_generation_prompt=True, enable_thinking=False,
                     **_user(tok, settings, {k: v for k, v in inputs.items() if k in wanted}))


def groups_of(settings: DecisionSettings, questions: list[Question]) -> list[list[Question]]:
    """One prompt per question, or one for all when the decision template reads ``questions``."""
    if settings.template is not None and "questions" in _template_variables(settings.template):
        return [questions]
    return [[q] for q in questions]


def build_prompts(tok: TextTokenizer, settings: DecisionSettings, state: Any, questions: list[Question],
                  option_ids: Callable[[Question], list[int]] | None = None) -> list[DecisionPrompt]:
    """The prompts of a request; each question's options are read at its mark as ``option_ids(question)`` (a
    decision head's rows), by default its labels' tokens (a language model's logits)."""
    if settings.template is None and not tok.has_chat_template:
        raise CannotDecide("this model has no chat template, so decision prompts cannot be rendered",
                           "add the model's chat_template.jinja, or a decision_template.jinja")
    labels: dict[tuple[str, ...], list[int]] = {}
    prompts = []
    for group in groups_of(settings, questions):
        ids, marks = _encode_marked(tok, settings, _render(tok, settings, state, group))
        if not marks:
            marks = [len(ids)]   # read after the generation prompt
        if len(marks) != len(group):
            raise CannotDecide(f"the decision template places {len(marks)} marks for {len(group)} questions",
                               "fix decision_template.jinja: one <|mark|> per question")
        if not ids or min(marks) < 1:
            raise CannotDecide("the decision template puts a mark before any token", "fix decision_template.jinja")
        options = [option_ids(q) if option_ids else labels.setdefault(q.labels, label_ids(tok, q.labels))
                   for q in group]
        prompts.append(DecisionPrompt(ids, marks, group, options))
    return prompts


PROBE = Question("\x00probe", "noul", "\u2047", ("true", "false"), ("Yes", "No"), (None, None))


def shared_state_tokens(tok: TextTokenizer, settings: DecisionSettings, state: Any,
                        prompts: list[DecisionPrompt]) -> int:
    """How many leading tokens every prompt of this state shares whatever the questions (the state's KV, computed
    once per slot): the common prefix of the prompts and of a probe prompt with another question, never past the
    first position a prompt reads."""
    ids = [p.ids for p in prompts]
    group = [PROBE] * len(prompts[0].questions)
    ids.append(_encode_marked(tok, settings, _render(tok, settings, state, group))[0])
    n = min(len(x) for x in ids)
    shared = 0
    while shared < n and all(x[shared] == ids[0][shared] for x in ids):
        shared += 1
    return min([shared] + [min(p.marks) - 1 for p in prompts])


def check_context(prompts: list[DecisionPrompt], ctx: int) -> None:
    longest = max(len(p.ids) for p in prompts)
    if longest > ctx:
        raise DecisionInputError("state", f"the state and a question take {longest} tokens; the context holds {ctx}",
                                 "shorten the state, or start the engine with a larger --ctx")
