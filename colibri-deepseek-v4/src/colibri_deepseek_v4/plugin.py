"""colibri family plugin for DeepSeek MoE: ``deepseek_v3`` (V3 / R1), ``deepseek_v32`` (V3.2) and ``deepseek_v4``.

V3 and V3.2 use multi-head latent attention (MLA): the KV cache holds one compressed latent (``kv_lora_rank``)
plus the shared RoPE key (``qk_rope_head_dim``) per token and layer. V3.2 adds the DSA lightning indexer, which
caches its own key per token. Routing is sigmoid + ``e_score_correction_bias`` (selection only), group-limited,
renormalised and scaled. V4 compresses attention per layer type (CSA / HCA rates, plus a sliding window in every
layer), keeps one KV head, and hash-routes tokens in its first layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from colibri import configs, fp8, hookimpl
from colibri.engine_args import (
    RUNTIME_QUANT_SCHEMES, check_rope_type, grouped_router_values, kv_bytes, mla_rope_values, mla_values,
    moe_decoder_values, set_args,
)
from colibri.layouts import EXPERT_W, LayoutParts, indexer_f32_spec, mla_attention, projections
from colibri.errors import ConfigError
from colibri.records import (
    ConverterSpec, EngineEnv, EngineSource, ExpertTensors, FamilyDescriptor, Geometry, Limits, ResolvedModel,
    ResourcePlan, TensorLayout,
)
from colibri.output_parser import OutputParser

from .syntax import SYNTAX

FAMILY = "deepseek-v4"
MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "deepseek_v4")

# What transformers assumes when a deepseek_v3 config omits the router fields (its saves do).
V3_ROUTER_DEFAULTS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
# DeepSeek-V4 defaults (transformers DeepseekV4Config) for configs that omit them.
V4_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
V4_RATIO_TO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
V4_DEFAULT_HASH_LAYERS = 3


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, MODEL_TYPES, "DeepSeek MoE: V3 / R1 (MLA), V3.2 (MLA + DSA), V4 (CSA/HCA)")


def _where(model: ResolvedModel) -> str:
    return str(model.path / "config.json")


def _common(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    n = configs.require_int(cfg, "num_hidden_layers", where=where, minimum=1)
    heads = configs.require_int(cfg, "num_attention_heads", where=where, minimum=1)
    return dict(
        layers=n, heads=heads,
        hidden=configs.require_int(cfg, "hidden_size", where=where, minimum=1),
        vocab=configs.require_int(cfg, "vocab_size", where=where, minimum=1),
        experts=configs.require_int(cfg, "n_routed_experts", "num_experts", "num_local_experts", where=where,
                                    minimum=1),
        top_k=configs.require_int(cfg, *configs.TOP_K_FIELDS, where=where, minimum=1),
        expert_width=configs.require_int(cfg, "moe_intermediate_size", where=where, minimum=1),
        shared=configs.optional_int(cfg, "n_shared_experts", where=where),
        nextn=configs.optional_int(cfg, "num_nextn_predict_layers", where=where),
        q_lora=configs.optional_int(cfg, "q_lora_rank", where=where),
    )


def _read_mla(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    r = _common(cfg, where)
    r.update(
        configs.mla_dims(cfg, where),
        v_dim=configs.require_int(cfg, "v_head_dim", where=where, minimum=1),
        moe_layers=configs.moe_layer_indices(cfg, r["layers"], where=where),
    )
    return r


def _v4_layer_types(cfg: Mapping[str, Any], n: int, where: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None and isinstance(cfg.get("compress_ratios"), list):
        try:
            types = [V4_RATIO_TO_TYPE[int(r)] for r in cfg["compress_ratios"]]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where}: 'compress_ratios' must hold 0, 4 or 128 per layer",
                              "restore the checkpoint's original config.json") from None
    if types is None:
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    if len(types) < n:
        raise ConfigError(f"{where}: 'layer_types' has {len(types)} entries for {n} layers",
                          "restore the checkpoint's original config.json")
    return tuple(types[:n])


def _v4_rates(cfg: Mapping[str, Any]) -> dict[str, int]:
    rates = dict(V4_COMPRESS_RATES)
    rates.update(cfg.get("compress_rates") or {})
    if cfg.get("compress_rate_csa") is not None:
        rates["compressed_sparse_attention"] = int(cfg["compress_rate_csa"])
    if cfg.get("compress_rate_hca") is not None:
        rates["heavily_compressed_attention"] = int(cfg["compress_rate_hca"])
    rates["sliding_attention"] = 0
    return rates


def _read_v4(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    r = _common(cfg, where)
    n = r["layers"]
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        hashed = configs.optional_int(cfg, "num_hash_layers", default=V4_DEFAULT_HASH_LAYERS, where=where)
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    r.update(
        head_dim=configs.require_int(cfg, "head_dim", where=where, minimum=1),
        kv_heads=configs.optional_int(cfg, "num_key_value_heads", default=1, where=where),
        window=configs.optional_int(cfg, "sliding_window", default=128, where=where),
        index_dim=configs.optional_int(cfg, "index_head_dim", default=128, where=where),
        attn=_v4_layer_types(cfg, n, where), rates=_v4_rates(cfg),
        hash_layers=tuple(i for i, t in enumerate(mlp_types[:n]) if t == "hash_moe"),
        moe_layers=configs.moe_layer_indices({**cfg, "mlp_layer_types": list(mlp_types[:n])}, n, where=where),
    )
    return r


def _router_notes(cfg: Mapping[str, Any], model_type: str) -> tuple[tuple[str, str], ...]:
    if model_type == "deepseek_v4":
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        return (("router", f"{scoring} + bias, top-k, renormalised × {cfg.get('routed_scaling_factor', 1.5)}"),)
    scoring = cfg.get("scoring_func") or V3_ROUTER_DEFAULTS["scoring_func"]
    method = cfg.get("topk_method") or V3_ROUTER_DEFAULTS["topk_method"]
    groups = f"{cfg.get('n_group', 1)} groups, keep {cfg.get('topk_group', 1)}"
    renorm = ", renormalised" if cfg.get("norm_topk_prob", True) else ""
    return (("router", f"{scoring} ({method}), {groups}{renorm} × {cfg.get('routed_scaling_factor', 1.0)}"),)


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
    cfg, where = model.config, _where(model)
    if model.model_type == "deepseek_v4":
        return _geometry_v4(model, cfg, where)
    r = _read_mla(cfg, where)
    per_layer = kv_bytes(r["kv_lora"] + r["rope_dim"])
    notes = [("MLA", f"kv_lora_rank {r['kv_lora']}, rope dim {r['rope_dim']}, q_lora_rank {r['q_lora'] or 'none'}")]
    attention = "MLA (compressed KV)"
    if model.model_type == "deepseek_v32":
        index_dim = configs.optional_int(cfg, "index_head_dim", default=128, where=where)
        per_layer += kv_bytes(index_dim)
        attention = "MLA + DSA lightning indexer"
        notes.append(("DSA", f"index_topk {cfg.get('index_topk', 2048)}, {cfg.get('index_n_heads', 64)} heads"))
    notes += list(_router_notes(cfg, model.model_type))
    notes.append(("rope theta", f"{configs.rope(cfg).theta:g}"))
    if r["nextn"]:
        notes.append(("MTP layers", f"{r['nextn']} (skipped)"))
    return Geometry(
        model_type=model.model_type, architecture="DeepSeek MoE decoder", attention=attention,
        num_layers=r["layers"], hidden_size=r["hidden"], vocab_size=r["vocab"], num_heads=r["heads"],
        num_kv_heads=r["heads"], head_dim=r["nope_dim"] + r["rope_dim"], num_experts=r["experts"],
        top_k=r["top_k"], expert_intermediate=r["expert_width"], num_shared_experts=r["shared"],
        moe_layers=r["moe_layers"], dense_layers=tuple(i for i in range(r["layers"]) if i not in r["moe_layers"]),
        max_context=configs.max_context(cfg), kv_bytes_per_token=per_layer * r["layers"], notes=tuple(notes),
    )


def v4_kv_row_floats(r: Mapping[str, Any]) -> int:
    """Floats per token and layer of the engine's KV rows (engine/deepseek_v4.c): every layer's row is as wide as
    the widest kind's, which keeps the key (head_dim), the compressed entry it may close (head_dim), the
    compressor's raw value and gate rows (2 x head_dim each for CSA's overlapping windows, head_dim for HCA) and,
    for CSA, the indexer's entry and raw rows (index_head_dim, 2 x 2 x index_head_dim)."""
    d, di = r["head_dim"], r["index_dim"]
    width = {"sliding_attention": d, "heavily_compressed_attention": 4 * d,
             "compressed_sparse_attention": 6 * d + 5 * di}
    return max(width.get(kind, d) for kind in r["attn"])


