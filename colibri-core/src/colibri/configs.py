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
from typing import Any, Iterable, Mapping, Sequence

from .errors import ConfigError

_MISSING = object()

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
CONTEXT_FIELDS = ("max_position_embeddings", "model_max_length", "max_sequence_length", "seq_length")


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


def require_int(config: Mapping[str, Any], *names: str, where: str = "config.json", minimum: int = 0) -> int:
    """An integer field (first of ``names``) that must be present and ``>= minimum``."""
    value = require(config, *names, where=where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        raise ConfigError(f"{where}: {names[0]!r} is {value!r}, expected an integer >= {minimum}",
                          "restore the checkpoint's original config.json")
    return int(value)


def optional_int(config: Mapping[str, Any], *names: str, default: int = 0, where: str = "config.json") -> int:
    """An integer field that may be absent (then ``default``); a non-integer value is still an error."""
    if first_of(config, *names) is None:
        return default
    return require_int(config, *names, where=where)


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
    return Rope(float(theta), float(partial), str(rope_type), extra or None)


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
    mlp_only = set(int(i) for i in (config.get("mlp_only_layers") or ()))
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
