"""JEV decision models (transformers' ``JevForDecision``): a Qwen3.5 dense text backbone (``qwen3_5_text``) and a
linear decision head ``proj`` [num_verbalizers, hidden] read at the token before each ``<|mark|>``, soft-capped;
the options of a question are scored by the head's rows from ``offsets[question type]`` on, in order.

Two checkpoint layouts, as transformers loads them:

- **saved** (``save_pretrained`` of a ``JevForDecision``): config.json ``model_type: jev`` with the backbone under
  ``text_config`` and ``num_verbalizers`` / ``offsets`` / ``softcap``; weights ``model.*`` and the head (``weight``,
  as transformers saves ``proj.weight``, or ``proj.weight``) with ``proj.bias``; the decision settings in
  ``decision.json`` / ``decision_template.jinja``.
- **head beside the LM**: a ``qwen3_5_text`` checkpoint with the head's files next to it: ``judge_config.json``
  (the head's slots: ``verbalizers``, ``num_slots``, per-type ``ranges``, ``softcap``), ``calibration.json``
  (``per_kind`` temperatures) and the head weights in ``head.safetensors`` (``proj.weight``, ``proj.bias``) or
  ``readout.safetensors`` (``weight``; no bias). Its decision settings come from those files: the verbalizers as
  labels, the calibration as temperatures, and the ``bare-v1`` prompt (:data:`JEV_TEMPLATE`).

The engine (``engine/jev.c``) runs the backbone with the head in place of the LM head, so its logits are the
head's soft-capped scores; :class:`JevDecider` asks the ``decide`` op for the rows ``offset + i``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from colibri import configs
from colibri.checkpoint import TensorIndex, default_shard_set
from colibri.decision import Decision, DecisionInputError, DecisionSettings, decide, load_settings, parse_questions
from colibri.decision.questions import Question
from colibri.engine_args import kv_bytes, rope_values, set_args
from colibri.errors import ConfigError
from colibri.records import Claim, EngineSource, Geometry, Limits, ResolvedModel, ShardSet, TensorLayout

MODEL_TYPE = "jev"
BACKBONES = ("qwen3_5_text",)             # what engine/jev.c runs under the head
HEAD_CONFIG = "judge_config.json"         # the head's own config (JevConfig.extra_config_files)
CALIBRATION = "calibration.json"
VLLM_CONFIG = "decision_config.json"      # vLLM decision models (pplx-decider, d3): another prompt family
HEAD_FILES = ("head.safetensors", "readout.safetensors")   # JevConfig.extra_files, in transformers' order
DEFAULT_OFFSETS = {"noul": 0, "score": 2, "choice": 8}
ENGINE_C = Path(__file__).parent / "engine" / "jev.c"
RUNTIME_API = 1
ENGINE_ROPE_TYPES = ("default", "linear", "llama3")
HEAD_CLAIM_PRIORITY = 1   # the head's files say more than config.json's model_type: this claim wins over an LM's

# The ``bare-v1`` prompt JEV reads (transformers' JEV_TEMPLATE renders the same text): the question's kind, the
# state, the instructions and one line per option (a choice as "label) option: description"), then the mark.
JEV_TEMPLATE = (
    "{%- macro content(v) -%}{%- if v is string -%}{{ v }}{%- elif v is not none -%}{{ v | tojson }}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro state_text(v) -%}"
    "{%- if v is string or v is mapping -%}{{ content(v) }}"
    "{%- else -%}{%- for part in v -%}"
    "{%- if part is mapping and part.get('type') == 'text' -%}{{ part['text'] }}{%- else -%}{{ content(part) }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- '[kind] ' ~ question.type ~ '\\n[state] ' ~ state_text(state) ~ '\\n[question] ' -}}"
    "{{- content(question.instructions) ~ '\\n[options]\\n' -}}"
    "{%- for option in question.options -%}"
    "{%- set description = question.descriptions[loop.index0] -%}"
    "{%- if question.type == 'choice' -%}{{- question.labels[loop.index0] ~ ') ' ~ option -}}"
    "{%- if description is not none and description != '' -%}{{- ': ' ~ content(description) -}}{%- endif -%}"
    "{%- else -%}{{- option -}}{%- endif -%}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '\\n[decision]:<|mark|>' -}}"
)


def _read_json(path: Path) -> Mapping[str, Any]:
    fix = "restore the file from the checkpoint"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})", fix) from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: not a JSON object", fix)
    return data


def head_file(model_dir: Path) -> Path | None:
    """The head weights shipped beside an LM's (the first of :data:`HEAD_FILES` present), else None."""
    return next((model_dir / f for f in HEAD_FILES if (model_dir / f).is_file()), None)


