/* fp8_avx2.c: the AVX2 body of fp8.h's kernels. Weights are decoded with two table gathers per 16 columns and
 * scaled with one multiply (the same f32 product as the scalar path), then accumulated with the 16-lane fma and
 * the reduction tree of kernels_v16_avx2.h, so every result equals cb_fp8_rows_scalar bit for bit. Compiled with
 * target attributes; the dispatcher only calls it when cb_get_isa() is AVX2 or better. */
#include "fp8.h"
#include "blockscaled.h"

#if CB_HAVE_X86_KERNELS
#include <immintrin.h>

#define CB_TARGET __attribute__((target("avx2,fma,f16c")))
#include "kernels_v16_avx2.h"

#define FP8_INLINE static inline __attribute__((always_inline)) CB_TARGET

FP8_INLINE V16 load_fp8(const uint8_t *p, __m256 scale) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
    V16 v = {_mm256_mul_ps(_mm256_i32gather_ps(cb_e4m3_table, lo, 4), scale),
             _mm256_mul_ps(_mm256_i32gather_ps(cb_e4m3_table, hi, 4), scale)};
    return v;
}

/* One row against nx <= 4 inputs: the row's weights are decoded once per 16 columns and reused by every input. */
FP8_INLINE void row_tile(float *Y, size_t ldy, const cb_fp8matrix *W, int r, const float *X, size_t ldx,
                         const int nx) {
    const uint8_t *row = W->w + (size_t)r * (size_t)W->cols;
    const int cols = W->cols, main_cols = cols - cols % 16, br = r / CB_FP8_BLOCK;
    V16 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < nx; j++) acc[j] = v16_zero();
    __m256 scale = _mm256_setzero_ps();
    for (int c = 0; c < main_cols; c += 16) {
        if (c % CB_FP8_BLOCK == 0) scale = _mm256_set1_ps(cb_fp8_scale(W, br, c / CB_FP8_BLOCK));
        V16 w = load_fp8(row + c, scale);
#pragma GCC unroll 4
        for (int j = 0; j < nx; j++) acc[j] = v16_fma(w, v16_load_f32(X + (size_t)j * ldx + c), acc[j]);
    }
    float s = main_cols < cols ? cb_fp8_scale(W, br, main_cols / CB_FP8_BLOCK) : 0.0f;
#pragma GCC unroll 4
    for (int j = 0; j < nx; j++) {
        const float *x = X + (size_t)j * ldx;
        float sum = v16_reduce(acc[j]);
        for (int c = main_cols; c < cols; c++) {
            float w = cb_e4m3_table[row[c]] * s;
            sum = __builtin_fmaf(w, x[c], sum);
        }
        Y[(size_t)j * ldy + r] = sum;
    }
}

CB_BLOCKSCALED_ROWS_AVX2(cb_fp8, cb_fp8matrix)

#endif