def _geometry_v4(model: ResolvedModel, cfg: Mapping[str, Any], where: str) -> Geometry:
    r = _read_v4(cfg, where)
    counts = {k: r["attn"].count(k) for k in dict.fromkeys(r["attn"])}
    notes = (("attention layers", ", ".join(f"{v} {k}" for k, v in counts.items())),
             ("hash-routed layers", str(len(r["hash_layers"]))),
             ("hyper-connections", str(cfg.get("hc_mult", 4))),
             ("sliding window", f"{r['window']} tokens"),
             ("KV row", f"{v4_kv_row_floats(r)} floats per token and layer (keys + compressor rows)"),
             *_router_notes(cfg, model.model_type))
    return Geometry(
        model_type=model.model_type, architecture="DeepSeek-V4 MoE decoder",
        attention="compressed sparse attention (CSA/HCA) + sliding window, 1 KV head",
        num_layers=r["layers"], hidden_size=r["hidden"], vocab_size=r["vocab"], num_heads=r["heads"],
        num_kv_heads=r["kv_heads"], head_dim=r["head_dim"], num_experts=r["experts"], top_k=r["top_k"],
        expert_intermediate=r["expert_width"], num_shared_experts=r["shared"], moe_layers=r["moe_layers"],
        dense_layers=tuple(i for i in range(r["layers"]) if i not in r["moe_layers"]),
        max_context=configs.max_context(cfg), kv_bytes_per_token=kv_bytes(r["layers"] * v4_kv_row_floats(r)),
        notes=notes,
    )


