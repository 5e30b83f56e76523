/* fp8_avx2.c: the AVX2 body of fp8.h's kernels. Every result equals cb_fp8_rows_scalar bit for bit: each weight is
 * the f32 product e4m3 * scale, accumulated with the 16-lane fma and the reduction tree of kernels_v16_avx2.h.
 * Compiled with target attributes; the dispatcher only calls it when cb_get_isa() is AVX2 or better.
 *
 * Decoding without a table. An e4m3fn byte s.eeee.mmm, moved into an f16's bits as s.0eeee.mmm0000000, is an f16
 * of the same sign and digits whose exponent bias is 15 instead of 7: its value is exactly e4m3 / 256, subnormals
 * included (they become f16 subnormals of the same digits). F16C widens it to f32 exactly, and
 *     (e4m3 / 256) * (256 * scale) == e4m3 * scale
 * in f32 too, because both factors are exact and their real product is the same number, rounded once. Two shifts
 * and one conversion per 8 weights replace two table gathers per 16, which made the row gather-bound rather than
 * memory-bound. Two cases keep the gathers: a 16-byte chunk holding a NaN byte (0x7f / 0xff, which the f16 trick
 * would read as a finite number; real checkpoints hold none) and a block whose scale times 256 would overflow.
 * Decode (one input) runs four rows at once (blockscaled.h says why). */
#include "fp8.h"
#include "blockscaled.h"

#if CB_HAVE_X86_KERNELS
#include <immintrin.h>
#include <math.h>

#define CB_TARGET __attribute__((target("avx2,fma,f16c")))
#include "kernels_v16_avx2.h"

#define FP8_INLINE static inline __attribute__((always_inline)) CB_TARGET

/* A block's scale as the kernels apply it: `by256` = scale * 256 when that is exact, else `table` is set and the
 * block decodes through the table (only a finite scale above 2^119 overflows). */
typedef struct {
    __m256 scale, by256;
    int table;
} block_scale;

FP8_INLINE block_scale scale_of(const cb_fp8matrix *W, int br, int bc) {
    float s = cb_fp8_scale(W, br, bc);
    block_scale b = {_mm256_set1_ps(s), _mm256_set1_ps(s * 256.0f), isfinite(s) && fabsf(s) > 0x1p100f};
    return b;
}

FP8_INLINE V16 load_fp8_table(__m128i bytes, __m256 scale) {
    __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
    V16 v = {_mm256_mul_ps(_mm256_i32gather_ps(cb_e4m3_table, lo, 4), scale),
             _mm256_mul_ps(_mm256_i32gather_ps(cb_e4m3_table, hi, 4), scale)};
    return v;
}

/* 16 weights of a row: e4m3 * scale each (see the top of the file). */
FP8_INLINE V16 load_fp8(const uint8_t *p, const block_scale *s) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    __m128i nan = _mm_cmpeq_epi8(_mm_and_si128(bytes, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    if (__builtin_expect(s->table | _mm_movemask_epi8(nan), 0)) return load_fp8_table(bytes, s->scale);
    __m256i b = _mm256_cvtepu8_epi16(bytes);
    __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16((short)0x8000)),
                                _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
    V16 v = {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s->by256),
             _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s->by256)};
    return v;
}

/* The columns past the last full 16: in order, after the tree (the scalar path's tail). */
FP8_INLINE float row_tail(const cb_fp8matrix *W, int r, const float *x, float sum) {
    const uint8_t *row = W->w + (size_t)r * (size_t)W->cols;
    const int cols = W->cols, main_cols = cols - cols % 16;
    if (main_cols == cols) return sum;
    float s = cb_fp8_scale(W, r / CB_FP8_BLOCK, main_cols / CB_FP8_BLOCK);
    for (int c = main_cols; c < cols; c++) sum = __builtin_fmaf(cb_e4m3_table[row[c]] * s, x[c], sum);
    return sum;
}

/* One row against nx <= 4 inputs: the row's weights are decoded once per 16 columns and reused by every input. */
FP8_INLINE void row_tile(float *Y, size_t ldy, const cb_fp8matrix *W, int r, const float *X, size_t ldx,
                         const int nx) {
    const uint8_t *row = W->w + (size_t)r * (size_t)W->cols;
    const int cols = W->cols, main_cols = cols - cols % 16, br = r / CB_FP8_BLOCK;
    V16 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < nx; j++) acc[j] = v16_zero();
    block_scale s = {_mm256_setzero_ps(), _mm256_setzero_ps(), 0};
    for (int c = 0; c < main_cols; c += 16) {
        if (c % CB_FP8_BLOCK == 0) s = scale_of(W, br, c / CB_FP8_BLOCK);
        V16 w = load_fp8(row + c, &s);
#pragma GCC unroll 4
        for (int j = 0; j < nx; j++) acc[j] = v16_fma(w, v16_load_f32(X + (size_t)j * ldx + c), acc[j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < nx; j++) {
        const float *x = X + (size_t)j * ldx;
        Y[(size_t)j * ldy + r] = row_tail(W, r, x, v16_reduce(acc[j]));
    }
}

/* Rows r .. r+3 against one input, into y[r .. r+3]: four independent fma chains. */
FP8_INLINE void rows4_tile(float *y, const cb_fp8matrix *W, int r, const float *x) {
    const size_t cols = (size_t)W->cols;
    const int main_cols = W->cols - W->cols % 16;
    const uint8_t *row = W->w + (size_t)r * cols;
    V16 acc[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) acc[i] = v16_zero();
    block_scale s[4] = {{_mm256_setzero_ps(), _mm256_setzero_ps(), 0}};
    for (int c = 0; c < main_cols; c += 16) {
        if (c % CB_FP8_BLOCK == 0)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) s[i] = scale_of(W, (r + i) / CB_FP8_BLOCK, c / CB_FP8_BLOCK);
        V16 xv = v16_load_f32(x + c);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) acc[i] = v16_fma(load_fp8(row + (size_t)i * cols + (size_t)c, &s[i]), xv, acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) y[r + i] = row_tail(W, r + i, x, v16_reduce(acc[i]));
}

CB_BLOCKSCALED_ROWS_AVX2(cb_fp8, cb_fp8matrix)

#endif
