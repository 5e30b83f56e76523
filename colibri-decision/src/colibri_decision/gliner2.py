"""GLiNER2 classification as System One decisions: the checkpoint's encoder description, the engine's
hyperparameters, and the :class:`Gliner2Decider` that renders a request into GLiNER2's own classification input.

How GLiNER2 classifies (the ``gliner2`` package, ``SchemaTransformer``): every classification task of a schema is
one group of schema tokens ``( [P] <task>[: <prompt>][ [DESCRIPTION] <label>: <description>]... ( [L] <label>
[L] <label> ... ) )``; the groups are joined by ``[SEP_STRUCT]`` and followed by ``[SEP_TEXT]`` and the text's
words (split on word boundaries, lower-cased, the text ending in ``.``, ``!`` or ``?`` — else ``.`` is appended).
Each of these pieces is tokenized on its own (no ``[CLS]``/``[SEP]``), all tasks go through the encoder in ONE
pass, and the classifier MLP maps the encoder's state at each ``[L]`` marker to one logit; a single-label task's
probabilities are the softmax of its labels' logits.

The System One mapping (one request = one GLiNER2 schema, one task per question, in request order; the task name
is the question id, the prompt its instructions):

- ``choice``: a single-label classification over the criteria's options; an option's description (when not null)
  is its ``[DESCRIPTION]``;
- ``noul``: a single-label classification over the two labels ``true`` / ``false`` (with the criteria's
  descriptions); the answer is P(true);
- ``score``: a single-label classification whose labels are the levels' texts, lowest first; the answer is the
  expected level.

Objects and arrays (a JSON state, structured instructions or descriptions) reach the input as JSON text; a state
of text parts is their texts joined.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from colibri import configs
from colibri.decision import Decision, DecisionInputError, Question, parse_questions
from colibri.decision.prompts import content_text

ENCODER_DIR = "encoder_config"      # GLiNER2's save_pretrained writes the encoder's config.json there
ENGINE = Path(__file__).resolve().parent / "engine" / "gliner2.c"
SEP_STRUCT, SEP_TEXT, P_TOKEN, L_TOKEN, DESC_TOKEN = "[SEP_STRUCT]", "[SEP_TEXT]", "[P]", "[L]", "[DESCRIPTION]"
NOUL_LABELS = ("true", "false")
# Every option is read at its own [L] marker, so no label vocabulary bounds a question's options (the context does);
# these names only satisfy parse_questions, which counts a question's options against its labels.
MAX_OPTIONS = 4096
LABELS = {"noul": NOUL_LABELS, "choice": tuple(f"L{i}" for i in range(MAX_OPTIONS)),
          "score": tuple(f"L{i}" for i in range(MAX_OPTIONS))}
# config.json (encoder) fields the engine reads, with the default transformers' DebertaV2Config gives a missing one
ENCODER_FIELDS: dict[str, Any] = {
    "hidden_size": None, "num_hidden_layers": None, "num_attention_heads": None, "intermediate_size": None,
    "vocab_size": None, "max_position_embeddings": 512, "layer_norm_eps": 1e-7, "type_vocab_size": 0,
    "position_biased_input": True, "relative_attention": False, "position_buckets": -1,
    "max_relative_positions": -1, "share_att_key": False, "pos_att_type": None, "norm_rel_ebd": "none",
}


def engine_problem(enc: Mapping[str, Any]) -> str:
    """Why the GLiNER2 engine cannot run this encoder ('' when it can)."""
    kind = str(enc.get("model_type") or "bert").replace("_", "-")
    if kind != "deberta-v2":
        return f"the GLiNER2 engine runs DeBERTa-v2/v3 encoders, not {kind!r}"
    if str(enc.get("hidden_act", "gelu")) != "gelu":
        return f"encoder hidden_act {enc.get('hidden_act')!r}: the engine computes gelu"
    if int(enc.get("conv_kernel_size", 0) or 0) > 0:
        return "an encoder with a convolution layer (conv_kernel_size > 0) is not supported"
    if enc.get("attention_head_size") not in (None, int(enc.get("hidden_size", 0)) // max(
            int(enc.get("num_attention_heads", 1)), 1)):
        return "an encoder whose attention_head_size is not hidden_size / num_attention_heads is not supported"
    return ""


def engine_hparams(enc: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """``--set`` arguments of the engine, from the encoder's config read at ``where`` (every spelling handled here,
    not in C)."""
    args: list[str] = []
    for key, default in ENCODER_FIELDS.items():
        if default is None and key != "pos_att_type":
            value: Any = configs.require_int(enc, key, where=where, minimum=1)
        else:
            value = enc.get(key, default)
        if key == "pos_att_type":
            items = value if isinstance(value, (list, tuple)) else str(value or "").split("|")
            value = "|".join(str(v).strip().lower() for v in items if str(v).strip())
        elif key == "norm_rel_ebd":
            value = str(value or "none").lower()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        args += ["--set", f"{key}={value}"]
    embedding = enc.get("embedding_size")
    if embedding is not None:
        args += ["--set", f"embedding_size={int(embedding)}"]
    return tuple(args)


# ---- the input GLiNER2 builds ----

@functools.lru_cache(maxsize=1)
def _word_pattern() -> re.Pattern[str]:
    """GLiNER2's whitespace word splitter: URLs, e-mail addresses, @handles, words (letters, digits, combining
    marks, zero-width (non-)joiners) joined by - or _, else any single non-space character."""
    marks = "".join(chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)).startswith("M"))
    word = rf"[\w{re.escape(marks)}\u200c\u200d]"
    return re.compile(rf"(?:https?://[^\s]+|www\.[^\s]+)|[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{{2,}}|@[a-z0-9_]+"
                      rf"|{word}+(?:[-_]{word}+)*|\S", re.IGNORECASE)


def text_words(text: str) -> list[str]:
    """The text's words as GLiNER2 feeds them: punctuation-terminated, split, lower-cased."""
    if not text:
        text = "."
    elif not text.endswith((".", "!", "?")):
        text += "."
    return [m.group().lower() for m in _word_pattern().finditer(text)]