def detect(model_dir: Path, config: Mapping[str, Any] | None, family: str) -> Claim | None:
    """Claim a saved JEV checkpoint by its model_type, and an LM with a JEV head beside it by the head's files."""
    model_type = config.get("model_type") if config else None
    if model_type == MODEL_TYPE:
        return Claim(family, MODEL_TYPE, f"config.json model_type {MODEL_TYPE!r}")
    if config is None or not (model_dir / HEAD_CONFIG).is_file() or head_file(model_dir) is None:
        return None
    head = head_file(model_dir)
    assert head is not None
    return Claim(family, MODEL_TYPE, f"a JEV head beside the LM ({HEAD_CONFIG}, {head.name})",
                 priority=HEAD_CLAIM_PRIORITY)


@dataclass(frozen=True)
class Head:
    """The decision head as the engine and the decider need it."""

    rows: int                      # num_verbalizers
    offsets: Mapping[str, int]     # first row of each question type
    softcap: float | None
    weight: str                    # tensor names in the checkpoint
    bias: str | None
    beside: bool                   # the head-beside-the-LM layout


def is_beside(model: ResolvedModel) -> bool:
    return model.config.get("model_type") != MODEL_TYPE


def backbone(model: ResolvedModel) -> tuple[Mapping[str, Any], str]:
    """(the backbone's config, where it is) of either layout; refuses a backbone the engine does not run."""
    if is_beside(model):
        cfg, where = configs.text_config(model.config), str(model.path / "config.json")
    else:
        inner = model.config.get("text_config")
        where = f"{model.path / 'config.json'} (text_config)"
        if not isinstance(inner, Mapping):
            raise ConfigError(f"{model.path / 'config.json'}: no 'text_config' object",
                              "a jev checkpoint describes its backbone under text_config; restore config.json")
        cfg = inner
    kind = cfg.get("model_type")
    if kind not in BACKBONES:
        raise ConfigError(f"{where}: backbone model_type {kind!r} is not supported under a JEV head",
                          f"supported backbones: {', '.join(BACKBONES)}")
    return cfg, where


def extra_head_file(model: ResolvedModel) -> Path | None:
    """The head beside a sharded LM: a file its index does not name (the engine adds it to the index)."""
    shards = default_shard_set(model.path)
    head = head_file(model.path) if is_beside(model) else None
    return head if head is not None and shards is not None and head not in shards.files else None


def weight_files(model: ResolvedModel) -> tuple[ShardSet, ...]:
    shards = default_shard_set(model.path)
    if shards is None:
        raise ConfigError(f"{model.path}: no *.safetensors weights", "download the checkpoint's weights")
    extra = extra_head_file(model)
    return (shards,) if extra is None else (shards, ShardSet(model.path, (extra,)))


def _tensor_names(model: ResolvedModel) -> set[str]:
    return {t.name for t in TensorIndex(weight_files(model))}


