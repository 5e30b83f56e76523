"""colibri family plugin for Moonshot Kimi: ``kimi_k2`` and ``kimi_linear``.

Kimi K2 is the DeepSeek-V3 architecture under its own model_type: MLA (compressed KV), sigmoid + bias routing
with groups, a shared expert and leading dense layers. Kimi Linear is a hybrid: KDA linear attention (short
convolutions on q/k/v, low-rank forget and output gates) in most layers, MLA without RoPE in the rest; its MoE
lives under ``block_sparse_moe`` with experts stored as ``w1`` (gate) / ``w3`` (up) / ``w2`` (down).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from colibri import configs, fp8, hookimpl, source_quant
from colibri.engine_args import (
    RUNTIME_QUANT_SCHEMES, check_rope_type, grouped_router_values, kv_bytes, mla_rope_values, mla_values,
    moe_decoder_values, set_args,
)
from colibri.layouts import EXPERT_PROJ, EXPERT_W, LayoutParts, mla_attention, projections
from colibri.errors import ConfigError
from colibri.records import (
    EngineEnv, EngineSource, FamilyDescriptor, Geometry, Limits, ResolvedModel, ResourcePlan,
    TensorLayout,
)
from colibri.output_parser import OutputParser

from .syntax import SYNTAX

FAMILY = "kimi"
MODEL_TYPES = ("kimi_k2", "kimi_linear")


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, MODEL_TYPES, "Kimi (Moonshot): Kimi K2 (DeepSeek-V3 architecture), Kimi Linear")


def _linear_layer_types(cfg: Mapping[str, Any], n: int, where: str) -> tuple[str, ...]:
    """Kimi Linear's attention kind per layer: ``layer_types``, else ``linear_attn_config`` (1-indexed lists)."""
    if cfg.get("layer_types") is not None:
        return configs.attention_layer_types(cfg, n, where=where)
    lac = cfg.get("linear_attn_config") or {}
    if "full_attn_layers" in lac and "kda_layers" in lac:
        kinds: list[str | None] = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in lac[key]:
                if not isinstance(layer, int) or not 1 <= layer <= n:
                    raise ConfigError(f"{where}: linear_attn_config.{key} names layer {layer!r} of {n}",
                                      "layers there are numbered from 1; restore the original config.json")
                kinds[layer - 1] = kind
        if None in kinds:
            raise ConfigError(f"{where}: linear_attn_config leaves layer {kinds.index(None) + 1} unassigned",
                              "restore the checkpoint's original config.json")
        return tuple(k for k in kinds if k)
    # transformers' default for configs without either field
    return tuple("full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n))


def _read(model: ResolvedModel) -> dict[str, Any]:
    cfg, where = model.config, str(model.path / "config.json")
    n = configs.require_int(cfg, "num_hidden_layers", where=where, minimum=1)
    heads = configs.require_int(cfg, "num_attention_heads", where=where, minimum=1)
    linear = model.model_type == "kimi_linear"
    moe_cfg = cfg
    if linear and cfg.get("mlp_layer_types") is None and cfg.get("first_k_dense_replace") is None:
        moe_cfg = {**cfg, "first_k_dense_replace": 1}      # Kimi Linear's default: layer 0 dense
    r = dict(
        cfg=cfg, layers=n, heads=heads, linear=linear,
        hidden=configs.require_int(cfg, "hidden_size", where=where, minimum=1),
        vocab=configs.require_int(cfg, "vocab_size", where=where, minimum=1),
        experts=configs.require_int(cfg, *configs.EXPERT_COUNT_FIELDS, where=where, minimum=1),
        top_k=configs.require_int(cfg, *configs.TOP_K_FIELDS, where=where, minimum=1),
        expert_width=configs.require_int(cfg, "moe_intermediate_size", where=where, minimum=1),
        shared=configs.optional_int(cfg, "n_shared_experts", "num_shared_experts", where=where),
        nextn=configs.optional_int(cfg, "num_nextn_predict_layers", where=where),
        **configs.mla_dims(cfg, where),
        moe_layers=configs.moe_layer_indices(moe_cfg, n, where=where),
        attn=_linear_layer_types(cfg, n, where) if linear else ("full_attention",) * n,
    )
    if linear:
        # The hub config nests these in linear_attn_config; transformers saves them at top level.
        merged = {**cfg, **{k: v for k, v in (cfg.get("linear_attn_config") or {}).items()}}
        r.update(lin_heads=configs.require_int(merged, "num_heads", "linear_num_heads", where=where, minimum=1),
                 lin_dim=configs.require_int(merged, "head_dim", "linear_head_dim", where=where, minimum=1)
                 if "linear_attn_config" in cfg else configs.require_int(cfg, "linear_head_dim", where=where,
                                                                         minimum=1),
                 conv=configs.optional_int(merged, "short_conv_kernel_size", "linear_conv_kernel_dim", default=4,
                                           where=where))
    return r


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
    r = _read(model)
    cfg, n = r["cfg"], r["layers"]
    full = [i for i, kind in enumerate(r["attn"]) if kind == "full_attention"]
    kv = kv_bytes(len(full) * (r["kv_lora"] + r["rope_dim"]))
    state = 0
    groups = configs.first_of(cfg, "n_group", "num_expert_group", default=1)
    renorm = configs.first_of(cfg, "norm_topk_prob", "moe_renormalize", default=True)
    notes = [("router", f"sigmoid + bias, {groups} groups, keep {cfg.get('topk_group', 1)}"
                        f"{', renormalised' if renorm else ''} × {cfg.get('routed_scaling_factor', 1.0)}")]
    if r["linear"]:
        width = r["lin_heads"] * r["lin_dim"]
        per_layer = kv_bytes(3 * width * (r["conv"] - 1) + r["lin_heads"] * r["lin_dim"] * r["lin_dim"])
        # x 2: the engine checkpoints each slot's state at the end of every prompt (as for the Qwen hybrids).
        state = 2 * per_layer * (n - len(full))
        notes.insert(0, ("layers", f"{n - len(full)} KDA + {len(full)} MLA (no RoPE)"))
        notes.insert(0, ("recurrent state", f"{state:,} B per slot (q/k/v conv windows + delta-rule memory of each "
                                            "KDA layer, and its end-of-prompt checkpoint)"))
        attention = "KDA linear attention + MLA"
    else:
        notes.append(("rope", f"theta {configs.rope(cfg).theta:g} ({configs.rope(cfg).rope_type})"))
        attention = "MLA (compressed KV)"
    return Geometry(
        model_type=model.model_type, architecture="Kimi MoE decoder" + (" (hybrid)" if r["linear"] else ""),
        attention=attention, num_layers=n, hidden_size=r["hidden"], vocab_size=r["vocab"], num_heads=r["heads"],
        num_kv_heads=r["heads"], head_dim=r["nope_dim"] + r["rope_dim"], num_experts=r["experts"], top_k=r["top_k"],
        expert_intermediate=r["expert_width"], num_shared_experts=r["shared"], moe_layers=r["moe_layers"],
        dense_layers=tuple(i for i in range(n) if i not in r["moe_layers"]), max_context=configs.max_context(cfg),
        kv_bytes_per_token=kv, state_bytes_per_slot=state, notes=tuple(notes),
    )


def _kda(sa: str) -> tuple[list[str], list[str]]:
    weights = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "b_proj", "f_a_proj", "f_b_proj",
               "g_a_proj", "g_b_proj", "o_proj")
    return [sa + "o_norm.weight"], [f"{sa}{w}.weight" for w in weights] + [sa + "A_log", sa + "dt_bias"]


