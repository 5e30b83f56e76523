/* fp4_avx2.c: the AVX2 body of fp4.h's kernels. 16 columns (8 bytes) at a time: the nibbles are split and
 * interleaved back into column order, decoded with a register permute (the table's second half is its first with
 * the sign bit set, so the low three bits pick the magnitude and bit 3 is the sign: no memory gathers) and scaled
 * with one multiply (the scalar path's f32 product), then accumulated with the 16-lane fma and reduction tree of
 * kernels_v16_avx2.h, so every result equals cb_fp4_rows_scalar bit for bit. Compiled with target attributes; the
 * dispatcher only calls it when cb_get_isa() is AVX2 or better. */
#include "fp4.h"
#include "blockscaled.h"

#if CB_HAVE_X86_KERNELS
#include <immintrin.h>
#include <string.h>

#define CB_TARGET __attribute__((target("avx2,fma,f16c")))
#include "kernels_v16_avx2.h"

#define FP4_INLINE static inline __attribute__((always_inline)) CB_TARGET

/* Eight e2m1 codes (0-15, one per 32-bit lane) as f32: cb_e2m1_table's values, bit for bit. */
FP4_INLINE __m256 e2m1x8(__m256i code) {
    __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(cb_e2m1_table), code);   /* uses bits 0-2 */
    __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(code, 3), 31);
    return _mm256_or_ps(magnitude, _mm256_castsi256_ps(sign));
}

FP4_INLINE V16 load_fp4(const uint8_t *p, __m256 scale) {
    long long packed;
    memcpy(&packed, p, 8);
    __m128i bytes = _mm_cvtsi64_si128(packed), mask = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m128i nib = _mm_unpacklo_epi8(lo, hi);   /* column order: byte i low, byte i high, ... */
    __m256i a = _mm256_cvtepu8_epi32(nib), b = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(nib, nib));
    V16 v = {_mm256_mul_ps(e2m1x8(a), scale), _mm256_mul_ps(e2m1x8(b), scale)};
    return v;
}

/* One row against nx <= 4 inputs: the row's weights are decoded once per 16 columns and reused by every input. */
FP4_INLINE void row_tile(float *Y, size_t ldy, const cb_fp4matrix *W, int r, const float *X, size_t ldx,
                         const int nx) {
    const uint8_t *row = W->w + (size_t)r * (size_t)(W->cols / 2);
    const int cols = W->cols;
    V16 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < nx; j++) acc[j] = v16_zero();
    __m256 scale = _mm256_setzero_ps();
    for (int c = 0; c < cols; c += 16) {
        if (c % CB_FP4_GROUP == 0) scale = _mm256_set1_ps(cb_fp4_scale(W, r, c / CB_FP4_GROUP));
        V16 w = load_fp4(row + c / 2, scale);
#pragma GCC unroll 4
        for (int j = 0; j < nx; j++) acc[j] = v16_fma(w, v16_load_f32(X + (size_t)j * ldx + c), acc[j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < nx; j++) Y[(size_t)j * ldy + r] = v16_reduce(acc[j]);
}

/* Rows r .. r+3 against one input, into y[r .. r+3]: four independent fma chains. */
FP4_INLINE void rows4_tile(float *y, const cb_fp4matrix *W, int r, const float *x) {
    const size_t row_bytes = (size_t)(W->cols / 2);
    const uint8_t *row = W->w + (size_t)r * row_bytes;
    V16 acc[4];
    __m256 scale[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        acc[i] = v16_zero();
        scale[i] = _mm256_setzero_ps();
    }
    for (int c = 0; c < W->cols; c += 16) {
        if (c % CB_FP4_GROUP == 0)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) scale[i] = _mm256_set1_ps(cb_fp4_scale(W, r + i, c / CB_FP4_GROUP));
        V16 xv = v16_load_f32(x + c);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            acc[i] = v16_fma(load_fp4(row + (size_t)i * row_bytes + (size_t)(c / 2), scale[i]), xv, acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) y[r + i] = v16_reduce(acc[i]);
}

CB_BLOCKSCALED_ROWS(cb_fp4, cb_fp4matrix, _avx2)

#endif
