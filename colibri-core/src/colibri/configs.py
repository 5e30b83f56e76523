"""Generic readers for config.json fields that real checkpoints spell in several ways.

Family plugins use these so every spelling is handled once: ``rope_parameters`` (transformers 5 saves) vs
top-level ``rope_theta`` / ``partial_rotary_factor`` / ``rope_scaling`` (hub configs); expert counts as
``num_experts`` / ``num_local_experts`` / ``n_routed_experts``; dense/sparse layouts as ``first_k_dense_replace``,
``mlp_only_layers`` + ``decoder_sparse_step`` or ``mlp_layer_types``; hybrid attention as ``layer_types`` or
``full_attention_interval``. Nothing here knows about any particular family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

from .errors import ConfigError

_MISSING = object()

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
CONTEXT_FIELDS = ("max_position_embeddings", "model_max_length", "max_sequence_length", "seq_length")
LAYER_COUNT_FIELDS = ("num_hidden_layers", "num_layers", "n_layers", "n_layer")
KV_HEAD_FIELDS = ("num_key_value_heads",)
HEAD_FIELDS = ("num_attention_heads",)
GROUP_FIELDS = ("n_group", "num_expert_group")

# Every size-like field a family may size something from, with the largest value colibri accepts. The bounds are
# far above any real checkpoint (DeepSeek-V3: 61 layers, 256 experts, vocab 129k; Llama 4: 10M context) and far
# below what makes a table of names or a per-layer tuple expensive; sizes are then checked against the tensors on
# disk (colibri.validation) before a tensor layout is built from them.
MAX_LAYERS = 1 << 14
MAX_EXPERTS = 1 << 16
MAX_HEADS = 1 << 14
MAX_WIDTH = 1 << 20
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 28
MAX_INT = (1 << 31) - 1        # any other integer a family reads with require_int

SIZE_BOUNDS: dict[str, int] = {
    **dict.fromkeys(LAYER_COUNT_FIELDS + ("num_nextn_predict_layers", "first_k_dense_replace", "num_hash_layers",
                                          "moe_layer_freq", "decoder_sparse_step", "full_attention_interval"),
                    MAX_LAYERS),
    **dict.fromkeys(EXPERT_COUNT_FIELDS + TOP_K_FIELDS + GROUP_FIELDS + ("topk_group", "n_shared_experts",
                                                                         "num_shared_experts"), MAX_EXPERTS),
    **dict.fromkeys(HEAD_FIELDS + KV_HEAD_FIELDS + ("n_head", "index_n_heads", "linear_num_key_heads",
                                                    "linear_num_value_heads"), MAX_HEADS),
    **dict.fromkeys(("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "index_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"),
                    MAX_WIDTH),
    "vocab_size": MAX_VOCAB,
    **dict.fromkeys(CONTEXT_FIELDS + ("sliding_window", "index_topk"), MAX_CONTEXT),
}
# Floats an engine takes as given: (smallest, largest, whether the smallest itself is allowed).
FLOAT_BOUNDS: dict[str, tuple[float, float, bool]] = {
    **dict.fromkeys(("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"), (0.0, 1.0, False)),
    "rope_theta": (0.0, math.inf, False),
    "partial_rotary_factor": (0.0, 1.0, False),
    "routed_scaling_factor": (0.0, math.inf, True),
    "clip_qkv": (0.0, math.inf, False),
    "factor": (0.0, math.inf, False),          # rope scaling
}
# Floats families read as ``float(cfg.get(name, default))``: present but null is an error, not the default.
NON_NULL_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "routed_scaling_factor")
BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "attention_bias", "mlp_bias")
NESTED_ROPE_FIELDS = ("rope_parameters", "rope_scaling")
RESTORE_HINT = "restore the checkpoint's original config.json"


def first_of(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The value of the first of ``names`` present in ``config`` and not null, else ``default``."""
    for name in names:
        value = config.get(name, _MISSING)
        if value is not _MISSING and value is not None:
            return value
    return default


def require(config: Mapping[str, Any], *names: str, where: str = "config.json") -> Any:
    """Like :func:`first_of`, but a missing field is a :class:`ConfigError` naming every accepted spelling."""
    value = first_of(config, *names)
    if value is None:
        spelled = " / ".join(repr(n) for n in names)
        raise ConfigError(f"{where}: missing {spelled}",
                          "restore the checkpoint's original config.json (the field is required)")
    return value