def _slots(model: ResolvedModel) -> tuple[Mapping[str, Any], int, dict[str, int]]:
    """(judge_config.json, its num_slots, its per-type first rows) of the head-beside layout."""
    path = model.path / HEAD_CONFIG
    spec = _read_json(path)
    slots = spec.get("slots")
    ranges = slots.get("ranges") if isinstance(slots, Mapping) else None
    rows = slots.get("num_slots") if isinstance(slots, Mapping) else None
    if not isinstance(ranges, Mapping) or not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ConfigError(f"{path}: 'slots' needs 'num_slots' (a positive integer) and 'ranges' (type -> [start, end])",
                          "restore judge_config.json from the checkpoint")
    offsets = {}
    for kind, span in ranges.items():
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span)
                and 0 <= span[0] <= span[1] <= rows):
            raise ConfigError(f"{path}: slots.ranges.{kind} must be [start, end] within num_slots {rows}",
                              "restore judge_config.json from the checkpoint")
        offsets[str(kind)] = span[0]
    return spec, rows, offsets


def head(model: ResolvedModel) -> Head:
    names = _tensor_names(model)
    if is_beside(model):
        if (model.path / VLLM_CONFIG).is_file() and not (model.path / HEAD_CONFIG).is_file():
            raise ConfigError(f"{model.path / VLLM_CONFIG}: vLLM decision models are not supported by the jev "
                              "engine", f"a JEV head ships {HEAD_CONFIG} and {CALIBRATION}")
        spec, rows, offsets = _slots(model)
        softcap = spec.get("softcap")
        adapter = model.path / str(spec.get("adapter_subfolder", "adapter"))
        if adapter.is_dir():
            raise ConfigError(f"{adapter}: the backbone's LoRA is not merged into its weights",
                              "merge it (peft's merge_and_unload) and save the merged weights, then remove it")
    else:
        cfg, where = model.config, str(model.path / "config.json")
        rows = configs.require_int(cfg, "num_verbalizers", where=where, minimum=1)
        raw = cfg.get("offsets") or DEFAULT_OFFSETS
        if not isinstance(raw, Mapping) or not all(isinstance(v, int) and 0 <= v < rows for v in raw.values()):
            raise ConfigError(f"{where}: 'offsets' must map question types to rows below num_verbalizers {rows}",
                              'e.g. {"noul": 0, "score": 2, "choice": 8}')
        offsets, softcap = {str(k): int(v) for k, v in raw.items()}, cfg.get("softcap")
    if softcap is not None and (not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or softcap <= 0):
        raise ConfigError(f"{model.path}: softcap {softcap!r} must be a positive number or null",
                          "restore the head's config")
    weight = next((n for n in ("proj.weight", "weight") if n in names), None)
    if weight is None:
        raise ConfigError(f"{model.path}: no decision head weight (proj.weight or weight) in the safetensors files",
                          f"restore the head weights ({' or '.join(HEAD_FILES)} beside an LM)")
    return Head(rows, offsets, float(softcap) if softcap is not None else None, weight,
                "proj.bias" if "proj.bias" in names else None, is_beside(model))


def geometry(model: ResolvedModel) -> Geometry:
    cfg, where = backbone(model)
    h = head(model)
    r = _hybrid(cfg, where)
    full = [i for i, kind in enumerate(r["attn"]) if kind == "full_attention"]
    linear = r["layers"] - len(full)
    conv_dim = 2 * r["lin_k_heads"] * r["lin_k_dim"] + r["lin_v_heads"] * r["lin_v_dim"]
    per_layer = kv_bytes(conv_dim * (r["conv_kernel"] - 1) + r["lin_v_heads"] * r["lin_k_dim"] * r["lin_v_dim"])
    state = 2 * per_layer * linear   # x 2: the end-of-state checkpoint a pinned decision restores
    notes = (("head", f"{h.rows} verbalizers, offsets {dict(h.offsets)}, softcap {h.softcap}"),
             ("layout", "head beside the LM" if h.beside else "saved jev checkpoint"),
             ("layers", f"{linear} Gated DeltaNet + {len(full)} full attention, dense MLP"))
    return Geometry(
        model_type=MODEL_TYPE, architecture="JEV decision model (Qwen3.5 dense hybrid + linear head)",
        attention="Gated DeltaNet (linear) + gated GQA with q/k norm", num_layers=r["layers"],
        hidden_size=r["hidden"], vocab_size=r["vocab"], num_heads=r["heads"], num_kv_heads=r["kv_heads"],
        head_dim=r["head_dim"], dense_layers=tuple(range(r["layers"])), max_context=configs.max_context(cfg),
        kv_bytes_per_token=kv_bytes(len(full) * 2 * r["kv_heads"] * r["head_dim"]), state_bytes_per_slot=state,
        notes=notes,
    )


