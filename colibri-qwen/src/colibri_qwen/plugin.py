"""colibri family plugin for the Qwen MoE families.

``qwen2_moe`` (Qwen1.5-MoE, Qwen2-57B-A14B), ``qwen3_moe`` (Qwen3-30B-A3B, 235B-A22B), ``qwen3_next``
(Qwen3-Next-80B-A3B) and ``qwen3_5_moe`` / ``qwen3_5_moe_text`` (Qwen3.5 / 3.6 MoE). All route with a softmax over
the experts; the hybrids interleave Gated DeltaNet linear attention with gated full attention, so only their
full-attention layers hold a KV cache and the linear layers keep a fixed recurrent state per sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from colibri import configs, hookimpl
from colibri.engine_args import RUNTIME_QUANT_SCHEMES, kv_bytes, rope_values, set_args
from colibri.errors import ConfigError
from colibri.records import (
    EngineEnv, EngineSource, ExpertTensors, FamilyDescriptor, Geometry, Limits, PreTokenizerSplit, ResolvedModel,
    ResourcePlan, TensorLayout,
)
from colibri.output_parser import OutputParser

from .syntax import SYNTAX

FAMILY = "qwen"
MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
HYBRIDS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
WRAPPERS = ("qwen3_5_moe",)        # multimodal: LM under text_config and model.language_model.


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, MODEL_TYPES,
                            "Qwen MoE: Qwen1.5/2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5/3.6-MoE (text part)")


def _where(model: ResolvedModel) -> str:
    return str(model.path / "config.json") + (" (text_config)" if model.model_type in WRAPPERS else "")


def _read(model: ResolvedModel) -> dict[str, Any]:
    """Every number the hooks need, read once from whichever spelling the config uses."""
    cfg, where = configs.text_config(model.config), _where(model)
    hidden = configs.require_int(cfg, "hidden_size", where=where, minimum=1)
    heads = configs.require_int(cfg, "num_attention_heads", where=where, minimum=1)
    n = configs.require_int(cfg, "num_hidden_layers", where=where, minimum=1)
    hybrid = model.model_type in HYBRIDS
    r = dict(
        cfg=cfg, where=where, layers=n, hidden=hidden, heads=heads, hybrid=hybrid,
        vocab=configs.require_int(cfg, "vocab_size", where=where, minimum=1),
        kv_heads=configs.optional_int(cfg, "num_key_value_heads", default=heads, where=where),
        head_dim=configs.optional_int(cfg, "head_dim", default=hidden // heads, where=where),
        experts=configs.require_int(cfg, *configs.EXPERT_COUNT_FIELDS, where=where, minimum=1),
        top_k=configs.require_int(cfg, *configs.TOP_K_FIELDS, where=where, minimum=1),
        expert_width=configs.require_int(cfg, "moe_intermediate_size", where=where, minimum=1),
        shared_width=configs.optional_int(cfg, "shared_expert_intermediate_size", where=where),
        moe_layers=configs.moe_layer_indices(cfg, n, where=where),
        attn=configs.attention_layer_types(cfg, n, default_interval=4 if hybrid else 0, where=where),
    )
    if hybrid:
        r.update(
            lin_k_heads=configs.require_int(cfg, "linear_num_key_heads", where=where, minimum=1),
            lin_v_heads=configs.require_int(cfg, "linear_num_value_heads", where=where, minimum=1),
            lin_k_dim=configs.require_int(cfg, "linear_key_head_dim", where=where, minimum=1),
            lin_v_dim=configs.require_int(cfg, "linear_value_head_dim", where=where, minimum=1),
            conv_kernel=configs.optional_int(cfg, "linear_conv_kernel_dim", default=4, where=where),
        )
    return r


def _is_full(kind: str) -> bool:
    return kind in ("full_attention", "attention", "sliding_attention")


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
    r = _read(model)
    cfg = r["cfg"]
    full_layers = [i for i, kind in enumerate(r["attn"]) if _is_full(kind)]
    kv = kv_bytes(len(full_layers) * 2 * r["kv_heads"] * r["head_dim"])
    state = 0
    notes = []
    if r["hybrid"]:
        conv_dim = 2 * r["lin_k_heads"] * r["lin_k_dim"] + r["lin_v_heads"] * r["lin_v_dim"]
        per_layer = kv_bytes(conv_dim * (r["conv_kernel"] - 1) + r["lin_v_heads"] * r["lin_k_dim"] * r["lin_v_dim"])
        # x 2: the engine checkpoints each slot's state at the end of every prompt, so a chat turn whose reply
        # re-tokenizes differently can still resume from the history before it.
        state = 2 * per_layer * (r["layers"] - len(full_layers))
        notes.append(("recurrent state", f"{state:,} B per slot (conv window + delta-rule memory of each "
                                         "Gated DeltaNet layer, and its end-of-prompt checkpoint)"))
        notes.append(("layers", f"{r['layers'] - len(full_layers)} Gated DeltaNet + {len(full_layers)} full attention"))
    rope = configs.rope(cfg)
    # Qwen3.5 always renormalises the top-k weights (its config has no switch); the others follow the flag, whose
    # default is on only for Qwen3-Next.
    always = model.model_type in ("qwen3_5_moe", "qwen3_5_moe_text")
    renorm = always or bool(cfg.get("norm_topk_prob", model.model_type == "qwen3_next"))
    notes += [("router", "softmax top-k" + (", renormalised" if renorm else "")),
              ("rope", f"theta {rope.theta:g}" + (f", partial {rope.partial_rotary_factor:g}"
                                                   if rope.partial_rotary_factor != 1.0 else ""))]
    if r["shared_width"]:
        notes.append(("shared expert", f"width {r['shared_width']}, sigmoid-gated"))
    if model.model_type in WRAPPERS:
        notes.append(("vision tower", "present, not loaded (text only)"))
    if model.model_type == "qwen2_moe":
        attention = "GQA + RoPE, qkv bias" if cfg.get("qkv_bias", True) else "GQA + RoPE"
    elif r["hybrid"]:
        attention = "Gated DeltaNet (linear) + gated GQA with q/k norm"
    else:
        attention = "GQA + RoPE, per-head q/k RMSNorm"
    moe = r["moe_layers"]
    return Geometry(
        model_type=model.model_type, architecture="Qwen MoE decoder" + (" (hybrid)" if r["hybrid"] else ""),
        attention=attention, num_layers=r["layers"], hidden_size=r["hidden"], vocab_size=r["vocab"],
        num_heads=r["heads"], num_kv_heads=r["kv_heads"], head_dim=r["head_dim"], num_experts=r["experts"],
        top_k=r["top_k"], expert_intermediate=r["expert_width"], num_shared_experts=1 if r["shared_width"] else 0,
        moe_layers=moe, dense_layers=tuple(i for i in range(r["layers"]) if i not in moe),
        max_context=configs.max_context(cfg), kv_bytes_per_token=kv, state_bytes_per_slot=state, notes=tuple(notes),
    )


def _attention(model_type: str, cfg: Mapping[str, Any], kind: str, p: str) -> tuple[list[str], list[str]]:
    """(norm tensors, other tensors) of one layer's attention block."""
    if not _is_full(kind):
        la = p + "linear_attn."
        if model_type == "qwen3_next":
            proj = ["in_proj_qkvz.weight", "in_proj_ba.weight"]
        else:
            proj = ["in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight"]
        return [la + "norm.weight"], [la + t for t in proj + ["conv1d.weight", "A_log", "dt_bias", "out_proj.weight"]]
    sa = p + "self_attn."
    weights = [f"{sa}{x}_proj.weight" for x in "qkvo"]
    if model_type == "qwen2_moe":
        biases = [f"{sa}{x}_proj.bias" for x in "qkv"] if cfg.get("qkv_bias", True) else []
        return [], weights + biases
    biases = [f"{sa}{x}_proj.bias" for x in "qkvo"] if cfg.get("attention_bias", False) else []
    return [sa + "q_norm.weight", sa + "k_norm.weight"], weights + biases


