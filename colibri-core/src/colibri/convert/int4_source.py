"""int4 compressed-tensors sources (Kimi K2-Thinking; colibri.int4_packed): reading them for quantization.

A routed-expert ``X.weight_packed`` (I32, eight values per word) with its ``X.weight_scale`` and ``X.weight_shape``
is read as its dequantized f32 rows, ``(u - 8) * scale`` (one f32 product, as the runtime's int4_packed.h forms
it) and quantized like any float source, under the logical name ``X.weight`` (what the container's scheme map and
the engine name), so a container made from the packed checkpoint equals, byte for byte, the one made from its
dequantized f32 copy. The scale and shape tensors are consumed with their weights and not written.
"""

from __future__ import annotations

import numpy as np

from .. import int4_packed
from ..checkpoint import TensorIndex, TensorInfo
from ..errors import CheckpointError
from .schemes import to_f32


def _weight_of(packed_name: str) -> str | None:
    suffix = int4_packed.PACKED_SUFFIX
    return packed_name[:-len(suffix)] if packed_name.endswith(suffix) else None


def source_of(index: TensorIndex, name: str) -> tuple[TensorInfo, TensorInfo] | None:
    """(the logical ``X.weight`` [rows, cols] over the packed bytes, its scale tensor) for a ``X.weight_packed``
    in ``index`` (its companions checked), or None for any other tensor."""
    weight = _weight_of(name)
    if weight is None or name not in index:
        return None
    _, scale_name, shape_name = int4_packed.parts(weight)
    t = index[name]
    missing = [n for n in (scale_name, shape_name) if n not in index]
    if missing:
        raise CheckpointError(f"{t.file}: tensor {name!r} has no {missing[0]!r}",
                              "packed int4 weights need their weight_scale and weight_shape")
    s, shape = index[scale_name], index[shape_name]
    rows = t.shape[0] if len(t.shape) == 2 else 0
    cols = t.shape[1] * int4_packed.VALUES_PER_WORD if len(t.shape) == 2 else 0
    groups = s.shape[1] if len(s.shape) == 2 else 0
    if (t.dtype != int4_packed.PACKED_DTYPE or not rows or s.dtype not in int4_packed.SCALE_DTYPES
            or tuple(s.shape[:1]) != (rows,) or not groups or cols % groups or (cols // groups) % int4_packed.LANES
            or shape.dtype not in int4_packed.SHAPE_DTYPES or tuple(shape.shape) != (2,)):
        raise CheckpointError(f"{t.file}: packed int4 tensor {name!r} is {t.dtype}{list(t.shape)} with scale "
                              f"{s.dtype}{list(s.shape)} and shape {shape.dtype}{list(shape.shape)}",
                              "pack-quantized weights are I32 [rows, cols / 8], scales BF16/F32 [rows, cols / group], "
                              "shape I32/I64 [2]")
    return TensorInfo(weight, t.dtype, (rows, cols), t.file, t.begin, t.end), s


def consumed_by(index: TensorIndex, names) -> set[str]:
    """The scale and shape tensors read with the packed weights among ``names`` (never written)."""
    out: set[str] = set()
    for n in names:
        weight = _weight_of(n)
        if weight is not None and source_of(index, n) is not None:
            out |= set(int4_packed.parts(weight)[1:])
    return out


def read_rows(fd: int, t: TensorInfo, scale: TensorInfo, r0: int, r1: int) -> np.ndarray:
    """Rows ``[r0, r1)`` of a packed int4 weight (``t`` as :func:`source_of` gives it) dequantized to f32."""
    from .io import pread_exact, pread_rows_of   # io dispatches here: a module-level import would be circular

    cols = t.shape[1]
    raw = pread_exact(fd, (r1 - r0) * cols // 2, t.begin + r0 * cols // 2, t.file)
    b = np.frombuffer(raw, dtype=np.uint8).reshape(r1 - r0, cols // 2)
    u = np.empty((r1 - r0, cols), dtype=np.int16)
    u[:, 0::2], u[:, 1::2] = b & 15, b >> 4            # little-endian words: value 2i low nibble of byte i
    levels = (u - int4_packed.OFFSET).astype(np.float32)
    groups = scale.shape[1]
    sraw = pread_rows_of(fd, t, scale, r0, r1)
    s = to_f32(sraw, scale.dtype, (r1 - r0, groups))
    return levels * np.repeat(s, cols // groups, axis=1)   # f32 x f32: one rounding each, exact here
