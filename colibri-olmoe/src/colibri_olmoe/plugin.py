"""colibri family plugin for OLMoE (``model_type: olmoe``).

OLMoE-1B-7B: every layer is MoE (softmax router over all experts, top-k, renormalised only with
``norm_topk_prob``), attention is MHA/GQA with RoPE and q/k RMSNorm over the full projected width, no shared
experts and no dense layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from colibri import configs, hookimpl
from colibri.engine_args import RUNTIME_QUANT_SCHEMES, kv_bytes, rope_values, set_args
from colibri.records import (
    DemoModel, EngineEnv, EngineSource, ExpertTensors, FamilyDescriptor, Geometry, Limits, ResolvedModel,
    ResourcePlan, TensorLayout,
)

FAMILY = "olmoe"
MODEL_TYPES = ("olmoe",)
NANO_DIR = Path(__file__).parent / "nano"    # colibri-nano, trained by training/train_nano.py (package data)
NANO_INT8_DIR = NANO_DIR.with_name("nano-int8")  # the same model as a colibri int8 container: what `coli demo` runs
DEMO_PROMPT = "def fibonacci(n):"


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, MODEL_TYPES, "OLMoE (AllenAI) sparse MoE decoders, e.g. OLMoE-1B-7B")


def _where(model: ResolvedModel) -> str:
    return str(model.path / "config.json")


def _dims(cfg: Mapping[str, Any], where: str) -> dict[str, int]:
    hidden = configs.require_int(cfg, "hidden_size", where=where, minimum=1)
    heads = configs.require_int(cfg, "num_attention_heads", where=where, minimum=1)
    return dict(
        layers=configs.require_int(cfg, "num_hidden_layers", where=where, minimum=1),
        hidden=hidden,
        vocab=configs.require_int(cfg, "vocab_size", where=where, minimum=1),
        heads=heads,
        kv_heads=configs.optional_int(cfg, "num_key_value_heads", default=heads, where=where),
        head_dim=configs.optional_int(cfg, "head_dim", default=hidden // heads, where=where),
        experts=configs.require_int(cfg, *configs.EXPERT_COUNT_FIELDS, where=where, minimum=1),
        top_k=configs.require_int(cfg, *configs.TOP_K_FIELDS, where=where, minimum=1),
        expert_width=configs.require_int(cfg, "intermediate_size", where=where, minimum=1),
    )


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
    cfg, where = model.text_config, _where(model)
    d = _dims(cfg, where)
    rope = configs.rope(cfg)
    clip = cfg.get("clip_qkv")
    return Geometry(
        model_type=model.model_type, architecture="OLMoE decoder", attention="MHA/GQA + RoPE, q/k RMSNorm",
        num_layers=d["layers"], hidden_size=d["hidden"], vocab_size=d["vocab"], num_heads=d["heads"],
        num_kv_heads=d["kv_heads"], head_dim=d["head_dim"], num_experts=d["experts"], top_k=d["top_k"],
        expert_intermediate=d["expert_width"], num_shared_experts=0, moe_layers=tuple(range(d["layers"])),
        dense_layers=(), max_context=configs.max_context(cfg),
        kv_bytes_per_token=kv_bytes(2 * d["kv_heads"] * d["head_dim"] * d["layers"]),
        notes=(("router", "softmax top-k" + (", renormalised" if cfg.get("norm_topk_prob") else "")),
               ("rope theta", f"{rope.theta:g}"),
               ("clip_qkv", "off" if clip is None else f"{clip:g}")),
    )


@hookimpl
def tensor_layout(model: ResolvedModel) -> TensorLayout:
    cfg, where = model.text_config, _where(model)
    d = _dims(cfg, where)
    tied = bool(cfg.get("tie_word_embeddings", False))
    bias = bool(cfg.get("attention_bias", False))
    hidden, q_width, kv_width = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    shapes = {"model.embed_tokens.weight": (d["vocab"], hidden), "lm_head.weight": (d["vocab"], hidden),
              "model.norm.weight": (hidden,)}
    norms = ["model.norm.weight"]
    routers, experts, required = [], [], []
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        norms += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_norm.weight": (q_width,), p + "self_attn.k_norm.weight": (kv_width,),
                       p + "mlp.gate.weight": (d["experts"], hidden)})
        for proj, rows, cols in (("q_proj", q_width, hidden), ("k_proj", kv_width, hidden),
                                 ("v_proj", kv_width, hidden), ("o_proj", hidden, q_width)):
            required.append(f"{p}self_attn.{proj}.weight")
            shapes[f"{p}self_attn.{proj}.weight"] = (rows, cols)
            if bias:
                required.append(f"{p}self_attn.{proj}.bias")
                shapes[f"{p}self_attn.{proj}.bias"] = (rows,)
        routers.append((i, p + "mlp.gate.weight"))
        for e in range(d["experts"]):
            q = f"{p}mlp.experts.{e}."
            experts.append(ExpertTensors(i, e, (q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight")))
    embeddings = ("model.embed_tokens.weight",) if tied else ("model.embed_tokens.weight", "lm_head.weight")
    width = d["expert_width"]
    return TensorLayout(embeddings=embeddings, lm_head=None if tied else "lm_head.weight", norms=tuple(norms),
                        routers=tuple(routers), experts=tuple(experts), required=tuple(required), shapes=shapes,
                        expert_shapes=((width, hidden), (width, hidden), (hidden, width)),
                        paged=() if tied else ("model.embed_tokens.weight",))



@hookimpl
def limits(model: ResolvedModel) -> Limits:
    return Limits(max_context=configs.max_context(model.text_config),
                  has_engine=engine_source(model) is not None,
                  quant_schemes=RUNTIME_QUANT_SCHEMES)


RUNTIME_API = 1   # the colibri runtime C API the engine sources are written for (CB_RUNTIME_API, runtime/api.h)
ENGINE_C = Path(__file__).parent / "engine" / "olmoe.c"
# RoPE types the engine implements (colibri runtime blocks.c cb_rope_init); anything else is refused here.
ENGINE_ROPE_TYPES = ("default", "linear", "llama3")


@hookimpl
def engine_source(model: ResolvedModel | None) -> EngineSource:
    return EngineSource(name="colibri-olmoe", sources=(ENGINE_C,), runtime_api=RUNTIME_API)


def engine_hparams(model: ResolvedModel) -> tuple[str, ...]:
    """The ``--set key=value`` arguments of the OLMoE engine, resolved from config.json."""
    cfg, where = model.text_config, _where(model)
    d = _dims(cfg, where)
    eps = configs.require_number(cfg, "rms_norm_eps", 1e-5, where=where)
    values: dict[str, Any] = {
        "hidden_size": d["hidden"], "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"], "head_dim": d["head_dim"], "intermediate_size": d["expert_width"],
        "num_experts": d["experts"], "num_experts_per_tok": d["top_k"], "vocab_size": d["vocab"],
        "rms_norm_eps": repr(float(eps)), "norm_topk_prob": int(bool(cfg.get("norm_topk_prob", False))),
        "tie_word_embeddings": int(bool(cfg.get("tie_word_embeddings", False))),
        "attention_bias": int(bool(cfg.get("attention_bias", False))),
        **rope_values(cfg, configs.rope(cfg), where, FAMILY, ENGINE_ROPE_TYPES),
    }
    clip = cfg.get("clip_qkv")
    if clip is not None:
        values["clip_qkv"] = repr(float(clip))
    return set_args(values)


@hookimpl
def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv:
    return EngineEnv(args=engine_hparams(model))


def _nano_copy(cache_dir: Path) -> Path:
    import hashlib
    import shutil

    from colibri.demo import ensure_directory

    files = sorted(p for p in NANO_INT8_DIR.iterdir() if p.is_file() and not p.name.startswith("."))
    # Named by the shipped metrics and file sizes, so an upgraded package never runs a stale copy.
    stamp = hashlib.sha256((NANO_DIR / "metrics.json").read_bytes()
                           + repr([(p.name, p.stat().st_size) for p in files]).encode()).hexdigest()[:12]

    def copy(out: Path) -> None:
        out.mkdir(parents=True)
        for p in files:
            shutil.copyfile(p, out / p.name)

    path, built = ensure_directory(cache_dir / f"colibri-nano-int8-{stamp}", copy)
    if built:   # copies of earlier releases of the model are dead weight now
        for old in cache_dir.glob("colibri-nano-*"):
            if old != path and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    return path


def synthetic_spec():
    """The shape of ``coli demo --synthetic``'s model (a function so tests can swap in a tiny one)."""
    from .synthetic import DemoSpec

    return DemoSpec()


@hookimpl
def demo_model(cache_dir: Path, synthetic: bool) -> DemoModel | None:
    if synthetic:
        from .synthetic import ensure_checkpoint

        spec = synthetic_spec()
        path, _ = ensure_checkpoint(cache_dir, spec)
        return DemoModel(path, f"a synthetic OLMoE-architecture model with RANDOM weights "
                               f"(~{spec.total_bytes / 1e6:.0f} MB, written once)", DEMO_PROMPT, is_random=True)
    if not (NANO_INT8_DIR / "config.json").exists():
        return None
    # Run a copy in the cache, not the package directory: the engine saves its learned hot set (pinning) next to
    # the weights, and site-packages may be read-only (or, editable, a source checkout).
    path = _nano_copy(cache_dir)
    return DemoModel(path, "colibri-nano, a small OLMoE trained on the Python standard library "
                               "(bundled with colibri-olmoe as an int8 container)", DEMO_PROMPT, is_random=False)
