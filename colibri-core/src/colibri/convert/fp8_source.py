"""Block-quantized FP8 sources (DeepSeek-V3/R1/V3.2, Kimi K2; colibri.fp8): reading them for quantization.

An F8_E4M3 weight with a ``weight_scale_inv`` companion is read as its dequantized f32 rows (``e4m3 * scale`` of
the row's 128x128 block, one f32 product, as transformers and the runtime's fp8.h compute it) and quantized like
any float source, so a container made from the FP8 checkpoint equals, byte for byte, the one made from its
dequantized f32 copy. The scale tensors are consumed with their weights and not written. Dense FP8 matrices the
scheme does not quantize are copied with their scales: the runtime reads them natively.
"""

from __future__ import annotations


import numpy as np

from .. import fp8
from ..checkpoint import TensorIndex, TensorInfo
from ..errors import CheckpointError
from .schemes import to_f32


def _e4m3_table() -> np.ndarray:
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    value = np.where(exponent == 0, np.ldexp(mantissa.astype(np.float64), -9),
                     np.ldexp((8 + mantissa).astype(np.float64), exponent - 10))
    value = np.where((exponent == 15) & (mantissa == 7), np.nan, value)
    return (sign * value).astype(np.float32)   # exact: every e4m3 value is an f32


E4M3 = _e4m3_table()
# The values of every pair of adjacent codes, indexed by the pair read as a little-endian uint16 (512 KiB, fits
# in L2): one lookup yields two f32 values, twice as fast as a lookup per code.
_PAIRS = np.stack([np.tile(E4M3, 256), np.repeat(E4M3, 256)], axis=1).view(np.uint64).reshape(-1)


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """float32 values of e4m3 codes [rows, cols] (uint8), exactly ``E4M3[codes]``."""
    if codes.shape[-1] % 2 or not codes.flags.c_contiguous:
        return E4M3.take(codes)
    return _PAIRS.take(codes.view("<u2")).view(np.float32)


def scale_for(index: TensorIndex, name: str) -> TensorInfo | None:
    """The scale companion of an F8_E4M3 weight (checked against the block grid), or None for any other tensor."""
    scale = fp8.scale_name(name)
    if scale not in index or name not in index:
        return None
    t, s = index[name], index[scale]
    if t.dtype != fp8.WEIGHT_DTYPE or len(t.shape) != 2:
        raise CheckpointError(f"{t.file}: tensor {name!r} has a block scale but is {t.dtype}{list(t.shape)}",
                              f"block-quantized weights are 2-D {fp8.WEIGHT_DTYPE}")
    grid = tuple(-(-d // fp8.BLOCK) for d in t.shape)
    if s.dtype not in fp8.SCALE_DTYPES or tuple(s.shape) != grid:
        raise CheckpointError(f"{s.file}: tensor {scale!r} is {s.dtype}{list(s.shape)}, expected F32{list(grid)}",
                              "check quantization_config.weight_block_size in config.json ([128, 128])")
    return s


def scales_of(index: TensorIndex, names) -> set[str]:
    """The scale tensors consumed by the FP8 weights among ``names``."""
    return {fp8.scale_name(n) for n in names if scale_for(index, n) is not None}


def _scales_f32(raw: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "F8_E8M0":   # 2^(b - 127); 0xff is NaN
        b = np.frombuffer(raw, dtype=np.uint8).astype(np.int64).reshape(shape)
        return np.where(b == 255, np.nan, np.ldexp(1.0, b - 127)).astype(np.float32)
    return to_f32(raw, dtype, shape)


def read_rows(fd: int, t: TensorInfo, scale: TensorInfo, r0: int, r1: int) -> np.ndarray:
    """Rows ``[r0, r1)`` of an FP8 weight read from ``fd``, dequantized to f32 (the scale may be in another
    shard, opened for the read)."""
    from .io import pread_exact, pread_rows_of   # io dispatches here: a module-level import would be circular

    cols = t.shape[1]
    raw = pread_exact(fd, (r1 - r0) * cols, t.begin + r0 * cols, t.file)
    b0, b1 = r0 // fp8.BLOCK, (r1 - 1) // fp8.BLOCK + 1
    sraw = pread_rows_of(fd, t, scale, b0, b1)
    blocks = _scales_f32(sraw, scale.dtype, (b1 - b0, scale.shape[1]))
    return dequantize(np.frombuffer(raw, dtype=np.uint8).reshape(r1 - r0, cols), blocks, r0 - b0 * fp8.BLOCK)


def dequantize(codes: np.ndarray, blocks: np.ndarray, first: int = 0) -> np.ndarray:
    """``e4m3 * scale`` of each element's 128x128 block, f32: codes [rows, cols] whose first row is row ``first``
    of the first block row of ``blocks`` [block rows, ceil(cols / 128)].

    Each product is the same single f32 multiplication of the same two f32 operands as expanding the scales to
    a full matrix gives, so the bits are identical; only one row of scales per block row is expanded."""
    rows, cols = codes.shape
    out = e4m3_values(codes)                     # table lookup: exact, every e4m3 value is an f32
    for br in range(blocks.shape[0]):
        a, b = max(0, br * fp8.BLOCK - first), min(rows, (br + 1) * fp8.BLOCK - first)
        if a < b:
            out[a:b] *= np.repeat(blocks[br], fp8.BLOCK)[:cols]
    return out
