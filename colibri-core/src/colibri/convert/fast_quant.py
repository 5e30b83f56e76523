"""The converter's fast path: :func:`schemes.quantize`'s bytes, computed on cache-sized row blocks.

``schemes.quantize`` stays the definition of the stored bits (and the reference the tests hold this module to);
this module reaches the same bits with fewer, cheaper passes:

* Each block of rows is about ``BLOCK_ELEMENTS`` values, so its temporaries stay in the core's L2 cache instead
  of streaming several full-size arrays through memory.
* The absmax of a group is an integer max over the sign-cleared f32 bit patterns (same value, +0.0 for an
  all-(-0.0) group as ``abs(x).max()`` gives), and the non-finite check looks at the group maxima only.
* The quotient is formed in float32, which gives the same levels as the reference's float64 (proof below), at
  twice the SIMD width and half the memory traffic.
* A zero scale (an all-zero group or row) is replaced by 1.0 before dividing: its elements are all +-0.0, so the
  level is 0 exactly as the reference's ``where(s > 0, q, 0)`` gives, without that extra pass.
* The reference's clip to [-levels, levels] never bites (the F16 scale is rounded up from absmax / levels, so
  ``|x| / scale <= levels * (1 + 2**-52)`` before ``rint``), but it is kept, on the int8 levels, where it is cheap.
* int4 nibbles are packed through a little-endian uint16 view of each column pair (``lo | hi << 8`` becomes
  ``lo | hi << 4`` with one shift and one or), not through two strided slices.

Why ``rint(fl32(x / s)) == rint(fl64(x / s))`` for an f32 ``x`` and a positive F16 scale ``s``: both roundings are
monotonic and every half-integer ``h`` is an f32, so the two can differ only if ``fl32(x / s) == h`` while
``x / s != h``, i.e. ``x != h * s`` with ``|x - h*s| <= s * ulp(h) / 2``. Now ``h * s`` is itself an f32 (``2h`` needs
at most 8 bits for int8's 255, ``s`` 11, so 19 significant bits; ``|h| >= 1/2`` and ``s >= 2**-24`` keep it normal),
so ``x`` is at least one f32 spacing away from it. With ``h`` in [2**e, 2**(e+1)) and ``s`` in [2**m, 2**(m+1)),
``s * ulp(h) / 2 < 2**(e+m-23)``, which is the spacing around ``h * s`` unless ``h * s`` is exactly 2**(e+m) (a power
of two below which the spacing halves); that needs ``h = 2**e``, so ``h = 1/2``, where the rounding interval below
``h`` is half as wide too (``s * 2**-26 < 2**(m-25)``). So ``fl32(x / s)`` never lands on a half-integer ``x / s``
is not. (Tiny quotients are no exception: they round to 0 either way, even with flush-to-zero.) float64 then gives
the exact ``rint(x / s)`` for the same reason with room to spare, as the reference relies on.
"""

from __future__ import annotations

import numpy as np

from .schemes import INT4, INT4_GROUP, NonFiniteError, Scheme, f16_scale_up

BLOCK_ELEMENTS = 1 << 16       # values per block: a few 256 KiB f32 / u32 temporaries, well inside L2


_MAGNITUDE = np.uint32(0x7FFFFFFF)
_INF_BITS = 0x7F800000


def _absmax(x: np.ndarray, axis: int) -> np.ndarray:
    """max |x| along ``axis`` as float64, from the f32 bit patterns with the sign cleared: for non-negative
    floats the integer order is the value order, so an integer max (which numpy vectorises, unlike a float max
    over a short axis) gives the same value; inf and every NaN pattern are the integers >= 0x7f800000, so one
    look at the (small) result replaces an ``isfinite`` pass over the elements."""
    bits = np.bitwise_and(np.ascontiguousarray(x, dtype=np.float32).view(np.uint32), _MAGNITUDE)
    top = bits.max(axis=axis)
    if top.size and int(top.max()) >= _INF_BITS:
        raise NonFiniteError("holds inf or NaN values")
    return top.view(np.float32).astype(np.float64)


def _levels_into(x: np.ndarray, scales16: np.ndarray, levels: int, q8: np.ndarray) -> None:
    """``q8 = clip(rint(x / scale))`` with x [r, g, n] f32 and scales [r, g] F16 (float32 quotient: see above)."""
    s = scales16.astype(np.float32)
    s[s == 0] = 1.0
    quotient = np.divide(x, s[:, :, None])
    np.rint(quotient, out=quotient)
    np.copyto(q8, quotient, casting="unsafe")  # integral values in [-levels, levels]: exact
    np.clip(q8, -levels, levels, out=q8)


def _pack_into(q8: np.ndarray, out: np.ndarray) -> None:
    """int4 levels [r, cols] -> bytes [r, cols / 2]: even column in the low nibble, value q + 8."""
    q8 += 8
    pairs = q8.view(np.uint8).view("<u2")       # lo | hi << 8 per column pair
    np.copyto(out, pairs | (pairs >> 4), casting="unsafe")   # lo | hi << 4 (| hi << 8, dropped by the cast)


def quantize_block(scheme: Scheme, x: np.ndarray, q_out: np.ndarray, s_out: np.ndarray) -> None:
    """Quantize rows ``x`` [r, cols] (float32) into ``q_out`` (qweight rows) and ``s_out`` (their F16 scales)."""
    rows, cols = x.shape
    if scheme is INT4:
        grouped = x.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
        scales = f16_scale_up(_absmax(grouped, 2) / 7.0)
        q8 = np.empty((rows, cols), dtype=np.int8)
        _levels_into(grouped, scales, 7, q8.reshape(grouped.shape))
        _pack_into(q8, q_out)
    else:
        scales = f16_scale_up(_absmax(x, 1) / 127.0)
        _levels_into(x[:, None, :], scales[:, None], 127, q_out[:, None, :])
    s_out[...] = scales


def block_rows(cols: int) -> int:
    """Rows per cache-sized block for a matrix with ``cols`` input columns (at least one)."""
    return max(1, BLOCK_ELEMENTS // max(1, cols))


def quantize(scheme: Scheme, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same (qweight, scales) as :func:`schemes.quantize`, block by block."""
    rows, cols = x.shape
    q = np.empty(scheme.qweight_shape(rows, cols), dtype=np.uint8 if scheme is INT4 else np.int8)
    s = np.empty(scheme.scales_shape(rows, cols), dtype=np.float16)
    step = block_rows(cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        quantize_block(scheme, x[r0:r1], q[r0:r1], s[r0:r1])
    return q, s