@hookimpl
def tensor_layout(model: ResolvedModel) -> TensorLayout:
    cfg, where = model.config, _where(model)
    if model.model_type == "deepseek_v4":
        return _layout_v4(cfg, _read_v4(cfg, where), fp8.tensor_names(model.path))
    r = _read_mla(cfg, where)
    parts = LayoutParts()
    bias = bool(cfg.get("attention_bias", False))
    for i in range(r["layers"]):
        p = f"model.layers.{i}."
        parts.layer(p, mla_attention(p + "self_attn.", r["q_lora"], bias, indexer=model.model_type == "deepseek_v32"))
        if i in r["moe_layers"]:
            parts.moe(i, p + "mlp.", r["experts"], r["shared"])
        else:
            parts.required += projections(p + "mlp.")
    if fp8.check_config(cfg, where):
        parts.add_fp8_scales(model.path, cfg)
    return parts.layout(cfg, r["layers"], r["nextn"])


# transformers' save names -> DeepSeek's release names (its reference inference code's); layer-level names agree.
V4_RELEASE_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                    "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
                    "model.hc_head.hc_scale": "hc_head_scale"}


def _v4_scale_of(name: str, present: frozenset[str]) -> str | None:
    """The scale companion of a quantized weight (fp8 dense, fp4 experts): transformers' or DeepSeek's naming."""
    for scale in (name + "_scale_inv", name.removesuffix(".weight") + ".scale"):
        if scale in present:
            return scale
    return None


