"""INT4 compressed-tensors checkpoints (``pack-quantized``), the format Kimi K2-Thinking ships its routed experts in.

config.json carries ``quantization_config: {"quant_method": "compressed-tensors", "format": "pack-quantized",
"config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
"group_size": 32, ...}, "input_activations": null, ...}}, "ignore": [...]}``. A quantized linear ``X.weight`` is
stored as three tensors (compressed-tensors' ``PackedQuantizationCompressor``):

* ``X.weight_packed``: I32 ``[out, in / 8]``, eight 4-bit values per word, value ``k`` of a word in bits
  ``4k .. 4k + 3`` (lowest first), each stored as ``q + 8`` (``pack_to_int32``'s offset): ``q`` in ``[-8, 7]``;
* ``X.weight_scale``: BF16 (or F32) ``[out, in / group_size]``;
* ``X.weight_shape``: I32 or I64 ``[2]``, the logical ``[out, in]``.

The weight is ``(u - 8) * scale[r, c / group_size]`` (symmetric: no zero point). Which tensors are packed is read
from the checkpoint (``X.weight_packed`` present), never from the ``ignore`` list. Only this variant is read: any
other ``format``, bit width, type, strategy, asymmetric weights, activation quantization or sparsity is refused
naming the field. On a little-endian machine the packed words are the same bytes as two values per byte, low
nibble first (``runtime/int4_packed.h`` reads them so).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ConfigError

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
PACKED_SUFFIX = "_packed"
SCALE_SUFFIX = "_scale"
SHAPE_SUFFIX = "_shape"
VALUES_PER_WORD = 8
OFFSET = 8
PACKED_DTYPE = "I32"
SCALE_DTYPES = ("BF16", "F32")
SHAPE_DTYPES = ("I32", "I64")
LANES = 16   # the kernels' chunk: a group must hold whole chunks so each chunk has one scale
_HINT = ('colibri reads compressed-tensors "pack-quantized" int4 weights: num_bits 4, type "int", symmetric, '
         'strategy "group" (group_size a multiple of 16), no activation quantization (Kimi K2-Thinking)')
_WEIGHT_FIELDS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
_ABSENT_FIELDS = ("input_activations", "output_activations")


def _refuse(where: str, field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{where}: quantization_config.{field} {value!r} is not supported ({why})", _HINT)


def check_config(qc: Mapping[str, Any], where: str) -> int:
    """The group size of a compressed-tensors ``quantization_config`` colibri reads; any other variant is refused
    with one line naming the field. ``qc`` has ``quant_method`` "compressed-tensors"."""
    fmt = qc.get("format")
    if fmt != FORMAT:
        raise _refuse(where, "format", fmt, f"only {FORMAT!r} int4 weights are read")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(where, "quantization_status", status, "the weights must be stored compressed")
    for field in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(field):
            raise _refuse(where, field, qc[field], "not read")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse(where, "config_groups", groups, "one or more quantization groups are needed")
    sizes = set()
    for name, group in groups.items():
        at = f"config_groups.{name}"
        if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
            raise _refuse(where, f"{at}.weights", None if not isinstance(group, Mapping) else group.get("weights"),
                          "each group quantizes weights")
        for field in _ABSENT_FIELDS:
            if group.get(field) is not None:
                raise _refuse(where, f"{at}.{field}", group[field], "weight-only quantization is read")
        weights = group["weights"]
        for field, want in _WEIGHT_FIELDS.items():
            if weights.get(field) != want:
                raise _refuse(where, f"{at}.weights.{field}", weights.get(field), f"must be {want!r}")
        for field in ("dynamic", "actorder"):
            if weights.get(field) not in (None, False):
                raise _refuse(where, f"{at}.weights.{field}", weights[field], "not read")
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % LANES:
            raise _refuse(where, f"{at}.weights.group_size", size, f"must be a positive multiple of {LANES}")
        sizes.add(size)
    if len(sizes) != 1:
        raise _refuse(where, "config_groups", sorted(sizes), "every group must use one group_size")
    return sizes.pop()


def packed_name(weight_name: str) -> str:
    """``a.b.weight`` -> ``a.b.weight_packed``."""
    return weight_name + PACKED_SUFFIX


def parts(weight_name: str) -> tuple[str, str, str]:
    """(packed, scale, shape) tensor names of a packed ``a.b.weight``."""
    return weight_name + PACKED_SUFFIX, weight_name + SCALE_SUFFIX, weight_name + SHAPE_SUFFIX


def packed_among(names: Iterable[str], present: frozenset[str]) -> list[str]:
    """The weights among ``names`` stored packed (their ``_packed`` tensor is in ``present``)."""
    return [n for n in names if packed_name(n) in present]