def _is_integer(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and int(value) == value)


def present_name(config: Mapping[str, Any], *names: str) -> str:
    """The first of ``names`` the config spells (not null), else the first of ``names``: for error messages."""
    return next((n for n in names if config.get(n) is not None), names[0])


def require_int(config: Mapping[str, Any], *names: str, where: str = "config.json", minimum: int = 0,
                maximum: int | None = None) -> int:
    """An integer field (first of ``names``) that must be present and in ``[minimum, maximum]``.

    ``maximum`` defaults to the field's bound in :data:`SIZE_BOUNDS` (else :data:`MAX_INT`), so no family sizes a
    table from an absurd value by forgetting to bound it.
    """
    value = require(config, *names, where=where)
    name = present_name(config, *names)
    top = maximum if maximum is not None else SIZE_BOUNDS.get(name, MAX_INT)
    if not _is_integer(value) or not minimum <= value <= top:
        raise ConfigError(f"{where}: {name!r} is {value!r}, expected an integer from {minimum} to {top}",
                          RESTORE_HINT)
    return int(value)


def require_number(config: Mapping[str, Any], name: str, default: float, where: str = "config.json") -> float:
    """A float field (absent or null: ``default``) within its :data:`FLOAT_BOUNDS`; a string or NaN is an error."""
    value = config.get(name)
    if value is None:
        return float(default)
    problem = _float_problem(name, value)
    if problem:
        raise ConfigError(f"{where}: {problem}", RESTORE_HINT)
    return float(value)


def _float_problem(name: str, value: Any) -> str | None:
    low, high, closed = FLOAT_BOUNDS.get(name, (-math.inf, math.inf, True))
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (low <= value if closed else low < value) and value <= high)
    if ok:
        return None
    span = f"{'[' if closed else '('}{low:g}, {high:g}]"
    return f"{name!r} is {value!r}, expected a number in {span}"


def optional_int(config: Mapping[str, Any], *names: str, default: int = 0, where: str = "config.json") -> int:
    """An integer field that may be absent (then ``default``); a non-integer value is still an error."""
    if first_of(config, *names) is None:
        return default
    return require_int(config, *names, where=where)


def mla_dims(config: Mapping[str, Any], where: str = "config.json") -> dict[str, int]:
    """Multi-head latent attention's ranks and head split: ``q_lora`` (0: a full-rank q), ``kv_lora``, ``rope_dim``
    and ``nope_dim`` (DeepSeek-V3's field names, which every MLA checkpoint uses)."""
    return dict(q_lora=optional_int(config, "q_lora_rank", where=where),
                kv_lora=require_int(config, "kv_lora_rank", where=where, minimum=1),
                rope_dim=require_int(config, "qk_rope_head_dim", where=where, minimum=1),
                nope_dim=require_int(config, "qk_nope_head_dim", where=where, minimum=0))


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config: ``text_config`` for multimodal wrappers, else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


@dataclass(frozen=True)
class Rope:
    """Rotary-embedding settings, whichever way the config spells them."""

    theta: float
    partial_rotary_factor: float = 1.0
    rope_type: str = "default"
    scaling: Mapping[str, Any] | None = None   # the extra keys of yarn / longrope / llama3 / mrope, if any


def rope(config: Mapping[str, Any], default_theta: float = 10000.0, default_partial: float = 1.0,
         section: str | None = None) -> Rope:
    """Read RoPE settings from ``rope_parameters`` (optionally a named ``section`` of it) or top-level fields.

    Top-level ``rope_theta`` / ``partial_rotary_factor`` / ``rope_scaling`` are the hub spelling; transformers 5
    folds them into ``rope_parameters``. A value in ``rope_parameters`` wins over a top-level one.
    """
    found = config.get("rope_parameters")
    if isinstance(found, Mapping) and section and isinstance(found.get(section), Mapping):
        found = found[section]
    params: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    rope_scaling = config.get("rope_scaling")
    scaling: Mapping[str, Any] = rope_scaling if isinstance(rope_scaling, Mapping) else {}
    theta = first_of(params, "rope_theta", default=first_of(config, "rope_theta", default=default_theta))
    partial = first_of(params, "partial_rotary_factor",
                       default=first_of(config, "partial_rotary_factor", default=default_partial))
    rope_type = first_of(params, "rope_type", "type", default=first_of(scaling, "rope_type", "type",
                                                                       default="default"))
    extra = {k: v for k, v in {**scaling, **params}.items()
             if k not in ("rope_theta", "partial_rotary_factor", "rope_type", "type")}
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        problem = _float_problem(name, value)
        if problem:
            raise ConfigError(f"config.json: {problem}", RESTORE_HINT)
    return Rope(float(theta), float(partial), str(rope_type), extra or None)