def _layout_v4(cfg: Mapping[str, Any], r: dict[str, Any], present: frozenset[str] = frozenset()) -> TensorLayout:
    """Names as transformers saves them, or as DeepSeek releases them when the checkpoint has `embed.weight`;
    scale companions on disk belong to their weight (an expert's to its cache slot) and count as buffers."""
    layout = _layout_v4_hf(cfg, r)
    release = "embed.weight" in present and "model.embed_tokens.weight" not in present
    if not release and not present:
        return layout

    def name(n: str) -> str:
        return V4_RELEASE_NAMES.get(n, n.removeprefix("model.")) if release else n

    def names(ns) -> tuple[str, ...]:
        return tuple(name(n) for n in ns)

    experts = []
    for x in layout.experts:
        tensors = names(x.tensors)
        experts.append(ExpertTensors(x.layer, x.expert,
                                     tensors + tuple(s for t in tensors if (s := _v4_scale_of(t, present)))))
    dense = names(layout.required) + names(layout.embeddings)
    scales = [s for t in dense if (s := _v4_scale_of(t, present))]
    scales += [t for x in experts for t in x.tensors[3:]]
    # An expert weight with a scale companion under an fp4 expert_dtype is e2m1 packed two per byte.
    qc = cfg.get("quantization_config") or {}
    fp4 = (qc.get("expert_dtype") if isinstance(qc, Mapping) else None) or cfg.get("expert_dtype")
    packed = tuple(t for x in experts for t in x.tensors[:3] if _v4_scale_of(t, present)) if fp4 == "fp4" else ()
    return TensorLayout(
        embeddings=names(layout.embeddings), lm_head=layout.lm_head, norms=names(layout.norms),
        routers=tuple((i, name(n)) for i, n in layout.routers), experts=tuple(experts),
        required=names(layout.required), buffers=names(layout.buffers) + tuple(scales),
        skipped_prefixes=names(layout.skipped_prefixes), packed_fp4=packed, paged=names(layout.paged))


def _layout_v4_hf(cfg: Mapping[str, Any], r: dict[str, Any]) -> TensorLayout:
    parts = LayoutParts(required=["model.hc_head.hc_base", "model.hc_head.hc_fn", "model.hc_head.hc_scale"])
    norms, required = parts.norms, parts.required
    for i in range(r["layers"]):
        p = f"model.layers.{i}."
        a = p + "attn."
        norms += [p + "attn_norm.weight", p + "ffn_norm.weight", a + "q_norm.weight", a + "norm.weight"]
        required += [a + t for t in ("attn_sink", "wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight",
                                     "wo_b.weight")]
        required += [f"{p}hc_{block}_{t}" for block in ("attn", "ffn") for t in ("base", "fn", "scale")]
        kind = r["attn"][i]
        if r["rates"].get(kind, 0):
            norms.append(a + "compressor.norm.weight")
            required += [a + "compressor." + t for t in ("ape", "wgate.weight", "wkv.weight")]
        if kind == "compressed_sparse_attention":
            ix = a + "indexer."
            norms.append(ix + "compressor.norm.weight")
            required += [ix + t for t in ("compressor.ape", "compressor.wgate.weight", "compressor.wkv.weight",
                                          "weights_proj.weight", "wq_b.weight")]
        f = p + "ffn."
        if i not in r["moe_layers"]:
            required += [f"{f}{w}.weight" for w in ("w1", "w2", "w3")]
            continue
        # The bias is the token -> experts table on hash-routed layers, else the selection bias.
        parts.moe(i, f, r["experts"], r["shared"], EXPERT_W, "gate.tid2eid" if i in r["hash_layers"] else "gate.bias",
                  shared_names=("w1.weight", "w2.weight", "w3.weight"))
    return parts.layout(cfg, r["layers"], r["nextn"], head="head.weight", skipped=("mtp.",))


@hookimpl
def converter_spec(model: ResolvedModel) -> ConverterSpec | None:
    """Core's spec with the DSA indexer kept F32 (colibri.layouts.indexer_f32_spec says why)."""
    return indexer_f32_spec(tensor_layout(model))



