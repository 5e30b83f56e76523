"""colibri family plugin for the GLM MoE families.

``glm4_moe`` (GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air): GQA with qkv bias, optional per-head q/k norm, partial RoPE.
``glm4_moe_lite`` (GLM-4.7-Flash): multi-head latent attention (MLA). ``glm_moe_dsa`` (GLM-5 lineage): MLA plus
the DSA lightning indexer. All route with sigmoid scores + ``e_score_correction_bias`` (selection only), groups,
renormalisation and ``routed_scaling_factor``; shared experts; leading dense layers; MTP layers stored after the
last decoder layer (skipped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from colibri import configs, hookimpl
from colibri.records import (
    Claim, ExpertTensors, FamilyDescriptor, Geometry, Limits, ResolvedModel, TensorLayout,
)

FAMILY = "glm"
MODEL_TYPES = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
MLA_TYPES = ("glm4_moe_lite", "glm_moe_dsa")
F32 = 4


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, MODEL_TYPES, "GLM MoE: GLM-4.5/4.6/4.7, GLM-4.7-Flash (MLA), GLM-5 (MLA + DSA)")


@hookimpl
def detect_config(model_dir: Path, config: Mapping[str, Any] | None) -> Claim | None:
    model_type = config.get("model_type") if config else None
    if model_type in MODEL_TYPES:
        return Claim(FAMILY, model_type, f"config.json model_type {model_type!r}")
    return None


def _read(model: ResolvedModel) -> dict[str, Any]:
    cfg, where = model.config, str(model.path / "config.json")
    n = configs.require_int(cfg, "num_hidden_layers", where=where, minimum=1)
    hidden = configs.require_int(cfg, "hidden_size", where=where, minimum=1)
    heads = configs.require_int(cfg, "num_attention_heads", where=where, minimum=1)
    r = dict(
        cfg=cfg, layers=n, hidden=hidden, heads=heads, mla=model.model_type in MLA_TYPES,
        vocab=configs.require_int(cfg, "vocab_size", where=where, minimum=1),
        experts=configs.require_int(cfg, "n_routed_experts", "num_experts", "num_local_experts", where=where,
                                    minimum=1),
        top_k=configs.require_int(cfg, *configs.TOP_K_FIELDS, where=where, minimum=1),
        expert_width=configs.require_int(cfg, "moe_intermediate_size", where=where, minimum=1),
        shared=configs.optional_int(cfg, "n_shared_experts", where=where),
        nextn=configs.optional_int(cfg, "num_nextn_predict_layers", where=where),
        moe_layers=configs.moe_layer_indices(cfg, n, where=where),
    )
    if r["mla"]:
        r.update(
            q_lora=configs.optional_int(cfg, "q_lora_rank", where=where),
            kv_lora=configs.require_int(cfg, "kv_lora_rank", where=where, minimum=1),
            rope_dim=configs.require_int(cfg, "qk_rope_head_dim", where=where, minimum=1),
            nope_dim=configs.require_int(cfg, "qk_nope_head_dim", where=where, minimum=0),
            kv_heads=heads,
        )
        r["head_dim"] = r["nope_dim"] + r["rope_dim"]
    else:
        r.update(kv_heads=configs.optional_int(cfg, "num_key_value_heads", default=heads, where=where),
                 head_dim=configs.optional_int(cfg, "head_dim", default=hidden // heads, where=where))
    return r


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
    r = _read(model)
    cfg, n = r["cfg"], r["layers"]
    if r["mla"]:
        per_layer = (r["kv_lora"] + r["rope_dim"]) * F32
        attention = "MLA (compressed KV)"
        if model.model_type == "glm_moe_dsa":
            per_layer += configs.optional_int(cfg, "index_head_dim", default=128) * F32
            attention = "MLA + DSA lightning indexer"
        rope = configs.rope(cfg)
    else:
        per_layer = 2 * r["kv_heads"] * r["head_dim"] * F32
        attention = "GQA + partial RoPE" + (", qkv bias" if cfg.get("attention_bias") else "") + (
            ", q/k norm" if cfg.get("use_qk_norm") else "")
        rope = configs.rope(cfg, default_partial=0.5)
    notes = [("router", f"sigmoid + bias, {cfg.get('n_group', 1)} groups, keep {cfg.get('topk_group', 1)}"
                        f"{', renormalised' if cfg.get('norm_topk_prob', True) else ''}"
                        f" × {cfg.get('routed_scaling_factor', 1.0)}"),
             ("rope", f"theta {rope.theta:g}, partial {rope.partial_rotary_factor:g}")]
    if r["nextn"]:
        notes.append(("MTP layers", f"{r['nextn']} (skipped)"))
    return Geometry(
        model_type=model.model_type, architecture="GLM MoE decoder", attention=attention, num_layers=n,
        hidden_size=r["hidden"], vocab_size=r["vocab"], num_heads=r["heads"], num_kv_heads=r["kv_heads"],
        head_dim=r["head_dim"], num_experts=r["experts"], top_k=r["top_k"], expert_intermediate=r["expert_width"],
        num_shared_experts=r["shared"], moe_layers=r["moe_layers"],
        dense_layers=tuple(i for i in range(n) if i not in r["moe_layers"]), max_context=configs.max_context(cfg),
        kv_bytes_per_token=per_layer * n, notes=tuple(notes),
    )


def _attention(model_type: str, r: dict[str, Any], p: str) -> tuple[list[str], list[str]]:
    """(norm tensors, other tensors) of one layer's attention block."""
    cfg, sa = r["cfg"], p + "self_attn."
    if not r["mla"]:
        norms = [sa + "q_norm.weight", sa + "k_norm.weight"] if cfg.get("use_qk_norm") else []
        req = [f"{sa}{x}_proj.weight" for x in "qkvo"]
        if cfg.get("attention_bias"):
            req += [f"{sa}{x}_proj.bias" for x in "qkv"]
        return norms, req
    norms, req = [sa + "kv_a_layernorm.weight"], []
    if r["q_lora"]:
        norms.append(sa + "q_a_layernorm.weight")
        req += [sa + "q_a_proj.weight", sa + "q_b_proj.weight"]
    else:
        req.append(sa + "q_proj.weight")
    req += [sa + "kv_a_proj_with_mqa.weight", sa + "kv_b_proj.weight", sa + "o_proj.weight"]
    if model_type == "glm_moe_dsa":
        ix = sa + "indexer."
        norms.append(ix + "k_norm.weight")
        req += [ix + "wq_b.weight", ix + "wk.weight", ix + "k_norm.bias", ix + "weights_proj.weight"]
    return norms, req


