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

from colibri import configs, hookimpl, source_quant
from colibri.engine_args import (
    RUNTIME_QUANT_SCHEMES, check_rope_type, grouped_router_values, kv_bytes, mla_softmax_scale, mla_values,
    moe_decoder_values, rope_scaling_values, set_args,
)
from colibri.layouts import LayoutParts, indexer_f32_spec, mla_attention, projections
from colibri.errors import ConfigError
from colibri.records import (
    ConverterSpec, EngineEnv, EngineSource, FamilyDescriptor, Geometry, Limits, ResolvedModel,
    ResourcePlan, TensorLayout,
)
from colibri.output_parser import OutputParser

from .syntax import SYNTAX

FAMILY = "glm"
MODEL_TYPES = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa")
MLA_TYPES = ("glm4_moe_lite", "glm_moe_dsa")
# transformers' default count of leading dense layers when a config names neither mlp_layer_types nor
# first_k_dense_replace (GLM-4.7-Flash's default list is one dense layer, then MoE).
DEFAULT_FIRST_DENSE = {"glm4_moe": 1, "glm4_moe_lite": 1, "glm_moe_dsa": 3}


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, MODEL_TYPES, "GLM MoE: GLM-4.5/4.6/4.7, GLM-4.7-Flash (MLA), GLM-5 (MLA + DSA)")


def _moe_layers(model_type: str, cfg: Mapping[str, Any], n: int, where: str) -> tuple[int, ...]:
    """MoE layers as transformers builds them: glm4_moe reads only first_k_dense_replace; the MLA types read
    mlp_layer_types, defaulting to first_k_dense_replace leading dense layers."""
    if model_type != "glm4_moe" and cfg.get("mlp_layer_types") is not None:
        return configs.moe_layer_indices(cfg, n, where=where)
    first_k = configs.optional_int(cfg, "first_k_dense_replace", default=DEFAULT_FIRST_DENSE[model_type],
                                   where=where)
    return tuple(range(min(first_k, n), n))


def _read(model: ResolvedModel) -> dict[str, Any]:
    cfg, where = model.config, str(model.path / "config.json")
    n = configs.require_int(cfg, "num_hidden_layers", where=where, minimum=1)
    hidden = configs.require_int(cfg, "hidden_size", where=where, minimum=1)
    heads = configs.require_int(cfg, "num_attention_heads", where=where, minimum=1)
    r: dict[str, Any] = dict(
        cfg=cfg, layers=n, hidden=hidden, heads=heads, mla=model.model_type in MLA_TYPES,
        vocab=configs.require_int(cfg, "vocab_size", where=where, minimum=1),
        experts=configs.require_int(cfg, "n_routed_experts", "num_experts", "num_local_experts", where=where,
                                    minimum=1),
        top_k=configs.require_int(cfg, *configs.TOP_K_FIELDS, where=where, minimum=1),
        expert_width=configs.require_int(cfg, "moe_intermediate_size", where=where, minimum=1),
        shared=configs.optional_int(cfg, "n_shared_experts", where=where),
        nextn=configs.optional_int(cfg, "num_nextn_predict_layers", where=where),
        moe_layers=_moe_layers(model.model_type, cfg, n, where),
    )
    if r["mla"]:
        r.update(configs.mla_dims(cfg, where), kv_heads=heads)
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
        per_layer = kv_bytes(r["kv_lora"] + r["rope_dim"])
        attention = "MLA (compressed KV)"
        if model.model_type == "glm_moe_dsa":
            per_layer += kv_bytes(configs.optional_int(cfg, "index_head_dim", default=128))
            attention = "MLA + DSA lightning indexer"
        rope = configs.rope(cfg)
    else:
        per_layer = kv_bytes(2 * r["kv_heads"] * r["head_dim"])
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
    return mla_attention(sa, r["q_lora"], indexer=model_type == "glm_moe_dsa")


@hookimpl
def tensor_layout(model: ResolvedModel) -> TensorLayout:
    r = _read(model)
    parts = LayoutParts()
    for i in range(r["layers"]):
        p = f"model.layers.{i}."
        parts.layer(p, _attention(model.model_type, r, p))
        if i in r["moe_layers"]:
            parts.moe(i, p + "mlp.", r["experts"], r["shared"])
        else:
            parts.required += projections(p + "mlp.")
    # GLM-5-FP8 ships block-FP8 like DeepSeek-V3 (runtime fp8.h reads it for every family)
    parts.add_source_quant(model.path, r["cfg"], str(model.path / "config.json"))
    return parts.layout(r["cfg"], r["layers"], r["nextn"])