@hookimpl
def limits(model: ResolvedModel) -> Limits:
    if engine_source(model) is None:
        return Limits(max_context=configs.max_context(model.config), has_engine=False,
                      reason_no_engine=f"no engine for {model.model_type} (DeepSeek-V4 compressed attention) yet")
    # deepseek_v4: no colibri-quant schemes (the container expert kernels have no clamped SwiGLU).
    return Limits(max_context=configs.max_context(model.config), has_engine=True,
                  quant_schemes=() if model.model_type == "deepseek_v4" else RUNTIME_QUANT_SCHEMES)


RUNTIME_API = 1   # the colibri runtime C API the engine sources are written for (CB_RUNTIME_API, runtime/api.h)
ENGINE_C = Path(__file__).parent / "engine" / "deepseek.c"
ENGINE_V4_C = Path(__file__).parent / "engine" / "deepseek_v4.c"
# One binary per composition, each from its own file: MLA (deepseek.c: V3, V3.2) and V4 (deepseek_v4.c).
MLA_ENGINE = EngineSource(name="colibri-deepseek-mla", sources=(ENGINE_C,), runtime_api=RUNTIME_API)
ENGINES = {"deepseek_v3": MLA_ENGINE, "deepseek_v32": MLA_ENGINE,
           "deepseek_v4": EngineSource(name="colibri-deepseek-v4", sources=(ENGINE_V4_C,), runtime_api=RUNTIME_API)}
# RoPE types the engine implements (colibri runtime blocks.c cb_rope_init); anything else is refused here.
ENGINE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# transformers' DeepseekV3Config defaults, for configs that omit a field.
V3_ROUTING_DEFAULTS: dict[str, Any] = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, rms_norm_eps=1e-6)


def _check_router(cfg: Mapping[str, Any], where: str) -> None:
    """transformers' DeepSeek-V3 router is sigmoid + noaux_tc whatever the config says; a config naming another
    scoring or selection was written for a different router, whose tokens this engine would not reproduce."""
    for key, want in V3_ROUTER_DEFAULTS.items():
        value = cfg.get(key)
        if value is not None and value != want:
            raise ConfigError(f"{where}: {key} {value!r} is not supported by the deepseek engine",
                              f"the engine implements {key} {want!r} (DeepSeek-V3's router)")


def engine_hparams(model: ResolvedModel) -> tuple[str, ...]:
    """The ``--set key=value`` arguments of the DeepSeek engine, resolved from config.json."""
    cfg, where = model.config, _where(model)
    if model.model_type == "deepseek_v4":
        return set_args(engine_hparams_v4(model))
    if engine_source(model) is None:
        raise ConfigError(f"{where}: no engine for {model.model_type} yet",
                          f"the deepseek engine runs {', '.join(ENGINES)}")
    r = _read_mla(cfg, where)
    _check_router(cfg, where)
    fp8.check_config(cfg, where)   # block-FP8 weights load natively (runtime fp8.h); other schemes are refused
    rope = configs.rope(cfg)
    check_rope_type(rope, where, "deepseek", ENGINE_ROPE_TYPES)
    values: dict[str, Any] = dict(
        moe_decoder_values(cfg, r, where), **grouped_router_values(cfg, where, **V3_ROUTING_DEFAULTS),
        n_shared_experts=configs.optional_int(cfg, "n_shared_experts", default=1, where=where),
        attention_bias=int(bool(cfg.get("attention_bias", False))), rope_theta=repr(rope.theta),
        rope_type=rope.rope_type, **mla_values(r, r["v_dim"]),
    )
    if model.model_type == "deepseek_v32":
        if float(values.get("rope_attention_factor", 1.0)) != 1.0:
            # The runtime scales a rotated vector whole; the indexer rotates only part of its key, which
            # transformers leaves unscaled.
            raise ConfigError(f"{where}: yarn attention factor {values['rope_attention_factor']} (mscale != "
                              "mscale_all_dim) is not supported with the DSA indexer",
                              "DeepSeek-V3.2's released config has mscale == mscale_all_dim")
        if not r["q_lora"]:
            raise ConfigError(f"{where}: deepseek_v32 needs 'q_lora_rank' (the indexer reads the q latent)",
                              "restore the checkpoint's original config.json")
        values.update(attention="dsa",
                      index_n_heads=configs.optional_int(cfg, "index_n_heads", default=64, where=where),
                      index_head_dim=configs.optional_int(cfg, "index_head_dim", default=128, where=where),
                      index_topk=configs.optional_int(cfg, "index_topk", default=2048, where=where))
    else:
        values.update(attention="mla", rope_interleave=int(bool(cfg.get("rope_interleave", True))))
    values.update(mla_rope_values(cfg, rope, r["nope_dim"] + r["rope_dim"], where))
    return set_args(values)


