"""Laya checkpoints (the ``laya`` package's System 1 decision models): their engine's hyperparameters, their
tokenizer, and how they answer System One questions.

A Laya model reads one sequence per question, ``[CLS] <type> question: <instructions> [SEP] [MASK] option ...
[SEP] <state> [SEP]`` (laya.common.build_sequence), scores each option at its ``[MASK]`` with the decision head
under the question's type, and turns the scores into probabilities with the checkpoint's calibrated temperature
(laya.agent.Agent._decode_answers). System One's three types are laya's own: ``choice`` (type 0), ``score``
(type 1, levels ``level i: ...``), ``noul`` (type 2, options false then true). This module builds the same
sequences with the same truncation rules, sends each to the engine's ``decide`` op (marks: the ``[MASK]``
positions; option: the question type) and answers with :meth:`colibri.decision.Question.answer`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from colibri import configs
from colibri.decision import Decision, DecisionInputError, Question, parse_questions
from colibri.decision.scoring import probabilities
from colibri.engine_args import set_args
from colibri.errors import ConfigError
from colibri.records import ResolvedModel
from colibri.tokenizer import TextTokenizer, load_tokenizer_dir

MARKER = "rl_agent_config.json"      # what laya.Agent itself requires of a checkpoint directory
QTYPES = {"choice": 0, "score": 1, "noul": 2}
TEMP_MIN, TEMP_MAX = 0.5, 5.0        # laya.common.clamp_temperature: sharper or flatter fits are not applied
MAX_OPTIONS = 255                    # the head's option-count feature is k / 255
OPTION_TOKENS = 48                   # each option's text is cut at 48 tokens (laya.common.build_head)
NOUL_OPTIONS = ("false", "true")     # laya's noul slot order
NOUL_DEFAULTS = ("no, the statement does not hold", "yes, the statement holds")
FIX = "a Laya checkpoint ships rl_agent_config.json and encoder/config.json with its model.safetensors"


def read_json(path: Path, fix: str = FIX) -> Mapping[str, Any]:
    """A JSON object file of the checkpoint; a missing or broken one is a ConfigError naming it, with ``fix``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing", fix) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})", fix) from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: not a JSON object", fix)
    return data


def int_or(config: Mapping[str, Any], name: str, default: int, where: str, minimum: int = 0) -> int:
    """An optional bounded integer field (absent or null: ``default``)."""
    if config.get(name) is None:
        return default
    return configs.require_int(config, name, where=where, minimum=minimum)


def clamp_temperature(value: Any) -> float:
    """A usable temperature, as laya applies it: confined to [0.5, 5], 1 when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 1.0
    return min(TEMP_MAX, max(TEMP_MIN, float(value)))


@dataclass(frozen=True)
class AgentConfig:
    """What rl_agent_config.json says about reading a question: the sequence budget and the temperatures."""

    max_len: int = 512
    head_max_len: int = 192
    temperature: tuple[float, float, float] = (1.0, 1.0, 1.0)          # by type: choice, score, noul
    by_options: dict[str, float] = field(default_factory=dict)         # "choice:3-5" -> temperature

    def temperature_of(self, kind: str, n_options: int) -> float:
        size = "2" if n_options <= 2 else "3-5" if n_options <= 5 else "6-10" if n_options <= 10 else "11+"
        return self.by_options.get(f"{kind}:{size}", self.temperature[QTYPES[kind]])


def agent_config(model_dir: Path) -> AgentConfig:
    path = model_dir / MARKER
    raw = read_json(path)
    where = str(path)
    temps = raw.get("temperature", [1.0, 1.0, 1.0])
    if not isinstance(temps, list) or len(temps) != 3:
        raise ConfigError(f"{where}: 'temperature' must be a list of 3 numbers (choice, score, noul)", FIX)
    by_options = raw.get("temperature_by_options") or {}
    if not isinstance(by_options, Mapping):
        raise ConfigError(f"{where}: 'temperature_by_options' must map buckets to numbers", FIX)
    layout = raw.get("option_layout", "sequential")
    if layout != "sequential":
        raise ConfigError(f"{where}: option_layout {layout!r} is not supported by the Laya engine",
                          "it runs the sequential option layout every published Laya checkpoint uses")
    t = tuple(clamp_temperature(v) for v in temps)
    return AgentConfig(max_len=int_or(raw, "max_len", 512, where, minimum=4),
                       head_max_len=int_or(raw, "head_max_len", 192, where, minimum=1),
                       temperature=(t[0], t[1], t[2]),
                       by_options={str(k): clamp_temperature(v) for k, v in by_options.items()})


def encoder_config(model: ResolvedModel) -> tuple[Mapping[str, Any], str]:
    path = model.path / "encoder" / "config.json"
    return read_json(path), str(path)


def layer_kinds(enc: Mapping[str, Any], layers: int, where: str) -> str:
    """F (full attention) or S (sliding window) per layer: ``layer_types``, else every
    ``global_attn_every_n_layers``-th layer global (ModernBERT's rule, default 3)."""
    kinds = enc.get("layer_types")
    if kinds is None:
        every = int_or(enc, "global_attn_every_n_layers", 3, where, minimum=1)
        return "".join("S" if i % every else "F" for i in range(layers))
    words = {"full_attention": "F", "sliding_attention": "S"}
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in words for k in kinds):
        raise ConfigError(f"{where}: 'layer_types' must list full_attention / sliding_attention for each of the "
                          f"{layers} layers", FIX)
    return "".join(words[k] for k in kinds)