@hookimpl
def tensor_layout(model: ResolvedModel) -> TensorLayout:
    r = _read(model)
    cfg = r["cfg"]
    wrapper = model.model_type in WRAPPERS
    base = "model.language_model." if wrapper else "model."
    tied = bool(configs.first_of(cfg, "tie_word_embeddings", default=model.config.get("tie_word_embeddings", False)))
    norms, routers, experts, required = [base + "norm.weight"], [], [], []
    for i in range(r["layers"]):
        p = f"{base}layers.{i}."
        norms += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        attn_norms, attn = _attention(model.model_type, cfg, r["attn"][i], p)
        norms += attn_norms
        required += attn
        m = p + "mlp."
        if i not in r["moe_layers"]:
            required += [f"{m}{x}_proj.weight" for x in ("gate", "up", "down")]
            continue
        routers.append((i, m + "gate.weight"))
        for e in range(r["experts"]):
            q = f"{m}experts.{e}."
            experts.append(ExpertTensors(i, e, (q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight")))
        if r["shared_width"]:
            required += [f"{m}shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
            required.append(m + "shared_expert_gate.weight")
    embed = base + "embed_tokens.weight"
    skipped: tuple[str, ...] = ("mtp.",) if r["hybrid"] else ()
    if wrapper:
        skipped += ("model.visual.", "visual.")
    return TensorLayout(embeddings=(embed,) if tied else (embed, "lm_head.weight"),
                        lm_head=None if tied else "lm_head.weight", norms=tuple(norms), routers=tuple(routers),
                        experts=tuple(experts), required=tuple(required), skipped_prefixes=skipped,
                        paged=() if tied else (embed,))



@hookimpl
def limits(model: ResolvedModel) -> Limits:
    return Limits(max_context=configs.max_context(configs.text_config(model.config)),
                  has_engine=engine_source(model) is not None, quant_schemes=RUNTIME_QUANT_SCHEMES)


RUNTIME_API = 1   # the colibri runtime C API the engine sources are written for (CB_RUNTIME_API, runtime/api.h)
ENGINE_C = Path(__file__).parent / "engine" / "qwen.c"
# RoPE types the engine implements (colibri runtime blocks.c cb_rope_init); anything else is refused here.
ENGINE_ROPE_TYPES = ("default", "linear", "llama3")


@hookimpl
def engine_source(model: ResolvedModel | None) -> EngineSource:
    return EngineSource(name="colibri-qwen", sources=(ENGINE_C,), runtime_api=RUNTIME_API)


def _rope_args(cfg: Mapping[str, Any], where: str, hybrid: bool) -> dict[str, Any]:
    # Qwen3-Next / Qwen3.5 rotate a quarter of each head unless the config says otherwise (transformers' default).
    rope = configs.rope(cfg, default_partial=0.25 if hybrid else 1.0)
    # Qwen3.5's M-RoPE sections rotate by (t, h, w) positions; for text all three equal the token position, so
    # M-RoPE is plain RoPE over the same frequencies and mrope_section needs no engine support.
    return rope_values(cfg, rope, where, FAMILY, ENGINE_ROPE_TYPES)


def engine_hparams(model: ResolvedModel) -> tuple[str, ...]:
    """The ``--set key=value`` arguments of the qwen engine, resolved from config.json."""
    r = _read(model)
    cfg, where, mt = r["cfg"], r["where"], model.model_type
    kinds = r["attn"]
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    if sliding or cfg.get("use_sliding_window"):
        raise ConfigError(f"{where}: sliding-window attention (use_sliding_window / layer_types) is not supported "
                          "by the qwen engine", "use the checkpoint's full-attention configuration")
    unknown = sorted({k for k in kinds if k not in ("full_attention", "attention", "linear_attention")})
    if unknown:
        raise ConfigError(f"{where}: layer_types has {', '.join(map(repr, unknown))}",
                          "expected full_attention or linear_attention")
    dense_layers = [i for i in range(r["layers"]) if i not in r["moe_layers"]]
    tied = bool(configs.first_of(cfg, "tie_word_embeddings", default=model.config.get("tie_word_embeddings", False)))
    values: dict[str, Any] = dict(
        hidden_size=r["hidden"], num_hidden_layers=r["layers"], num_attention_heads=r["heads"],
        num_key_value_heads=r["kv_heads"], head_dim=r["head_dim"], vocab_size=r["vocab"], num_experts=r["experts"],
        num_experts_per_tok=r["top_k"], moe_intermediate_size=r["expert_width"],
        rms_norm_eps=repr(float(cfg.get("rms_norm_eps", 1e-6))), tie_word_embeddings=int(tied),
        norm_topk_prob=int(mt in ("qwen3_5_moe", "qwen3_5_moe_text")
                           or bool(cfg.get("norm_topk_prob", mt == "qwen3_next"))),
        **_rope_args(cfg, where, r["hybrid"]),
    )
    if dense_layers:
        values["intermediate_size"] = configs.require_int(cfg, "intermediate_size", where=where, minimum=1)
        values["mlp_only_layers"] = ",".join(map(str, dense_layers))
    if r["shared_width"] and mt != "qwen3_moe":
        values["shared_expert_intermediate_size"] = r["shared_width"]
    if mt == "qwen2_moe":
        values["qkv_bias"] = int(bool(cfg.get("qkv_bias", True)))
    else:
        values["qk_norm"] = 1
        values["attention_bias"] = int(bool(cfg.get("attention_bias", False)))
    if r["hybrid"]:
        values.update(
            zero_centered_norm=1, attn_output_gate=1,
            layer_types=",".join("linear_attention" if k == "linear_attention" else "full_attention" for k in kinds),
        )
    # Any layer pattern the config allows (all full attention included) runs; the engine reads the linear
    # geometry only when some layer needs it, and refuses --set keys it never read.
    if r["hybrid"] and "linear_attention" in kinds:
        values.update(
            linear_projection="fused" if mt == "qwen3_next" else "split",
            linear_num_key_heads=r["lin_k_heads"], linear_num_value_heads=r["lin_v_heads"],
            linear_key_head_dim=r["lin_k_dim"], linear_value_head_dim=r["lin_v_dim"],
            linear_conv_kernel_dim=r["conv_kernel"],
        )
    if model.model_type in WRAPPERS:
        values["weight_prefix"] = "model.language_model."
    return set_args(values)


@hookimpl
def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv:
    return EngineEnv(args=engine_hparams(model))


@hookimpl
def parse_output(model: ResolvedModel) -> Any:
    return OutputParser(SYNTAX)


# transformers' Qwen2Tokenizer (slow and fast): NFC, then this split, then byte-level BPE without GPT-2's own regex.
# Qwen checkpoints ship tokenizer.json; vocab.json + merges.txt alone come from older saves and pipeline folders.
QWEN2_TOKENIZER_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
QWEN2_SPLIT = PreTokenizerSplit(
    pattern=(r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
             r"""\s*[\r\n]+|\s+(?!\S)|\s+"""),
    nfc=True)


@hookimpl
def byte_level_split(tokenizer_class: str) -> PreTokenizerSplit | None:
    return QWEN2_SPLIT if tokenizer_class in QWEN2_TOKENIZER_CLASSES else None