def _hybrid(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    hidden = configs.require_int(cfg, "hidden_size", where=where, minimum=1)
    heads = configs.require_int(cfg, "num_attention_heads", where=where, minimum=1)
    n = configs.require_int(cfg, "num_hidden_layers", where=where, minimum=1)
    return dict(
        layers=n, hidden=hidden, heads=heads, vocab=configs.require_int(cfg, "vocab_size", where=where, minimum=1),
        kv_heads=configs.optional_int(cfg, "num_key_value_heads", default=heads, where=where),
        head_dim=configs.optional_int(cfg, "head_dim", default=hidden // heads, where=where),
        inter=configs.require_int(cfg, "intermediate_size", where=where, minimum=1),
        attn=configs.attention_layer_types(cfg, n, default_interval=4, where=where),
        lin_k_heads=configs.require_int(cfg, "linear_num_key_heads", where=where, minimum=1),
        lin_v_heads=configs.require_int(cfg, "linear_num_value_heads", where=where, minimum=1),
        lin_k_dim=configs.require_int(cfg, "linear_key_head_dim", where=where, minimum=1),
        lin_v_dim=configs.require_int(cfg, "linear_value_head_dim", where=where, minimum=1),
        conv_kernel=configs.optional_int(cfg, "linear_conv_kernel_dim", default=4, where=where),
    )


def layout(model: ResolvedModel) -> TensorLayout:
    cfg, where = backbone(model)
    h = head(model)
    r = _hybrid(cfg, where)
    base = "model."
    norms, required = [base + "norm.weight"], [h.weight] + ([h.bias] if h.bias else [])
    for i, kind in enumerate(r["attn"]):
        p = f"{base}layers.{i}."
        norms += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if kind == "full_attention":
            sa = p + "self_attn."
            norms += [sa + "q_norm.weight", sa + "k_norm.weight"]
            required += [f"{sa}{x}_proj.weight" for x in "qkvo"]
        else:
            la = p + "linear_attn."
            norms.append(la + "norm.weight")
            required += [la + t for t in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight",
                                          "in_proj_b.weight", "conv1d.weight", "A_log", "dt_bias", "out_proj.weight")]
        required += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    # Beside a language model its own head is stored but not a parameter of the decision model (transformers'
    # JevForDecision has none): a buffer, counted in bytes only. Multi-token prediction layers are never read.
    saved = (model.config or {}).get("model_type") == MODEL_TYPE   # else a JEV head beside an LM
    lm_head = () if saved or cfg.get("tie_word_embeddings") else ("lm_head.weight",)
    return TensorLayout(embeddings=(base + "embed_tokens.weight",), lm_head=None, norms=tuple(norms), routers=(),
                        experts=(), required=tuple(required), skipped_prefixes=("mtp.",), buffers=lm_head)


def limits(model: ResolvedModel) -> Limits:
    return Limits(max_context=configs.max_context(backbone(model)[0]), has_engine=True)


def engine_source() -> EngineSource:
    return EngineSource(name="colibri-jev", sources=(ENGINE_C,), runtime_api=RUNTIME_API)


def engine_args(model: ResolvedModel) -> tuple[str, ...]:
    """The ``--set`` arguments of engine/jev.c: the backbone's hybrid geometry and the head."""
    cfg, where = backbone(model)
    h = head(model)
    r = _hybrid(cfg, where)
    unknown = sorted({k for k in r["attn"] if k not in ("full_attention", "linear_attention")})
    if unknown:
        raise ConfigError(f"{where}: layer_types has {', '.join(map(repr, unknown))}",
                          "expected full_attention or linear_attention")
    if cfg.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is not supported by the jev engine", "use attention_bias false")
    rope = configs.rope(cfg, default_partial=0.25)
    values: dict[str, Any] = dict(
        hidden_size=r["hidden"], num_hidden_layers=r["layers"], num_attention_heads=r["heads"],
        num_key_value_heads=r["kv_heads"], head_dim=r["head_dim"], vocab_size=r["vocab"],
        intermediate_size=r["inter"], rms_norm_eps=repr(float(cfg.get("rms_norm_eps", 1e-6))),
        qk_norm=1, zero_centered_norm=1, attn_output_gate=1,
        layer_types=",".join(r["attn"]), decision_head_rows=h.rows, decision_head_weight=h.weight,
        **rope_values(cfg, rope, where, MODEL_TYPE, ENGINE_ROPE_TYPES),
    )
    if h.bias:
        values["decision_head_bias"] = h.bias
    extra = extra_head_file(model)
    if extra is not None:
        values["decision_head_file"] = extra.name
    if h.softcap is not None:
        values["logit_softcap"] = repr(h.softcap)
    if "linear_attention" in r["attn"]:
        values.update(linear_projection="split", linear_num_key_heads=r["lin_k_heads"],
                      linear_num_value_heads=r["lin_v_heads"], linear_key_head_dim=r["lin_k_dim"],
                      linear_value_head_dim=r["lin_v_dim"], linear_conv_kernel_dim=r["conv_kernel"])
    return set_args(values)


def settings(model: ResolvedModel) -> DecisionSettings:
    """The decision settings transformers uses: decision.json for a saved checkpoint; the head's files (labels,
    calibrated temperatures, the bare-v1 prompt) for a head beside an LM."""
    if not is_beside(model):
        return load_settings(model.path)
    spec, _, _ = _slots(model)
    path = model.path / CALIBRATION
    per_kind = _read_json(path).get("per_kind")
    if not isinstance(per_kind, Mapping) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in per_kind.values()):
        raise ConfigError(f"{path}: 'per_kind' must map question types to positive temperatures",
                          "restore calibration.json from the checkpoint")
    verbalizers = spec["slots"].get("verbalizers")
    if not isinstance(verbalizers, list) or not all(isinstance(v, str) for v in verbalizers):
        raise ConfigError(f"{model.path / HEAD_CONFIG}: slots.verbalizers must be a list of strings",
                          "restore judge_config.json from the checkpoint")
    labels = {kind: verbalizers[start:end] for kind, (start, end) in spec["slots"]["ranges"].items()}
    return DecisionSettings(labels=labels, temperature={k: float(v) for k, v in per_kind.items()},
                            template=JEV_TEMPLATE, noul_options=("false", "true"))