def state_text(state: Any) -> str:
    """The state as one text: a string as is, text parts joined, an object as JSON."""
    if isinstance(state, list):
        return "".join(p if isinstance(p, str) else str(p.get("text", "")) for p in state)
    return content_text(state)


def task_labels(question: Question) -> list[str]:
    """The question's labels in option order: the option names (noul: true / false), a score's level texts."""
    if question.type == "score":
        return [content_text(level) for level in question.descriptions]
    return list(question.options)


def task_tokens(question: Question) -> list[str]:
    """The question's schema tokens, as GLiNER2's processor writes a classification task."""
    prompt = question.name
    instructions = content_text(question.instructions)
    if instructions:
        prompt += f": {instructions}"
    labels = task_labels(question)
    if question.type != "score":
        for label, description in zip(labels, question.descriptions):
            if description is not None:
                prompt += f" {DESC_TOKEN} {label}: {content_text(description)}"
    tokens = ["(", P_TOKEN, prompt, "("]
    for label in labels:
        tokens += [L_TOKEN, label]
    return tokens + [")", ")"]


@dataclass(frozen=True)
class Gliner2Input:
    ids: list[int]
    marks: list[int]               # one per label, in question then label order: the tokens before its [L] + 1
    groups: list[int]              # labels of each question


def build_input(backend: Any, state: Any, questions: list[Question]) -> Gliner2Input:
    """Token ids of GLiNER2's classification input for ``questions`` about ``state``, and each label's mark."""
    ids: list[int] = []
    marks: list[int] = []
    encode = functools.lru_cache(maxsize=4096)(lambda s: tuple(backend.encode(s, add_special_tokens=False).ids))
    for qi, question in enumerate(questions):
        if qi:
            ids += encode(SEP_STRUCT)
        for index, token in enumerate(task_tokens(question)):
            if index >= 4 and index % 2 == 0 and token == L_TOKEN:
                marks.append(len(ids) + 1)     # the marker's first sub-token; a mark counts the tokens before it
            ids += encode(token)
    ids += encode(SEP_TEXT)
    for word in text_words(state_text(state)):
        ids += encode(word)
    return Gliner2Input(ids, marks, [len(task_labels(q)) for q in questions])


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    return [e / total for e in exps]


@dataclass
class Gliner2Decider:
    """System One questions answered by GLiNER2's classification head (colibri.decision.Decider)."""

    tokenizer: Any                 # colibri.tokenizer.TextTokenizer of the checkpoint

    def check(self, questions: Any) -> None:
        parse_questions(questions, LABELS)

    def decide(self, engine: Any, state: Any, questions: Any, *, slot: int = 0, ctx: int | None = None) -> Decision:
        parsed = parse_questions(questions, LABELS)
        encoded = build_input(self.tokenizer.backend, state, parsed)
        if ctx is not None and len(encoded.ids) > ctx:
            raise DecisionInputError("state", f"with its questions needs {len(encoded.ids)} tokens; the context holds "
                                     f"{ctx}", "shorten the state or ask fewer questions per request")
        result = engine.decide(encoded.ids, encoded.marks, [[0]] * len(encoded.marks), slot=slot).wait()
        answers: dict[str, dict[str, Any]] = {}
        start = 0
        for question, count in zip(parsed, encoded.groups):
            logits = [row[0] for row in result.scores[start:start + count]]
            start += count
            answers[question.name] = question.answer(softmax(logits))
        return Decision(answers, input_tokens=len(encoded.ids),
                        prefilled_tokens=int(result.stats.get("prefilled_tokens", len(encoded.ids))))