def rope_thetas(enc: Mapping[str, Any], where: str) -> tuple[float, float]:
    """(global, local) RoPE theta: transformers 5's ``rope_parameters`` per layer type, else the 4.x fields."""
    thetas = [configs.require_number(enc, "global_rope_theta", 160000.0, where=where),
              configs.require_number(enc, "local_rope_theta", 10000.0, where=where)]
    rope = enc.get("rope_parameters")
    if isinstance(rope, Mapping):
        for i, kind in enumerate(("full_attention", "sliding_attention")):
            params = rope.get(kind, rope)
            if isinstance(params, Mapping):
                if params.get("rope_type", "default") != "default":
                    raise ConfigError(f"{where}: rope_parameters.{kind}.rope_type {params['rope_type']!r} is not "
                                      "supported by the Laya engine", "it implements the default RoPE")
                thetas[i] = configs.require_number(params, "rope_theta", thetas[i], where=f"{where} ({kind})")
    return thetas[0], thetas[1]


def engine_hparams(model: ResolvedModel) -> tuple[str, ...]:
    """The ``--set key=value`` arguments of the Laya engine, from encoder/config.json and rl_agent_config.json."""
    enc, where = encoder_config(model)
    agent = read_json(model.path / MARKER)
    hidden = configs.require_int(enc, "hidden_size", where=where, minimum=2)
    layers = configs.require_int(enc, "num_hidden_layers", where=where, minimum=1)
    activation = enc.get("hidden_activation", "gelu")
    if activation != "gelu":
        raise ConfigError(f"{where}: hidden_activation {activation!r} is not supported by the Laya engine",
                          "it implements gelu (the exact GELU ModernBERT uses)")
    global_theta, local_theta = rope_thetas(enc, where)
    head_layers = int_or(agent, "head_layers", 2, str(model.path / MARKER), minimum=0)
    return set_args({
        "hidden_size": hidden, "num_hidden_layers": layers,
        "vocab_size": configs.require_int(enc, "vocab_size", where=where, minimum=1),
        "num_attention_heads": configs.require_int(enc, "num_attention_heads", where=where, minimum=1),
        "intermediate_size": configs.require_int(enc, "intermediate_size", where=where, minimum=1),
        "norm_eps": configs.require_number(enc, "norm_eps", 1e-5, where=where),
        "norm_bias": int(bool(enc.get("norm_bias", False))),
        "attention_bias": int(bool(enc.get("attention_bias", False))),
        "mlp_bias": int(bool(enc.get("mlp_bias", False))),
        "layer_types": layer_kinds(enc, layers, where),
        # ModernBERT's window is local_attention in all: a token sees local_attention // 2 on each side
        "sliding_window": int_or(enc, "local_attention", 128, where, minimum=0) // 2,
        "global_rope_theta": repr(global_theta), "local_rope_theta": repr(local_theta),
        "head_layers": head_layers, "head_heads": max(1, hidden // 64),   # laya: nhead = max(1, d // 64)
    })


def load_tokenizer(model: ResolvedModel) -> TextTokenizer:
    """The checkpoint's ``tokenizer/`` (a ModernBERT tokenizer), which needs [CLS], [SEP] and [MASK]."""
    tok = load_tokenizer_dir(model.path / "tokenizer", None)
    for name in ("cls_token", "sep_token", "mask_token"):
        text = tok.special_tokens.get(name)
        if text is None or tok.backend.token_to_id(text) is None:
            raise ConfigError(f"{model.path / 'tokenizer' / 'tokenizer_config.json'}: no {name}",
                              "a Laya checkpoint's tokenizer names its [CLS], [SEP] and [MASK] tokens")
    return tok


def render_criterion(value: Any) -> str:
    """A criterion as laya prints it: a string as is, anything else as one-line JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)


def option_texts(q: Question) -> list[str]:
    """laya.common.render_options: the options' texts in slot order (a noul's false first)."""
    if q.type == "choice":
        return [o if d is None or d == "" else f"{o}: {render_criterion(d)}" for o, d in zip(q.options, q.descriptions)]
    if q.type == "score":
        return [f"level {i}: {render_criterion(d)}" for i, d in enumerate(q.descriptions)]
    described = dict(zip(q.options, q.descriptions))
    return [f"{option}: " + (render_criterion(described[option]) if described[option] not in (None, "") else default)
            for option, default in zip(NOUL_OPTIONS, NOUL_DEFAULTS)]


@dataclass(frozen=True)
class LayaPrompt:
    ids: list[int]
    markers: list[int]          # the [MASK] position of each option
    question: Question


@dataclass
class LayaDecider:
    """System One questions on a Laya checkpoint (the ``decider`` hook's answer for ``model_type`` laya)."""

    tokenizer: TextTokenizer
    config: AgentConfig
    cuts_state: ClassVar[bool] = True     # laya cuts a long state to fit max_len: the server must not refuse it

    def _special(self, name: str) -> tuple[str, int]:
        text = self.tokenizer.special_tokens[name]
        return text, int(self.tokenizer.backend.token_to_id(text))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text.replace(self._special("mask_token")[0], " "), add_special_tokens=False)

    def check(self, questions: Any) -> list[Question]:
        labels = {kind: [str(i) for i in range(MAX_OPTIONS)] for kind in ("choice", "score")}
        parsed = parse_questions(questions, labels, NOUL_OPTIONS)
        for q in parsed:
            if q.instructions is None or (isinstance(q.instructions, (str, list, dict)) and not q.instructions) or \
                    (isinstance(q.instructions, str) and not q.instructions.strip()):
                raise DecisionInputError(f"questions.{q.name}.instructions", "a Laya model needs the question's text",
                                         "add the text the model should answer")
        return parsed

    def _head(self, q: Question) -> tuple[list[int], list[int]]:
        """laya.common.build_head: ``[CLS] <type> question: <instructions> [SEP] [MASK] opt ... [SEP]``."""
        _, mask = self._special("mask_token")
        _, cls = self._special("cls_token")
        _, sep = self._special("sep_token")
        text = q.instructions if isinstance(q.instructions, str) else json.dumps(q.instructions, ensure_ascii=False)
        head = self._encode(f"{q.type} question: {text}")
        options = [[mask] + self._encode(" " + option)[:OPTION_TOKENS] for option in option_texts(q)]
        budget = self.config.head_max_len - sum(map(len, options))
        if budget < 16:    # many or long options: each keeps an equal share
            per = max(4, (self.config.head_max_len - 16) // max(1, len(options)))
            options = [o[:per] for o in options]
            budget = self.config.head_max_len - sum(map(len, options))
        ids = [cls] + head[:max(8, budget)] + [sep]
        markers = []
        for option in options:
            markers.append(len(ids))
            ids += option
        return ids + [sep], markers

    def prompts(self, state: Any, questions: Sequence[Question]) -> list[LayaPrompt]:
        """One sequence per question, the state cut to what fits in max_len (its start kept, or its end for a
        list, a conversation whose newest turn matters most), as laya.common.build_sequence cuts it."""
        _, sep = self._special("sep_token")
        state_ids = self._encode(state if isinstance(state, str) else json.dumps(state, ensure_ascii=False))
        max_len = self.config.max_len
        out = []
        for q in questions:
            ids, markers = self._head(q)
            room = max(0, max_len - len(ids) - 1)
            kept = state_ids[max(0, len(state_ids) - room):] if isinstance(state, list) else state_ids[:room]
            ids = (ids + kept + [sep])[:max_len]
            if markers and markers[-1] >= max_len:
                fit = sum(m < max_len for m in markers)
                raise DecisionInputError(f"questions.{q.name}.criteria", f"only {fit} of its {len(markers)} options "
                                         f"fit in this model's {max_len} tokens", "use fewer or shorter options")
            out.append(LayaPrompt(ids, markers, q))
        return out

    def decide(self, engine: Any, state: Any, questions: Any, *, slot: int = 0, ctx: int | None = None) -> Decision:
        prompts = self.prompts(state, self.check(questions))
        longest = max(len(p.ids) for p in prompts)
        if ctx is not None and longest > ctx:
            raise DecisionInputError("state", f"the state and a question take {longest} tokens; the context holds "
                                     f"{ctx}", f"start the engine with --ctx {self.config.max_len}")
        decision = Decision({})
        for p in prompts:
            kind = QTYPES[p.question.type]
            result = engine.decide(p.ids, [m + 1 for m in p.markers], [[kind]] * len(p.markers), slot=slot).wait()
            scores = [row[0] for row in result.scores]
            t = self.config.temperature_of(p.question.type, len(scores))
            decision.answers[p.question.name] = p.question.answer(probabilities(scores, t))
            decision.input_tokens += len(p.ids)
            decision.prefilled_tokens += int(result.stats.get("prefilled_tokens", len(p.ids)))
        return decision


def decider(model: ResolvedModel, tokenizer: TextTokenizer | None) -> LayaDecider:
    return LayaDecider(tokenizer or load_tokenizer(model), agent_config(model.path))
