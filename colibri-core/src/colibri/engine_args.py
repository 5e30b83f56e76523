"""What every family's Python side derives the same way for its engine: ``--set`` arguments, RoPE scaling values
(linear, llama3, YaRN) resolved as transformers resolves them, and cache bytes at the runtime's cache dtype.

A family plugin calls these from its ``build_env`` and ``model_geometry`` so the rules live once, here.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from . import configs
from .configs import Rope
from .errors import ConfigError

# The runtime keeps every KV row and every recurrent state in f32 (runtime/engine.c allocates float caches): a
# fact of the runtime, not of a family. Families state cache sizes in floats and convert with kv_bytes.
KV_DTYPE = "F32"
KV_DTYPE_BYTES = 4

# RoPE types the runtime implements (runtime/blocks.c cb_rope_init).
RUNTIME_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# The colibri-quant container schemes the runtime's shared blocks run (runtime/qlinear.h), so every engine composed
# of them does: what a family reports in Limits.quant_schemes unless its engine is narrower.
RUNTIME_QUANT_SCHEMES = ("int8-row", "int4-g64")

_RESTORE = "restore the checkpoint's original config.json"


def kv_bytes(floats: int) -> int:
    """Bytes of ``floats`` cache values at the runtime's cache dtype (``Geometry.kv_bytes_per_token`` and
    ``state_bytes_per_slot`` are stated this way)."""
    return floats * KV_DTYPE_BYTES


def set_args(values: Mapping[str, Any]) -> tuple[str, ...]:
    """``--set key=value`` for each item, in order (the engine's hyperparameter plumbing, docs/protocol.md)."""
    args: list[str] = []
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return tuple(args)


def check_rope_type(rope: Rope, where: str, engine: str, supported: tuple[str, ...] = RUNTIME_ROPE_TYPES) -> None:
    """Refuse a RoPE type the engine does not implement (one line naming the config and the types it has)."""
    if rope.rope_type not in supported:
        raise ConfigError(f"{where}: rope type {rope.rope_type!r} is not supported by the {engine} engine",
                          f"the engine implements {', '.join(supported)}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by ``factor`` (the paper's 0.1 ln s + 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling_factor(config: Mapping[str, Any], rope: Rope, where: str) -> float | None:
    """The context stretch of a scaled RoPE (None for the default type): ``factor``, else for YaRN
    max_position_embeddings / original_max_position_embeddings, as transformers derives it."""
    if rope.rope_type == "default":
        return None
    scaling = rope.scaling or {}
    factor = scaling.get("factor")
    orig = _original_max_position(config, rope)
    if factor is None and rope.rope_type == "yarn" and orig and config.get("max_position_embeddings"):
        factor = config["max_position_embeddings"] / orig
    if factor is None:
        raise ConfigError(f"{where}: rope scaling {rope.rope_type!r} has no 'factor'", _RESTORE)
    return float(factor)


def rope_scaling_values(config: Mapping[str, Any], rope: Rope, where: str) -> dict[str, Any]:
    """The scaled-RoPE settings as the runtime reads them (``rope_factor``; llama3's frequency band; YaRN's
    ramp, truncation and cos/sin factor); empty for the default type.

    YaRN's cos/sin factor (``rope_attention_factor``; the runtime applies it to the rotated dimensions only) is
    ``attention_factor``, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given, else
    mscale(factor), as transformers' ``_compute_yarn_parameters``."""
    factor = rope_scaling_factor(config, rope, where)
    if factor is None:
        return {}
    scaling = rope.scaling or {}
    orig = _original_max_position(config, rope)
    values: dict[str, Any] = {"rope_factor": repr(factor)}
    if rope.rope_type == "llama3":
        values.update(rope_low_freq_factor=repr(float(scaling.get("low_freq_factor", 1.0))),
                      rope_high_freq_factor=repr(float(scaling.get("high_freq_factor", 4.0))),
                      rope_original_max_position=int(orig or 8192))
    if rope.rope_type == "yarn":
        if not orig:
            raise ConfigError(f"{where}: yarn rope scaling needs 'original_max_position_embeddings'", _RESTORE)
        attention = scaling.get("attention_factor")
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if attention is None:
            attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                         if mscale and mscale_all_dim else yarn_mscale(factor))
        values.update(rope_original_max_position=int(orig), rope_attention_factor=repr(float(attention)),
                      rope_beta_fast=repr(float(scaling.get("beta_fast") or 32)),
                      rope_beta_slow=repr(float(scaling.get("beta_slow") or 1)),
                      rope_truncate=int(bool(scaling.get("truncate", True))))
    return values


def rope_values(config: Mapping[str, Any], rope: Rope, where: str, engine: str,
                supported: tuple[str, ...] = RUNTIME_ROPE_TYPES) -> dict[str, Any]:
    """Every RoPE setting of a single-RoPE engine: the type check, ``rope_theta``, ``rope_type``,
    ``partial_rotary_factor`` when not 1, and the scaling values."""
    check_rope_type(rope, where, engine, supported)
    values: dict[str, Any] = {"rope_theta": repr(rope.theta), "rope_type": rope.rope_type}
    if rope.partial_rotary_factor != 1.0:
        values["partial_rotary_factor"] = repr(rope.partial_rotary_factor)
    values.update(rope_scaling_values(config, rope, where))
    return values


def mla_softmax_scale(config: Mapping[str, Any], rope: Rope, qk_head_dim: int, where: str) -> float:
    """DeepSeek-style attention's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when
    the RoPE is scaled and names ``mscale_all_dim`` (DeepSeek-V3, Kimi K2, GLM's MLA types)."""
    scale = qk_head_dim ** -0.5
    factor = rope_scaling_factor(config, rope, where)
    mscale_all_dim = (rope.scaling or {}).get("mscale_all_dim")
    if factor is not None and mscale_all_dim:
        scale *= yarn_mscale(factor, float(mscale_all_dim)) ** 2
    return scale


def _original_max_position(config: Mapping[str, Any], rope: Rope) -> Any:
    return (rope.scaling or {}).get("original_max_position_embeddings",
                                    config.get("original_max_position_embeddings"))


def moe_decoder_values(config: Mapping[str, Any], r: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``--set`` values every routed-MoE decoder engine reads: sizes, expert counts, ``tie_word_embeddings``
    and ``mlp_layers`` (one letter a layer, M routed or D dense). ``r`` is the family's reading of config.json with
    the keys ``hidden``, ``layers``, ``heads``, ``vocab``, ``expert_width``, ``experts``, ``top_k``, ``shared`` and
    ``moe_layers``."""
    n = r["layers"]
    return dict(
        hidden_size=r["hidden"], num_hidden_layers=n, num_attention_heads=r["heads"], vocab_size=r["vocab"],
        intermediate_size=configs.require_int(config, "intermediate_size", where=where, minimum=1),
        moe_intermediate_size=r["expert_width"], n_routed_experts=r["experts"], num_experts_per_tok=r["top_k"],
        n_shared_experts=r["shared"], tie_word_embeddings=int(bool(config.get("tie_word_embeddings", False))),
        mlp_layers="".join("M" if i in r["moe_layers"] else "D" for i in range(n)),
    )


def grouped_router_values(config: Mapping[str, Any], where: str, n_group: int = 1, topk_group: int = 1,
                          routed_scaling_factor: float = 1.0, rms_norm_eps: float = 1e-5) -> dict[str, Any]:
    """The router settings of DeepSeek-style grouped routing (the runtime's grouped_moe block) and the norm epsilon,
    under either spelling the checkpoints use, with the config class's defaults for fields it omits."""
    return dict(
        n_group=configs.optional_int(config, "n_group", "num_expert_group", default=n_group, where=where),
        topk_group=configs.optional_int(config, "topk_group", default=topk_group, where=where),
        norm_topk_prob=int(bool(configs.first_of(config, "norm_topk_prob", "moe_renormalize", default=True))),
        routed_scaling_factor=repr(configs.require_number(config, "routed_scaling_factor", routed_scaling_factor,
                                                          where=where)),
        rms_norm_eps=repr(configs.require_number(config, "rms_norm_eps", rms_norm_eps, where=where)),
    )


def mla_values(r: Mapping[str, Any], v_head_dim: int) -> dict[str, Any]:
    """Multi-head latent attention's sizes from a reading with ``q_lora``, ``kv_lora``, ``nope_dim``, ``rope_dim``
    (:func:`colibri.configs.mla_dims`)."""
    return dict(q_lora_rank=r["q_lora"], kv_lora_rank=r["kv_lora"], qk_nope_head_dim=r["nope_dim"],
                qk_rope_head_dim=r["rope_dim"], v_head_dim=v_head_dim)


def mla_rope_values(config: Mapping[str, Any], rope: Rope, qk_head_dim: int, where: str) -> dict[str, Any]:
    """RoPE scaling settings as the engine reads them, and DeepSeek-style attention's softmax scale."""
    return dict(rope_scaling_values(config, rope, where),
                attention_scale=repr(mla_softmax_scale(config, rope, qk_head_dim, where)))
