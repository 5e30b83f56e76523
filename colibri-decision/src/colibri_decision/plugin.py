"""colibri family plugin for decision checkpoints: JEV decision models (``model_type: jev``, or a JEV head beside a
Qwen3.5 checkpoint: see :mod:`.jev`), GLiNER2-style extractors (``model_type: extractor``) and Laya
checkpoints (claimed by their marker file ``rl_agent_config.json``: a ModernBERT encoder under ``encoder/`` and
``encoder.*`` weights, a typed decision head ``head.*``, ``type_emb``, ``scorer``, ``act_head``; engine
``engine/laya.c``, everything else Laya-specific in :mod:`colibri_decision.laya`).

An extractor is a bidirectional encoder (BERT or DeBERTa-v2, described by ``encoder_config``) whose weights sit
under ``encoder.`` in ``model.safetensors``, followed by small heads (span representation, classifier, count
predictor) that answer typed questions — which spans are entities of a label, which label a text has — with
probabilities. There are no experts and no KV cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from colibri import configs, hookimpl, hooks
from colibri.checkpoint import TensorIndex, default_shard_set
from colibri.errors import ConfigError
from colibri.records import (
    Claim, EngineEnv, EngineSource, FamilyDescriptor, Geometry, Limits, ResolvedModel, ResourcePlan, ShardSet,
    TensorLayout,
)

from . import gliner2, jev, laya

FAMILY = "decision"
MODEL_TYPES = ("extractor", "laya", "jev")
LAYA_MARKER = laya.MARKER
LAYA_HEAD_PREFIXES = ("encoder.", "type_emb.", "scorer.", "act_head.")
ENCODER_PREFIX = "encoder."
ENCODER_TYPES = ("bert", "deberta-v2", "deberta_v2")


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, MODEL_TYPES,
                            "decision checkpoints: GLiNER2-style extractors and Laya (encoder + decision heads)")


@hookimpl
def detect_config(model_dir: Path, config: Mapping[str, Any] | None) -> Claim | None:
    claim = jev.detect(model_dir, config, FAMILY)
    if claim is not None:
        return claim
    model_type = config.get("model_type") if config else None
    if model_type == "extractor":
        return Claim(FAMILY, model_type, f"config.json model_type {model_type!r}")
    if (model_dir / LAYA_MARKER).is_file():
        return Claim(FAMILY, "laya", f"{LAYA_MARKER} (a Laya checkpoint)")
    return None


_read_json = laya.read_json


def _laya(model: ResolvedModel) -> tuple[Mapping[str, Any], Mapping[str, Any], str]:
    """(rl_agent_config.json, the encoder's config, where it is) of a Laya checkpoint."""
    fix = "a Laya checkpoint ships rl_agent_config.json and encoder/config.json with its model.safetensors"
    agent = _read_json(model.path / LAYA_MARKER, fix)
    where = str(model.path / "encoder" / "config.json")
    enc = _read_json(model.path / "encoder" / "config.json", fix)
    if "head_layers" not in agent:
        raise ConfigError(f"{model.path / LAYA_MARKER}: no 'head_layers'", fix)
    return agent, enc, where


def _laya_geometry(model: ResolvedModel) -> Geometry:
    agent, enc, where = _laya(model)
    hidden = configs.require_int(enc, "hidden_size", where=where, minimum=1)
    heads = configs.require_int(enc, "num_attention_heads", where=where, minimum=1)
    return Geometry(
        model_type="laya", architecture=f"Laya ({enc.get('model_type', 'modernbert')} encoder + decision head)",
        attention="bidirectional encoder", num_layers=configs.require_int(enc, "num_hidden_layers", where=where,
                                                                          minimum=1),
        hidden_size=hidden, vocab_size=configs.require_int(enc, "vocab_size", where=where, minimum=1),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, max_context=configs.max_context(enc),
        notes=(("encoder", str(agent.get("encoder", "?"))), ("head layers", str(agent.get("head_layers"))))
    )


def _shard_names(model: ResolvedModel) -> list[str]:
    shards = default_shard_set(model.path)
    if shards is None:
        raise ConfigError(f"{model.path}: no *.safetensors weights", "download the checkpoint's model.safetensors")
    return sorted(t.name for t in TensorIndex((shards,)))


def _laya_layout(model: ResolvedModel) -> TensorLayout:
    _laya(model)
    names = _shard_names(model)
    missing = [p for p in LAYA_HEAD_PREFIXES if not any(n.startswith(p) for n in names)]
    if missing:
        raise ConfigError(f"{model.path / 'model.safetensors'}: no {missing[0]}* tensors",
                          "a Laya checkpoint holds its encoder and its decision heads; restore model.safetensors")
    embeddings = tuple(n for n in names if n.startswith("encoder.embeddings.") and n.endswith("embeddings.weight"))
    norms = tuple(n for n in names if "norm" in n.lower() and n.endswith(".weight"))
    return TensorLayout(embeddings=embeddings, lm_head=None, norms=norms, routers=(), experts=(),
                        required=tuple(n for n in names if n not in embeddings and n not in norms))


def _encoder(model: ResolvedModel) -> tuple[Mapping[str, Any], str, str]:
    """(the encoder's config, where it was read, its kind): an ``encoder_config`` object inside config.json, else
    ``encoder_config/config.json`` as GLiNER2's own ``save_pretrained`` writes it."""
    enc = model.config.get("encoder_config")
    where = f"{model.path / 'config.json'} (encoder_config)"
    if not isinstance(enc, Mapping):
        path = model.path / gliner2.ENCODER_DIR / "config.json"
        fix = "an extractor checkpoint describes its encoder in encoder_config/config.json (what GLiNER2 saves)"
        if not path.is_file():
            raise ConfigError(f"{model.path / 'config.json'}: no 'encoder_config' object and no {path}", fix)
        enc, where = _read_json(path, fix), str(path)
    kind = str(enc.get("model_type") or "bert")
    if kind not in ENCODER_TYPES:
        raise ConfigError(f"{where}: encoder model_type {kind!r} is not supported",
                          f"supported encoders: {', '.join(ENCODER_TYPES[:2])}")
    return enc, where, kind.replace("_", "-")


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
    if model.model_type == jev.MODEL_TYPE:
        return jev.geometry(model)
    if model.model_type == "laya":
        return _laya_geometry(model)
    enc, where, kind = _encoder(model)
    cfg = model.config
    notes = [("encoder", kind), ("max span width", str(cfg.get("max_width", "?")))]
    if cfg.get("counting_layer"):
        notes.append(("counting layer", str(cfg["counting_layer"])))
    hidden = configs.require_int(enc, "hidden_size", where=where, minimum=1)
    heads = configs.require_int(enc, "num_attention_heads", where=where, minimum=1)
    return Geometry(
        model_type=model.model_type, architecture=f"GLiNER2-style extractor ({kind} encoder)",
        attention="bidirectional encoder" + (" (relative positions)" if enc.get("relative_attention") else ""),
        num_layers=configs.require_int(enc, "num_hidden_layers", where=where, minimum=1), hidden_size=hidden,
        vocab_size=configs.require_int(enc, "vocab_size", where=where, minimum=1), num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, max_context=configs.max_context(enc), notes=tuple(notes),
    )


def encoder_tensors(enc: Mapping[str, Any], kind: str, where: str) -> tuple[list[str], list[str], list[str]]:
    """(embeddings, norms, other) tensor names of the encoder, from its config, without the ``encoder.`` prefix."""
    n = configs.require_int(enc, "num_hidden_layers", where=where, minimum=1)
    e = "embeddings."
    embeddings = [e + "word_embeddings.weight"]
    norms = [e + "LayerNorm.weight"]
    other = [e + "LayerNorm.bias"]
    deberta = kind == "deberta-v2"
    if enc.get("position_biased_input", True) and enc.get("max_position_embeddings", 0) > 0:
        other.append(e + "position_embeddings.weight")
    if int(enc.get("type_vocab_size", 0 if deberta else 2)) > 0:
        other.append(e + "token_type_embeddings.weight")
    if deberta and enc.get("embedding_size", enc.get("hidden_size")) != enc.get("hidden_size"):
        other.append(e + "embed_proj.weight")
    qkv = ("query_proj", "key_proj", "value_proj") if deberta else ("query", "key", "value")
    for i in range(n):
        p = f"encoder.layer.{i}."
        for proj in qkv:
            other += [f"{p}attention.self.{proj}.weight", f"{p}attention.self.{proj}.bias"]
        for dense in ("attention.output.dense", "intermediate.dense", "output.dense"):
            other += [f"{p}{dense}.weight", f"{p}{dense}.bias"]
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            norms.append(f"{p}{ln}.weight")
            other.append(f"{p}{ln}.bias")
    if deberta and enc.get("relative_attention"):
        other.append("encoder.rel_embeddings.weight")
        if "layer_norm" in str(enc.get("norm_rel_ebd", "none")):
            norms.append("encoder.LayerNorm.weight")
            other.append("encoder.LayerNorm.bias")
    return embeddings, norms, other


@hookimpl
def tensor_layout(model: ResolvedModel) -> TensorLayout:
    if model.model_type == jev.MODEL_TYPE:
        return jev.layout(model)
    if model.model_type == "laya":
        return _laya_layout(model)
    enc, where, kind = _encoder(model)
    embeddings, norms, other = encoder_tensors(enc, kind, where)
    prefixed = [ENCODER_PREFIX + n for n in other]
    # The heads' shapes and count depend on the extractor version, not on config.json: take them from the shard
    # headers (names only; no weight bytes are read).
    heads = [name for name in _shard_names(model) if not name.startswith(ENCODER_PREFIX)]
    return TensorLayout(embeddings=tuple(ENCODER_PREFIX + n for n in embeddings), lm_head=None,
                        norms=tuple(ENCODER_PREFIX + n for n in norms), routers=(), experts=(),
                        required=tuple(prefixed + heads))


RUNTIME_API = 1   # the colibri runtime C API the engine sources are written for (CB_RUNTIME_API, runtime/api.h)
ENGINE_DIR = Path(__file__).parent / "engine"


def encoder_engine(source: Path) -> EngineSource:
    """A decide-only encoder engine (Laya, GLiNER2): a ``cb_family`` with a ``decide`` call and no ``forward``,
    run by the runtime's one engine process like every other (docs/protocol.md, "Encoder engines")."""
    return EngineSource(name=f"colibri-{source.stem}", sources=(source,), runtime_api=RUNTIME_API)


LAYA_ENGINE = encoder_engine(ENGINE_DIR / "laya.c")


def _gliner2_engine(model: ResolvedModel) -> EngineSource | None:
    """The GLiNER2 engine, for the extractors it runs (a DeBERTa-v2/v3 encoder; see gliner2.engine_problem)."""
    enc, _, _ = _encoder(model)
    return None if gliner2.engine_problem(enc) else encoder_engine(gliner2.ENGINE)


def _gliner2_env(model: ResolvedModel) -> tuple[str, ...]:
    enc, where, _ = _encoder(model)
    return tuple(gliner2.engine_hparams(enc, where))


def _gliner2_decider(model: ResolvedModel, tokenizer: Any) -> Any:
    return gliner2.Gliner2Decider(tokenizer if tokenizer is not None else hooks.load_tokenizer(model))


# model type -> its engine (each a recipe over the shared runtime; None when this checkpoint has none), how the
# engine is configured, who answers its System One questions (absent: core's default, label tokens' logits)
ENGINES = {
    jev.MODEL_TYPE: lambda model: jev.engine_source(),
    "laya": lambda model: LAYA_ENGINE,
    "extractor": _gliner2_engine,
}
ENGINE_ARGS = {jev.MODEL_TYPE: jev.engine_args, "laya": laya.engine_hparams, "extractor": _gliner2_env}
TOKENIZERS = {"laya": laya.load_tokenizer}
DECIDERS = {jev.MODEL_TYPE: jev.decider, "laya": laya.decider, "extractor": _gliner2_decider}


@hookimpl
def engine_source(model: ResolvedModel | None) -> EngineSource | None:
    if model is None:   # the family's main engine (coli build decision)
        return jev.engine_source()
    source = ENGINES.get(model.model_type)
    return source(model) if source else None


@hookimpl
def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv | None:
    args = ENGINE_ARGS.get(model.model_type)
    return EngineEnv(args=tuple(args(model))) if args else None


@hookimpl
def load_tokenizer(model: ResolvedModel) -> Any:
    load = TOKENIZERS.get(model.model_type)
    return load(model) if load else None


@hookimpl
def decider(model: ResolvedModel, tokenizer: Any) -> Any:
    make = DECIDERS.get(model.model_type)
    return make(model, tokenizer) if make else None


@hookimpl
def limits(model: ResolvedModel) -> Limits:
    if model.model_type == jev.MODEL_TYPE:
        return jev.limits(model)
    if model.model_type == "laya":
        _, enc, _ = _laya(model)
        # a Laya sequence never exceeds the checkpoint's max_len (laya cuts the state to fit)
        bound = min(laya.agent_config(model.path).max_len, configs.max_context(enc) or 1 << 30)
        return Limits(max_context=bound, has_engine=engine_source(model) is not None)
    enc, _, _ = _encoder(model)
    problem = gliner2.engine_problem(enc)
    return Limits(max_context=configs.max_context(enc), has_engine=not problem, reason_no_engine=problem)


@hookimpl
def weight_files(model: ResolvedModel) -> tuple[ShardSet, ...] | None:
    """A JEV head beside a sharded LM is a file its index does not name (core's default reads the index)."""
    return jev.weight_files(model) if model.model_type == jev.MODEL_TYPE else None