# transformers' DeepseekV4Config defaults, for configs that omit a field.
V4_DEFAULTS = dict(routed_scaling_factor=1.5, rms_norm_eps=1e-6, n_shared_experts=1, swiglu_limit=10.0,
                   hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, o_groups=8, o_lora_rank=1024, index_n_heads=64,
                   index_head_dim=128, index_topk=512, sliding_window=128, rope_theta=10000.0,
                   compress_rope_theta=160000.0)
V4_KIND_LETTER = {"sliding_attention": "S", "heavily_compressed_attention": "H", "compressed_sparse_attention": "C"}


def _v4_ropes(cfg: Mapping[str, Any], head_dim: int, where: str) -> dict[str, Any]:
    """The two RoPEs: "main" (sliding-window layers, default type) and "compress" (CSA/HCA layers, their
    compressors and the indexer; YaRN in the released configs, with the cos/sin factor pinned to 1 as
    transformers does). Accepts transformers' nested rope_parameters or DeepSeek's top-level fields."""
    rp = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor")
    if partial is None:
        rope_dim = cfg.get("qk_rope_head_dim")
        partial = rope_dim / head_dim if rope_dim else 64 / 512
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], dict(rp["compress"])
        main_theta = main.get("rope_theta", V4_DEFAULTS["rope_theta"])
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_parameters.main type {main.get('rope_type')!r} is not supported",
                              "DeepSeek-V4 rotates its sliding-window layers with the default RoPE")
    else:
        scaling = {k: v for k, v in (cfg.get("rope_scaling") or rp or {}).items() if k not in ("main", "compress")}
        main_theta = cfg.get("rope_theta", V4_DEFAULTS["rope_theta"])
        comp = dict(scaling, rope_theta=cfg.get("compress_rope_theta", V4_DEFAULTS["compress_rope_theta"]))
    rope_type = comp.get("rope_type", comp.get("type", "default"))
    values: dict[str, Any] = dict(main_rope_theta=repr(float(main_theta)), rope_theta=repr(float(comp["rope_theta"])),
                                  rope_type=rope_type, partial_rotary_factor=repr(float(partial)))
    if rope_type == "default":
        return values
    if rope_type != "yarn":
        raise ConfigError(f"{where}: compress rope type {rope_type!r} is not supported by the deepseek_v4 engine",
                          "the engine implements default and yarn (DeepSeek-V4's own)")
    orig = comp.get("original_max_position_embeddings")
    if not comp.get("factor") or not orig:
        raise ConfigError(f"{where}: yarn rope scaling needs 'factor' and 'original_max_position_embeddings'",
                          "restore the checkpoint's original config.json")
    values.update(rope_factor=repr(float(comp["factor"])), rope_original_max_position=int(orig),
                  rope_attention_factor=repr(float(comp.get("attention_factor", 1.0))),
                  rope_beta_fast=repr(float(comp.get("beta_fast") or 32)),
                  rope_beta_slow=repr(float(comp.get("beta_slow") or 1)),
                  rope_truncate=int(bool(comp.get("truncate", True))))
    return values


