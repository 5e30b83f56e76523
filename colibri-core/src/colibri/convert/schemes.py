"""The quantization schemes of colibri's container, in numpy: quantize, dequantize, and the error bound.

These functions define the stored bits. They must be deterministic (same input, same bytes on every machine), so
every step is a correctly rounded IEEE operation in float64 on values that are exact in it, and the only rounding
to integers is round-half-to-even (``np.rint``).

* ``int8``: one scale per output row, ``scale = absmax / 127``; ``q = rint(x / scale)`` in [-127, 127].
* ``int4``: one scale per group of 64 consecutive input columns, ``scale = absmax / 7``; ``q`` in [-7, 7], stored as
  the nibble ``q + 8`` (1..15), two per byte, the even column in the low nibble.

Scales are stored as IEEE half (F16), rounded *up* to the next representable value, so ``|x| / scale`` never
exceeds the level range and every element keeps the bound ``|x - q * scale| <= scale / 2`` with the stored scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT4_GROUP = 64
F16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme as stored in a container."""

    name: str           # the value in the shard's scheme map, e.g. "int4-g64"
    option: str         # the CLI spelling, e.g. "int4"
    levels: int         # largest |q|
    group: int          # input columns per scale; 0 = the whole row
    qdtype: str         # safetensors dtype of the .qweight tensor

    def qweight_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return (rows, cols // 2) if self.name == INT4.name else (rows, cols)

    def scales_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        return (rows, cols // self.group) if self.group else (rows,)

    def groups_per_row(self, cols: int) -> int:
        return cols // self.group if self.group else 1

    def check_cols(self, cols: int) -> str | None:
        """Why a matrix with ``cols`` input columns cannot use this scheme, or ``None``."""
        if self.group and cols % self.group:
            return f"{self.option} needs the input dimension to be a multiple of {self.group}, this one is {cols}"
        return None


INT8 = Scheme("int8-row", "int8", 127, 0, "I8")
INT4 = Scheme("int4-g64", "int4", 7, INT4_GROUP, "U8")
QUANT_SCHEMES = {s.name: s for s in (INT8, INT4)}
BY_OPTION = {s.option: s for s in (INT8, INT4)}

# Schemes for tensors kept as floats (the scheme map names every tensor of a shard).
FLOAT_SCHEMES = {"f32": "F32", "bf16": "BF16"}
COPY_SCHEME = "copy"           # stored exactly as in the source, whatever the dtype


class NonFiniteError(ValueError):
    """The input holds inf or NaN: no finite scale represents it."""


class ScaleOverflowError(ValueError):
    """A scale would exceed the largest F16 value."""


def f16_scale_up(ideal: np.ndarray) -> np.ndarray:
    """The smallest F16 values >= ``ideal`` (float64, finite, >= 0)."""
    if ideal.size and float(ideal.max()) > F16_MAX:
        raise ScaleOverflowError(f"a scale of {float(ideal.max()):.6g} exceeds the F16 maximum {F16_MAX:g}")
    stored = ideal.astype(np.float16)
    low = stored.astype(np.float64) < ideal
    if low.any():
        stored[low] = np.nextafter(stored[low], np.float16(np.inf))
    return stored


def _absmax(x: np.ndarray, axis: int) -> np.ndarray:
    if not np.isfinite(x).all():
        raise NonFiniteError("holds inf or NaN values")
    return np.abs(x).max(axis=axis).astype(np.float64)


def _levels(x: np.ndarray, scales16: np.ndarray, levels: int) -> np.ndarray:
    """rint(x / scale) clipped to [-levels, levels]; a zero scale (all-zero row or group) gives 0."""
    s = scales16.astype(np.float64)
    safe = np.where(s > 0, s, 1.0)
    q = np.rint(x.astype(np.float64) / safe)
    q = np.where(s > 0, q, 0.0)
    return np.clip(q, -levels, levels)


def quantize(scheme: Scheme, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows of ``x`` (float32, shape [rows, cols]): returns (qweight, scales as float16)."""
    rows, cols = x.shape
    if scheme is INT8:
        scales = f16_scale_up(_absmax(x, 1) / 127.0)
        q = _levels(x, scales[:, None], 127).astype(np.int8)
        return q, scales
    grouped = x.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    scales = f16_scale_up(_absmax(grouped, 2) / 7.0)
    q = _levels(grouped, scales[:, :, None], 7).astype(np.int8).reshape(rows, cols)
    return pack_int4(q), scales


def pack_int4(q: np.ndarray) -> np.ndarray:
    """[rows, cols] int levels in [-7, 7] -> [rows, cols/2] bytes: low nibble = even column, value = q + 8."""
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pack_int4`: int8 levels, shape [rows, 2 * bytes]."""
    rows, half = packed.shape
    out = np.empty((rows, half * 2), dtype=np.int8)
    out[:, 0::2] = (packed & 0x0F).astype(np.int8) - 8
    out[:, 1::2] = (packed >> 4).astype(np.int8) - 8
    return out


def levels_of(scheme: Scheme, qweight: np.ndarray) -> np.ndarray:
    """Integer levels [rows, cols] of a stored qweight."""
    return unpack_int4(qweight) if scheme is INT4 else qweight.astype(np.int8)


def dequantize(scheme: Scheme, qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [rows, cols]: level * scale, exactly (a level times an F16 value is exact in float64)."""
    q = levels_of(scheme, qweight).astype(np.float64)
    s = scales.astype(np.float64)
    if scheme is INT8:
        return q * s[:, None]
    rows, cols = q.shape
    return (q.reshape(rows, cols // INT4_GROUP, INT4_GROUP) * s[:, :, None]).reshape(rows, cols)


def scale_per_element(scheme: Scheme, scales: np.ndarray, cols: int) -> np.ndarray:
    s = scales.astype(np.float64)
    return np.repeat(s[:, None], cols, axis=1) if scheme is INT8 else np.repeat(s, INT4_GROUP, axis=1)


def max_bound_violation(scheme: Scheme, x: np.ndarray, qweight: np.ndarray, scales: np.ndarray) -> float:
    """Largest ``|x - deq| / (scale / 2)`` over the elements (<= 1 when the bound holds; 0 for zero scales)."""
    err = np.abs(x.astype(np.float64) - dequantize(scheme, qweight, scales))
    half = scale_per_element(scheme, scales, x.shape[1]) / 2.0
    if (err[half == 0] > 0).any():
        return float("inf")
    ratio = np.divide(err, half, out=np.zeros_like(err), where=half > 0)
    return float(ratio.max()) if ratio.size else 0.0


def to_f32(raw: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Source bytes of a float tensor as float32 (exact for F32, BF16 and F16)."""
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(shape)
    raise ValueError(f"unsupported float dtype {dtype}")


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even; NaN -> 0x7fc0 (what torch and the C runtime do)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded[nan] = 0x7FC0
    return rounded


FLOAT_SOURCE_DTYPES = ("F32", "BF16", "F16")