def _dense_prefix(model: ResolvedModel, layer: str) -> str:
    """Where a Kimi Linear dense layer lives: ``mlp.`` in the original checkpoints, ``block_sparse_moe.`` in
    transformers' saves (it renames every ``mlp.`` so). Read from the shard index or headers; the engine probes the
    same way."""
    names = fp8.tensor_names(model.path)
    stem = layer + "mlp.gate_proj"
    return layer + ("mlp." if stem + ".weight" in names or stem + ".qweight" in names else "block_sparse_moe.")


@hookimpl
def tensor_layout(model: ResolvedModel) -> TensorLayout:
    r = _read(model)
    moe_name = "block_sparse_moe." if r["linear"] else "mlp."
    parts = LayoutParts()
    for i in range(r["layers"]):
        p = f"model.layers.{i}."
        full = r["attn"][i] == "full_attention"
        parts.layer(p, mla_attention(p + "self_attn.", r["q_lora"]) if full else _kda(p + "self_attn."))
        m = p + moe_name
        if i in r["moe_layers"]:
            parts.moe(i, m, r["experts"], r["shared"], EXPERT_W if r["linear"] else EXPERT_PROJ)
        else:
            parts.required += projections(_dense_prefix(model, p) if r["linear"] else m)
    # Which weights are fp8 / int4-packed is read from the checkpoint (scale companions, _packed tensors), never
    # from names; an expert's scales belong to its bytes (a cache slot holds them); scales are buffers.
    parts.add_source_quant(model.path, r["cfg"], str(model.path / "config.json"))
    return parts.layout(r["cfg"], r["layers"], r["nextn"])



@hookimpl
def limits(model: ResolvedModel) -> Limits:
    if engine_source(model) is not None:
        return Limits(max_context=configs.max_context(model.config), has_engine=True,
                      quant_schemes=RUNTIME_QUANT_SCHEMES)
    return Limits(max_context=configs.max_context(model.config), has_engine=False,
                  reason_no_engine=f"no engine for {model.model_type}")