def engine_hparams_v4(model: ResolvedModel) -> dict[str, Any]:
    """The DeepSeek-V4 engine's hyperparameters (engine/deepseek_v4.c), resolved from config.json."""
    cfg, where = model.config, _where(model)
    r = _read_v4(cfg, where)
    n = r["layers"]
    scoring = cfg.get("scoring_func") or "sqrtsoftplus"
    if scoring != "sqrtsoftplus":
        raise ConfigError(f"{where}: scoring_func {scoring!r} is not supported by the deepseek_v4 engine",
                          "the engine implements DeepSeek-V4's sqrtsoftplus router")
    fp8.check_config(cfg, where)   # dense fp8 (e4m3 + block scales) loads natively through cb_load_linear
    qc = cfg.get("quantization_config") or {}
    expert_dtype = qc.get("expert_dtype", cfg.get("expert_dtype")) if isinstance(qc, Mapping) else None
    if expert_dtype not in (None, "fp8", "fp4"):
        raise ConfigError(f"{where}: expert_dtype {expert_dtype!r} is not supported by the deepseek_v4 engine",
                          "the engine reads fp4 (e2m1 + per-32 ue8m0 scales), block-fp8 or float experts")
    if r["kv_heads"] != 1:
        raise ConfigError(f"{where}: num_key_value_heads {r['kv_heads']} is not supported",
                          "DeepSeek-V4 attention shares one key=value head")
    if len(r["moe_layers"]) != n:
        raise ConfigError(f"{where}: dense MLP layers are not supported by the deepseek_v4 engine",
                          "DeepSeek-V4 routes every layer through its MoE")
    d: dict[str, Any] = {k: cfg.get(k) if cfg.get(k) is not None else v for k, v in V4_DEFAULTS.items()}
    try:
        kinds = "".join(V4_KIND_LETTER[k] for k in r["attn"])
    except KeyError as exc:
        raise ConfigError(f"{where}: layer type {exc.args[0]!r} is not a DeepSeek-V4 attention kind",
                          "use sliding_attention, compressed_sparse_attention or heavily_compressed_attention"
                          ) from None
    values: dict[str, Any] = dict(
        hidden_size=r["hidden"], num_hidden_layers=n, num_attention_heads=r["heads"],
        vocab_size=r["vocab"], head_dim=r["head_dim"],
        q_lora_rank=configs.require_int(cfg, "q_lora_rank", where=where, minimum=1),
        o_groups=int(d["o_groups"]), o_lora_rank=int(d["o_lora_rank"]), sliding_window=int(d["sliding_window"]),
        csa_rate=int(r["rates"]["compressed_sparse_attention"]),
        hca_rate=int(r["rates"]["heavily_compressed_attention"]),
        index_n_heads=int(d["index_n_heads"]), index_head_dim=int(d["index_head_dim"]),
        index_topk=int(d["index_topk"]), moe_intermediate_size=r["expert_width"], n_routed_experts=r["experts"],
        num_experts_per_tok=r["top_k"], n_shared_experts=int(d["n_shared_experts"]),
        routed_scaling_factor=repr(float(d["routed_scaling_factor"])), swiglu_limit=repr(float(d["swiglu_limit"])),
        rms_norm_eps=repr(float(d["rms_norm_eps"])), tie_word_embeddings=int(bool(cfg.get("tie_word_embeddings"))),
        hc_mult=int(d["hc_mult"]), hc_sinkhorn_iters=int(d["hc_sinkhorn_iters"]), hc_eps=repr(float(d["hc_eps"])),
        layer_kinds=kinds, mlp_layers="".join("H" if i in r["hash_layers"] else "M" for i in range(n)),
    )
    values.update(_v4_ropes(cfg, r["head_dim"], where))
    return values


@hookimpl
def engine_source(model: ResolvedModel | None) -> EngineSource | None:
    """The composition for this model's type; the MLA one (V3 / V3.2) without a model."""
    return ENGINES.get(model.model_type if model is not None else "deepseek_v3")


@hookimpl
def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv:
    return EngineEnv(args=engine_hparams(model))


@hookimpl
def parse_output(model: ResolvedModel) -> Any:
    return OutputParser(SYNTAX)


@hookimpl
def render_prompt(model: ResolvedModel, messages: Any, tools: Any, options: Any) -> str | None:
    """V4 ships its prompt format as a Python encoder, not a chat template: render it here (see ``encoding``).
    A checkpoint that carries a chat template of its own is rendered by core's default, with that template."""
    if model.model_type != "deepseek_v4":
        return None
    from colibri.chat_template import available_templates

    if available_templates(model.path):
        return None
    from .encoding import render

    return render(messages, tools, options)
