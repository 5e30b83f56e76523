"""The converter's fast path gives schemes.quantize's bytes: adversarial inputs, FP8 decoding, real expert shapes.

``schemes.quantize`` (float64, whole arrays) defines the stored bits; ``fast_quant`` (cache-sized blocks, integer
absmax, threads) and the FP8 pair-table decode must reproduce them exactly. The reference here is written out
the straightforward way: decode every code through the 256-entry table, expand the block scales to a full matrix,
quantize the whole tensor with ``schemes.quantize``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from colibri.checkpoint import TensorInfo
from colibri.convert import fast_quant, fp8_source, io, schemes
from colibri.convert.plan import Item
from colibri.convert.schemes import INT4, INT8, NonFiniteError, ScaleOverflowError

SCHEMES = (INT4, INT8)


def _same(scheme, x: np.ndarray) -> None:
    q_ref, s_ref = schemes.quantize(scheme, x)
    q, s = fast_quant.quantize(scheme, x)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert np.array_equal(s.view(np.uint16), s_ref.view(np.uint16))      # bits: +0.0 is not -0.0
    assert np.array_equal(q, q_ref)


def _adversarial(rows: int = 24, cols: int = 256) -> np.ndarray:
    rng = np.random.default_rng(24)
    x = (rng.standard_normal((rows, cols)) * rng.uniform(1e-4, 10, (rows, 1))).astype(np.float32)
    s0 = np.float32(2.0 ** -3)            # absmax 7 * s0: the ideal scale is exactly the F16 value s0
    halves = (np.arange(-7, 7) + 0.5).astype(np.float32) * s0
    x[0, :14], x[0, 14] = halves, 7 * s0                     # quotients exactly k + 1/2: round half to even
    x[0, 15:29] = np.nextafter(halves, np.float32(np.inf))   # a hair either side of the half
    x[0, 29:43] = np.nextafter(halves, np.float32(-np.inf))
    x[0, 43:64] = 0.0
    x[1, :64] = -0.0                                         # an all-(-0.0) group: scale +0.0, levels 0
    x[1, 64:128] = 0.0
    x[1, 128:192] = np.float32(-0.0)
    x[1, 130] = 1e-40                                        # f32 subnormal, scale in the F16 subnormal range
    x[2, :64] = np.float32(1e-7) * rng.choice([-1, 1], 64)   # F16-subnormal scales
    x[3, :64] = 448.0                                        # the e4m3 maximum, and its negative
    x[3, 64:128] = -448.0
    x[4, :64] = 7 * 65504 * np.float32(0.999)                # scales just under the F16 maximum
    x[5] = 0.0                                               # an all-zero row (int8: a zero row scale)
    x[6] = -0.0
    for r in range(7, 12):                                   # quotients near half-integers at other scales
        s = np.float32(rng.uniform(0.01, 1.0))
        s16 = schemes.f16_scale_up(np.array([s]))[0].astype(np.float32)
        x[r] = (rng.integers(-7, 7, cols) + 0.5).astype(np.float32) * s16
        x[r, ::64] = 7 * s16
    return x


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_fast_quantize_equals_reference_on_adversarial_inputs(scheme):
    x = _adversarial()
    _same(scheme, x)
    _same(scheme, -x)
    _same(scheme, x[:1])                          # one row
    _same(scheme, np.ascontiguousarray(x[:, :128]))
    q, s = fast_quant.quantize(scheme, x)
    zero = s[1, 0] if scheme is INT4 else s[6]               # an all-(-0.0) group or row
    assert zero == 0 and not np.signbit(zero)
    if scheme is INT4:
        levels = schemes.unpack_int4(q)
        assert list(levels[0, :15]) == [-6, -6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6, 6, 7]   # half to even


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_fast_quantize_spans_many_blocks(scheme, monkeypatch):
    monkeypatch.setattr(fast_quant, "BLOCK_ELEMENTS", 1000)   # many blocks, a partial last one
    rng = np.random.default_rng(5)
    _same(scheme, (rng.standard_normal((53, 320)) * rng.uniform(0.01, 5, (53, 1))).astype(np.float32))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, np.float32(np.nan) * -1])
def test_fast_quantize_refuses_non_finite_like_the_reference(scheme, bad):
    x = _adversarial()
    x[9, 200] = bad
    for quantize in (schemes.quantize, fast_quant.quantize):
        with pytest.raises(NonFiniteError):
            quantize(scheme, x)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_fast_quantize_refuses_scale_overflow_like_the_reference(scheme):
    x = _adversarial()
    x[10, 3] = 1e10
    for quantize in (schemes.quantize, fast_quant.quantize):
        with pytest.raises(ScaleOverflowError):
            quantize(scheme, x)


def test_float32_quotient_rounds_like_float64_next_to_every_half_integer():
    """fast_quant's proof, checked: an f32 value one or two spacings from ``h * s`` never has an f32 quotient of
    exactly ``h``, for every positive F16 scale and every half-integer of int4's range (and int8's, on a sample)."""
    s16 = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)      # every positive finite F16
    for halves, scales in ((np.arange(8) + 0.5, s16), (np.arange(127) + 0.5, s16[::37])):
        exact = (halves[:, None].astype(np.float32) * scales[None, :]).ravel()         # exact in f32
        s = np.broadcast_to(scales[None, :], (len(halves), len(scales))).ravel()
        for x in (exact, np.nextafter(exact, np.float32(np.inf)), np.nextafter(exact, np.float32(0)),
                  np.nextafter(np.nextafter(exact, np.float32(0)), np.float32(0))):
            want = np.rint(x.astype(np.float64) / s.astype(np.float64))
            assert np.array_equal(np.rint(x / s), want)


def _reference_fp8(codes: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    full = np.repeat(np.repeat(blocks, 128, axis=0), 128, axis=1)[:codes.shape[0], :codes.shape[1]]
    return fp8_source.E4M3[codes] * full


def test_e4m3_table_and_pair_decode_cover_every_code():
    table = fp8_source.E4M3
    assert table[0x7E] == 448.0 and table[0xFE] == -448.0            # the e4m3 maximum
    assert table[0x01] == 2.0 ** -9 and table[0x08] == 2.0 ** -6      # the smallest subnormal and normal
    assert np.signbit(table[0x80]) and table[0x80] == 0.0             # -0.0
    assert np.isnan(table[0x7F]) and np.isnan(table[0xFF])
    pairs = np.arange(65536).astype("<u2").view(np.uint8).reshape(64, 2048)   # every pair of adjacent codes
    got = fp8_source.e4m3_values(pairs)
    assert np.array_equal(got.view(np.uint32), table[pairs].view(np.uint32))
    odd = pairs[:, :2047].copy()                                     # odd width: the per-code table
    assert np.array_equal(fp8_source.e4m3_values(odd).view(np.uint32), table[odd].view(np.uint32))


@pytest.mark.parametrize("shape,first", [((300, 200), 0), ((130, 256), 5), ((7, 129), 127)])
def test_fp8_block_decode_equals_full_scale_expansion(shape, first):
    rng = np.random.default_rng(shape[0])
    rows, cols = shape
    codes = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    codes[codes == 0x7F], codes[codes == 0xFF] = 0x7E, 0x01          # no NaN codes here
    blocks = (rng.uniform(1e-6, 4, (-(-(rows + first) // 128), -(-cols // 128)))).astype(np.float32)
    blocks[0, 0] = 2.0 ** -30                                         # products in the f32 subnormal range
    got = fp8_source.dequantize(codes, blocks, first)
    padded = np.zeros((first + rows, cols), dtype=np.uint8)
    padded[first:] = codes
    want = _reference_fp8(padded, blocks)[first:]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------ through produce(), at the real expert shapes

def _fp8_tensor(path: Path, rows: int, cols: int, seed: int, scale_dtype: str = "F32"):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E                             # 448 instead of NaN: the maximum, often
    grid = (-(-rows // 128), -(-cols // 128))
    if scale_dtype == "F8_E8M0":
        sbits = rng.integers(110, 130, size=grid, dtype=np.uint8)
        blocks, sraw = np.ldexp(1.0, sbits.astype(np.int64) - 127).astype(np.float32), sbits.tobytes()
    else:
        blocks = rng.uniform(1e-5, 1e-3, grid).astype(np.float32)
        sraw = blocks.tobytes()
    with open(path, "wb") as fh:
        fh.write(b"\0" * 16 + codes.tobytes() + sraw)               # an offset, as a safetensors header gives
    end = 16 + rows * cols
    weight = TensorInfo("w.weight", "F8_E4M3", (rows, cols), path, 16, end)
    scale = TensorInfo("w.weight_scale_inv", scale_dtype, grid, path, end, end + len(sraw))
    return weight, scale, _reference_fp8(codes, blocks)


def _produced(item: Item) -> bytes:
    fd = os.open(item.source.file, os.O_RDONLY)
    try:
        return b"".join(data for data, _ in io.produce(item, fd))
    finally:
        os.close(fd)


def _reference_bytes(scheme, x: np.ndarray) -> bytes:
    q, s = schemes.quantize(scheme, x)
    return q.tobytes() + s.astype("<f2").tobytes()


@pytest.mark.parametrize("rows,cols,scale_dtype", [(2048, 7168, "F32"), (7168, 2048, "F8_E8M0"), (200, 320, "F32")])
def test_fp8_expert_at_deepseek_v3_width_converts_to_the_reference_bytes(tmp_path, rows, cols, scale_dtype):
    """A routed expert's gate/up (2048 x 7168) and down (7168 x 2048) projections as DeepSeek-V3 ships them."""
    weight, scale, x = _fp8_tensor(tmp_path / "fp8.bin", rows, cols, rows + cols, scale_dtype)
    item = Item(weight, INT4.name, INT4, (), scale)
    assert _produced(item) == _reference_bytes(INT4, x)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_bf16_expert_at_olmoe_width_converts_to_the_reference_bytes(tmp_path, scheme):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((1024, 2048)) * 0.02).astype(np.float32)
    x[3, :64] = -0.0
    bits = (x.view(np.uint32) >> 16).astype("<u2")
    path = tmp_path / "bf16.bin"
    path.write_bytes(bits.tobytes())
    item = Item(TensorInfo("w.weight", "BF16", x.shape, path, 0, bits.nbytes), scheme.name, scheme, ())
    assert _produced(item) == _reference_bytes(scheme, schemes.to_f32(bits.tobytes(), "BF16", x.shape))


def test_fp8_nan_code_is_refused(tmp_path):
    weight, scale, _ = _fp8_tensor(tmp_path / "fp8.bin", 300, 256, 1)
    with open(weight.file, "r+b") as fh:
        fh.seek(weight.begin + 257 * 256 + 3)
        fh.write(b"\x7f")                                            # e4m3 NaN deep inside the tensor
    with pytest.raises(NonFiniteError):
        _produced(Item(weight, INT4.name, INT4, (), scale))