@hookimpl
def tensor_layout(model: ResolvedModel) -> TensorLayout:
    r = _read(model)
    norms, routers, experts, required = ["model.norm.weight"], [], [], []
    for i in range(r["layers"]):
        p = f"model.layers.{i}."
        norms += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        attn_norms, attn = _attention(model.model_type, r, p)
        norms += attn_norms
        required += attn
        m = p + "mlp."
        if i not in r["moe_layers"]:
            required += [f"{m}{x}_proj.weight" for x in ("gate", "up", "down")]
            continue
        routers.append((i, m + "gate.weight"))
        required.append(m + "gate.e_score_correction_bias")
        for e in range(r["experts"]):
            q = f"{m}experts.{e}."
            experts.append(ExpertTensors(i, e, (q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight")))
        if r["shared"]:
            required += [f"{m}shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
    tied = bool(r["cfg"].get("tie_word_embeddings", False))
    return TensorLayout(
        embeddings=("model.embed_tokens.weight",) if tied else ("model.embed_tokens.weight", "lm_head.weight"),
        lm_head=None if tied else "lm_head.weight", norms=tuple(norms), routers=tuple(routers),
        experts=tuple(experts), required=tuple(required),
        skipped_prefixes=configs.layer_range_prefixes("model.layers.", r["layers"], r["nextn"]))


@hookimpl
def limits(model: ResolvedModel) -> Limits:
    return Limits(max_context=configs.max_context(model.config), has_engine=False,
                  reason_no_engine=f"no engine for {FAMILY} yet")
