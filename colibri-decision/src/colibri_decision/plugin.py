"""colibri family plugin for decision checkpoints: GLiNER2-style extractors (``model_type: extractor``).

An extractor is a bidirectional encoder (BERT or DeBERTa-v2, described by ``encoder_config``) whose weights sit
under ``encoder.`` in ``model.safetensors``, followed by small heads (span representation, classifier, count
predictor) that answer typed questions — which spans are entities of a label, which label a text has — with
probabilities. There are no experts and no KV cache.
"""

from __future__ import annotations

from typing import Any, Mapping

from colibri import configs, hookimpl
from colibri.checkpoint import TensorIndex, default_shard_set
from colibri.errors import ConfigError
from colibri.records import FamilyDescriptor, Geometry, Limits, ResolvedModel, TensorLayout

FAMILY = "decision"
MODEL_TYPES = ("extractor",)
ENCODER_PREFIX = "encoder."
ENCODER_TYPES = ("bert", "deberta-v2", "deberta_v2")


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, MODEL_TYPES, "decision checkpoints: GLiNER2-style extractors (encoder + heads)")


def _encoder(model: ResolvedModel) -> tuple[Mapping[str, Any], str, str]:
    where = f"{model.path / 'config.json'} (encoder_config)"
    enc = model.config.get("encoder_config")
    if not isinstance(enc, Mapping):
        raise ConfigError(f"{model.path / 'config.json'}: no 'encoder_config' object",
                          "an extractor checkpoint must describe its encoder; restore the original config.json")
    kind = str(enc.get("model_type") or "bert")
    if kind not in ENCODER_TYPES:
        raise ConfigError(f"{where}: encoder model_type {kind!r} is not supported",
                          f"supported encoders: {', '.join(ENCODER_TYPES[:2])}")
    return enc, where, kind.replace("_", "-")


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
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
    enc, where, kind = _encoder(model)
    embeddings, norms, other = encoder_tensors(enc, kind, where)
    prefixed = [ENCODER_PREFIX + n for n in other]
    # The heads' shapes and count depend on the extractor version, not on config.json: take them from the shard
    # headers (names only; no weight bytes are read).
    shards = default_shard_set(model.path)
    if shards is None:
        raise ConfigError(f"{model.path}: no *.safetensors weights", "download the checkpoint's model.safetensors")
    heads = sorted(t.name for t in TensorIndex((shards,)) if not t.name.startswith(ENCODER_PREFIX))
    return TensorLayout(embeddings=tuple(ENCODER_PREFIX + n for n in embeddings), lm_head=None,
                        norms=tuple(ENCODER_PREFIX + n for n in norms), routers=(), experts=(),
                        required=tuple(prefixed + heads))


@hookimpl
def limits(model: ResolvedModel) -> Limits:
    enc, _, _ = _encoder(model)
    return Limits(max_context=configs.max_context(enc), has_engine=False,
                  reason_no_engine=f"no engine for {FAMILY} yet")