@dataclass
class JevDecider:
    """Scores each question's options by the head's rows from its type's offset (the engine's logits)."""

    tokenizer: Any
    settings: DecisionSettings
    head: Head

    def option_ids(self, question: Question) -> list[int]:
        start = self.head.offsets.get(question.type, 0)
        return list(range(start, start + len(question.options)))

    def check(self, questions: Any) -> None:
        for q in parse_questions(questions, self.settings.labels, self.settings.noul_options):
            room = self.head.rows - self.head.offsets.get(q.type, 0)
            if len(q.options) > room:
                raise DecisionInputError(f"questions.{q.name}.criteria", f"this model's head scores at most {room} "
                                         f"options of a {q.type} question, got {len(q.options)}",
                                         "ask with fewer options")

    def decide(self, engine: Any, state: Any, questions: Any, *, slot: int = 0, ctx: int | None = None) -> Decision:
        self.check(questions)
        return decide(engine, self.tokenizer, self.settings, state, questions, slot=slot, ctx=ctx,
                      option_ids=self.option_ids)


def decider(model: ResolvedModel, tokenizer: Any) -> JevDecider:
    if tokenizer is None:
        from colibri import hooks

        tokenizer = hooks.load_tokenizer(model)
    return JevDecider(tokenizer, settings(model), head(model))