def _field_problems(config: Mapping[str, Any], prefix: str) -> Iterator[str]:
    for name, top in SIZE_BOUNDS.items():
        value = config.get(name)
        if value is not None and (not _is_integer(value) or not 0 <= value <= top):
            yield f"{prefix}{name!r} is {value!r}, expected an integer from 0 to {top}"
    for name in FLOAT_BOUNDS:
        value = config.get(name)
        problem = None if value is None else _float_problem(name, value)
        if value is None and name in NON_NULL_FLOATS and name in config:
            problem = f"{name!r} is null, expected a number"
        if problem:
            yield prefix + problem
    for name in BOOL_FIELDS:
        value = config.get(name)
        if value is not None and not isinstance(value, bool) and value not in (0, 1):
            yield f"{prefix}{name!r} is {value!r}, expected true or false"
    for nested in NESTED_ROPE_FIELDS:
        inner = config.get(nested)
        if isinstance(inner, Mapping):
            sections = [inner] + [v for v in inner.values() if isinstance(v, Mapping)]
            for section in sections:
                for name in ("rope_theta", "partial_rotary_factor", "factor"):
                    value = section.get(name)
                    problem = None if value is None else _float_problem(name, value)
                    if problem:
                        yield f"{prefix}{nested}: {problem}"


def _consistency_problems(config: Mapping[str, Any], prefix: str) -> Iterator[str]:
    """Fields that contradict each other: what an engine would otherwise refuse as its own ``--set`` value."""
    def value(*names: str) -> int:
        v = first_of(config, *names)
        return int(v) if _is_integer(v) else 0

    experts, top_k = value(*EXPERT_COUNT_FIELDS), value(*TOP_K_FIELDS)
    if experts and top_k > experts:
        yield (f"{prefix}{present_name(config, *TOP_K_FIELDS)!r} is {top_k} but "
               f"{present_name(config, *EXPERT_COUNT_FIELDS)!r} is {experts} (top-k cannot exceed the experts)")
    heads, kv_heads = value(*HEAD_FIELDS), value(*KV_HEAD_FIELDS)
    if heads and kv_heads and (kv_heads > heads or heads % kv_heads):
        yield (f"{prefix}'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
    groups, topk_group = value(*GROUP_FIELDS), value("topk_group")
    if experts and groups and (groups > experts or experts % groups):
        yield f"{prefix}{present_name(config, *GROUP_FIELDS)!r} ({groups}) does not divide the {experts} experts"
    if groups and topk_group > groups:
        yield f"{prefix}'topk_group' is {topk_group} but there are {groups} expert groups"


def config_problems(config: Mapping[str, Any]) -> list[str]:
    """Every size-like, float and boolean field of ``config`` (and of its ``text_config``) out of type or range,
    and fields that contradict each other, as ``'field' is ...`` lines. Empty when the config is sound."""
    problems = list(_field_problems(config, "")) + list(_consistency_problems(config, ""))
    inner = config.get("text_config")
    if isinstance(inner, Mapping):
        problems += list(_field_problems(inner, "text_config.")) + list(_consistency_problems(inner, "text_config."))
    return problems


def check_config(config: Mapping[str, Any], where: str = "config.json") -> None:
    """Raise :class:`ConfigError` naming the file and the first bad field (see :func:`config_problems`)."""
    problems = config_problems(config)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"{where}: {problems[0]}{more}", RESTORE_HINT)