RUNTIME_API = 1   # the colibri runtime C API the engine sources are written for (CB_RUNTIME_API, runtime/api.h)
ENGINE_C = Path(__file__).parent / "engine" / "kimi.c"
ENGINE_LINEAR_C = Path(__file__).parent / "engine" / "kimi_linear.c"
# One binary per composition, each from its own file: Kimi K2 (kimi.c) and Kimi Linear (kimi_linear.c).
ENGINES = {"kimi_k2": EngineSource(name="colibri-kimi", sources=(ENGINE_C,), runtime_api=RUNTIME_API),
           "kimi_linear": EngineSource(name="colibri-kimi-linear", sources=(ENGINE_LINEAR_C,), runtime_api=RUNTIME_API)}
# RoPE types the engine implements (colibri runtime blocks.c cb_rope_init); anything else is refused here.
ENGINE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Kimi K2 ships DeepSeek-V3's config class: its defaults apply to omitted fields, and its router is sigmoid +
# noaux_tc whatever the config says.
K2_DEFAULTS: dict[str, Any] = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
K2_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def engine_hparams(model: ResolvedModel) -> tuple[str, ...]:
    """The ``--set key=value`` arguments of the Kimi K2 engine, resolved from config.json."""
    where = str(model.path / "config.json")
    if engine_source(model) is None:
        raise ConfigError(f"{where}: no engine for {model.model_type} yet",
                          f"the kimi engine runs {', '.join(ENGINES)}")
    r = _read(model)
    source_quant.check_config(r["cfg"], where)   # block-FP8 and int4-packed weights load natively; others refused
    if r["linear"]:
        return _linear_hparams(model, r, where)
    cfg = r["cfg"]
    for key, want in K2_ROUTER.items():
        if cfg.get(key) is not None and cfg[key] != want:
            raise ConfigError(f"{where}: {key} {cfg[key]!r} is not supported by the kimi engine",
                              f"the engine implements {key} {want!r} (the DeepSeek-V3 router Kimi K2 uses)")
    rope = configs.rope(cfg)
    check_rope_type(rope, where, "kimi", ENGINE_ROPE_TYPES)
    values: dict[str, Any] = dict(
        moe_decoder_values(cfg, r, where), **grouped_router_values(cfg, where, **K2_DEFAULTS),
        attention_bias=int(bool(cfg.get("attention_bias", False))), rope_theta=repr(rope.theta),
        rope_type=rope.rope_type, **mla_values(r, configs.require_int(cfg, "v_head_dim", where=where, minimum=1)),
        rope_interleave=int(bool(cfg.get("rope_interleave", True))),
    )
    values.update(mla_rope_values(cfg, rope, r["nope_dim"] + r["rope_dim"], where))
    return set_args(values)


def _linear_hparams(model: ResolvedModel, r: dict[str, Any], where: str) -> tuple[str, ...]:
    """Kimi Linear's ``--set`` arguments. Its MLA has no RoPE at all (no rope settings); defaults are
    KimiLinearConfig's."""
    cfg = r["cfg"]
    values: dict[str, Any] = dict(
        moe_decoder_values(cfg, r, where), **grouped_router_values(cfg, where, routed_scaling_factor=2.446),
        **mla_values(r, configs.require_int(cfg, "v_head_dim", where=where, minimum=1)),
        linear_num_heads=r["lin_heads"], linear_head_dim=r["lin_dim"], linear_conv_kernel_dim=r["conv"],
        attn_layers="".join("F" if kind == "full_attention" else "K" for kind in r["attn"]),
    )
    if cfg.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is not supported by the kimi_linear engine",
                          "Kimi Linear checkpoints have no attention biases; restore the original config.json")
    return set_args(values)


@hookimpl
def engine_source(model: ResolvedModel | None) -> EngineSource | None:
    """The composition for this model's type; Kimi K2's without a model."""
    return ENGINES.get(model.model_type if model is not None else "kimi_k2")


@hookimpl
def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv:
    return EngineEnv(args=engine_hparams(model))


@hookimpl
def load_tokenizer(model: ResolvedModel) -> Any:
    # Kimi checkpoints ship tiktoken.model and a Python tokenizer class, not tokenizer.json: convert the ranks
    # (cached as a sidecar) rather than run checkpoint code. None (no tiktoken.model) lets core read tokenizer.json.
    from .tokenizer import load_tiktoken_tokenizer

    return load_tiktoken_tokenizer(model.path, model.config)


@hookimpl
def parse_output(model: ResolvedModel) -> Any:
    return OutputParser(SYNTAX)