@hookimpl
def converter_spec(model: ResolvedModel) -> ConverterSpec | None:
    """Core's spec with the DSA indexer kept F32 (colibri.layouts.indexer_f32_spec says why)."""
    return indexer_f32_spec(tensor_layout(model))



@hookimpl
def limits(model: ResolvedModel) -> Limits:
    return Limits(max_context=configs.max_context(model.config), has_engine=engine_source(model) is not None,
                  quant_schemes=RUNTIME_QUANT_SCHEMES)


RUNTIME_API = 1   # the colibri runtime C API the engine sources are written for (CB_RUNTIME_API, runtime/api.h)
ENGINE_C = Path(__file__).parent / "engine" / "glm.c"
# RoPE types the engine implements (colibri runtime blocks.c cb_rope_init); anything else is refused here.
ENGINE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@hookimpl
def engine_source(model: ResolvedModel | None) -> EngineSource:
    return EngineSource(name="colibri-glm", sources=(ENGINE_C,), runtime_api=RUNTIME_API)


def _indexer_layers(cfg: Mapping[str, Any], n: int, where: str) -> str:
    """One letter per layer, F (runs its own indexer) or S (reuses the previous one's), as transformers derives
    indexer_types: explicit list, else index_topk_pattern, else the index_topk_freq / offset schedule."""
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq = max(int(cfg.get("index_topk_freq", 1)), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    letters = {"full": "F", "shared": "S"}
    if len(types) != n or any(t not in letters for t in types):
        raise ConfigError(f"{where}: 'indexer_types' must list 'full' or 'shared' for each of the {n} layers",
                          "restore the checkpoint's original config.json")
    if types[0] != "full":
        raise ConfigError(f"{where}: 'indexer_types'[0] is 'shared' but no earlier layer runs an indexer",
                          "the first layer must be 'full'")
    return "".join(letters[t] for t in types)


def engine_hparams(model: ResolvedModel) -> tuple[str, ...]:
    """The ``--set key=value`` arguments of the GLM engine, resolved from config.json."""
    r = _read(model)
    cfg, n, where = r["cfg"], r["layers"], str(model.path / "config.json")
    source_quant.check_config(cfg, where)   # block-FP8 / int4-packed weights load natively; other schemes are refused
    rope = configs.rope(cfg, default_partial=1.0 if r["mla"] else 0.5)
    check_rope_type(rope, where, FAMILY, ENGINE_ROPE_TYPES)
    values: dict[str, Any] = dict(
        moe_decoder_values(cfg, r, where), **grouped_router_values(cfg, where),
        attention_bias=int(bool(cfg.get("attention_bias", False))), rope_theta=repr(rope.theta),
        rope_type=rope.rope_type,
    )
    if r["mla"]:
        values.update(mla_values(r, configs.require_int(cfg, "v_head_dim", where=where, minimum=1)),
                      attention="dsa" if model.model_type == "glm_moe_dsa" else "mla")
        if model.model_type == "glm_moe_dsa":
            if not r["q_lora"]:
                raise ConfigError(f"{where}: glm_moe_dsa needs 'q_lora_rank' (the indexer reads the q latent)",
                                  "restore the checkpoint's original config.json")
            values.update(index_n_heads=configs.optional_int(cfg, "index_n_heads", default=32, where=where),
                          index_head_dim=configs.optional_int(cfg, "index_head_dim", default=128, where=where),
                          index_topk=configs.optional_int(cfg, "index_topk", default=2048, where=where),
                          indexer_layers=_indexer_layers(cfg, n, where))
        else:
            values["rope_interleave"] = int(bool(cfg.get("rope_interleave", True)))
    else:
        values.update(attention="gqa", num_key_value_heads=r["kv_heads"], head_dim=r["head_dim"],
                      use_qk_norm=int(bool(cfg.get("use_qk_norm", False))))
    if rope.partial_rotary_factor != 1.0:
        values["partial_rotary_factor"] = repr(rope.partial_rotary_factor)
    values.update(rope_scaling_values(cfg, rope, where))
    if r["mla"] and rope.rope_type != "default" and (rope.scaling or {}).get("mscale_all_dim"):
        # The MLA types (GLM-4.7-Flash, GLM-5) scale the softmax as DeepSeek-V3 does; glm4_moe does not.
        values["attention_scale"] = repr(mla_softmax_scale(cfg, rope, r["head_dim"], where))
    return set_args(values)


@hookimpl
def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv:
    return EngineEnv(args=engine_hparams(model))


@hookimpl
def parse_output(model: ResolvedModel) -> Any:
    return OutputParser(SYNTAX)