def num_experts(config: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    return optional_int(config, *EXPERT_COUNT_FIELDS)


def max_context(config: Mapping[str, Any], default: int = 0) -> int:
    """The trained context length, from whichever field the config uses."""
    return optional_int(config, *CONTEXT_FIELDS, default=default)


_SPARSE_WORDS = ("sparse", "moe", "hash_moe")
_DENSE_WORDS = ("dense", "mlp")


def moe_layer_indices(config: Mapping[str, Any], num_layers: int, where: str = "config.json") -> tuple[int, ...]:
    """The layers whose MLP is a routed MoE, from any of the spellings real configs use.

    Precedence: ``mlp_layer_types`` (explicit per layer), then ``first_k_dense_replace`` with ``moe_layer_freq``
    (DeepSeek / GLM / Kimi), then ``mlp_only_layers`` with ``decoder_sparse_step`` (Qwen). Without any of them,
    every layer is MoE when the config names an expert count, none otherwise.
    """
    types = config.get("mlp_layer_types")
    if isinstance(types, Sequence) and not isinstance(types, str):
        if len(types) != num_layers:
            raise ConfigError(f"{where}: 'mlp_layer_types' has {len(types)} entries for {num_layers} layers",
                              "restore the checkpoint's original config.json")
        out = []
        for i, kind in enumerate(types):
            if kind in _SPARSE_WORDS:
                out.append(i)
            elif kind not in _DENSE_WORDS:
                raise ConfigError(f"{where}: 'mlp_layer_types'[{i}] is {kind!r}",
                                  f"expected one of {', '.join(_SPARSE_WORDS + _DENSE_WORDS)}")
        return tuple(out)
    if num_experts(config) == 0:
        return ()
    if first_of(config, "first_k_dense_replace", "moe_layer_freq") is not None:
        first_k = optional_int(config, "first_k_dense_replace", where=where)
        freq = max(1, optional_int(config, "moe_layer_freq", default=1, where=where))
        return tuple(i for i in range(num_layers) if i >= first_k and (i - first_k) % freq == 0)
    listed = config.get("mlp_only_layers") or ()
    if isinstance(listed, str) or not isinstance(listed, Sequence) or not all(_is_integer(i) for i in listed):
        raise ConfigError(f"{where}: 'mlp_only_layers' is {listed!r}, expected a list of layer indices", RESTORE_HINT)
    mlp_only = set(int(i) for i in listed)
    step = max(1, optional_int(config, "decoder_sparse_step", default=1, where=where))
    return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)


def attention_layer_types(config: Mapping[str, Any], num_layers: int, default_interval: int = 0,
                          where: str = "config.json") -> tuple[str, ...]:
    """Per-layer attention kind for hybrid models: ``"full_attention"`` or ``"linear_attention"``.

    Reads ``layer_types`` when present, else ``full_attention_interval`` (every n-th layer is full), else
    ``default_interval`` (0 = every layer full).
    """
    types = config.get("layer_types")
    if isinstance(types, Sequence) and not isinstance(types, str):
        if len(types) < num_layers:
            raise ConfigError(f"{where}: 'layer_types' has {len(types)} entries for {num_layers} layers",
                              "restore the checkpoint's original config.json")
        return tuple(str(t) for t in types[:num_layers])
    interval = optional_int(config, "full_attention_interval", default=default_interval, where=where)
    if interval <= 0:
        return ("full_attention",) * num_layers
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))


def block_fp8(config: Mapping[str, Any]) -> bool:
    """True when the checkpoint uses transformers' fine-grained FP8 format (``quant_method: fp8``).

    Its quantized linear weights are FP8 with a per-block inverse scale stored beside each one as
    ``<module>.weight_scale_inv`` (see :func:`fp8_scale_name`).
    """
    qc = config.get("quantization_config")
    return isinstance(qc, Mapping) and qc.get("quant_method") == "fp8"


def fp8_scale_name(weight_name: str) -> str:
    """``a.b.weight`` -> ``a.b.weight_scale_inv``."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a weight tensor name")
    return weight_name + "_scale_inv"


def layer_range_prefixes(prefix: str, start: int, count: int) -> tuple[str, ...]:
    """``prefix{i}.`` for ``i`` in ``[start, start + count)`` (e.g. multi-token-prediction layers to skip)."""
    return tuple(f"{prefix}{i}." for i in range(start, start + max(0, count)))


def mib(nbytes: float) -> str:
    """Human-readable size for Geometry notes."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def ceil_int(value: float) -> int:
    return int(math.ceil(value - 1e-9))


def unique(names: Iterable[str]) -> tuple[str, ...]:
    """Names in first-seen order without duplicates."""
    return tuple(dict.fromkeys(names))
