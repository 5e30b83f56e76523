/* fp8_simd.h: the body of fp8.h's SIMD kernels, a template instantiated once per ISA (fp8_avx2.c, fp8_avx512.c).
 * Every result equals cb_fp8_rows_scalar bit for bit: each weight is the f32 product e4m3 * scale, accumulated with
 * the 16-lane fma and the reduction tree of the ISA's V16 header.
 *
 * Decoding without a table. An e4m3fn byte s.eeee.mmm, moved into an f16's bits as s.0eeee.mmm0000000, is an f16
 * of the same sign and digits whose exponent bias is 15 instead of 7: its value is exactly e4m3 / 256, subnormals
 * included (they become f16 subnormals of the same digits). F16C widens it to f32 exactly, and
 *     (e4m3 / 256) * (256 * scale) == e4m3 * scale
 * in f32 too, because both factors are exact and their real product is the same number, rounded once. A widening,
 * a shift, a mask and one conversion per 16 weights replace the table gathers, which made a row gather-bound rather
 * than memory-bound. Two cases keep the gathers, decided once per 128-column block of a row: a block holding a NaN
 * byte (0x7f / 0xff, which the f16 trick would read as a finite number; real checkpoints hold none) and a block
 * whose scale times 256 would overflow.
 *
 * The includer defines CB_TARGET, CB_SUFFIX, V16 with its v16_* primitives (v16_from_f16_bits among them) and
 * `V16 fp8_gather16(__m128i bytes)` (cb_e4m3_table at 16 byte indices), and includes <immintrin.h>. */
#ifndef CB_SUFFIX
#error "fp8_simd.h is a template: define CB_TARGET, CB_SUFFIX, V16 and its primitives first"
#endif

#include <math.h>

#include "blockscaled.h"

#define FP8_INLINE static inline __attribute__((always_inline)) CB_TARGET

/* Whether n bytes (a multiple of 16) hold an e4m3 NaN (0x7f or 0xff: the byte with its top bit set is 0xff). */
FP8_INLINE int has_nan_byte(const uint8_t *p, int n) {
    __m256i any = _mm256_setzero_si256();
    int k = 0;
    for (; k + 32 <= n; k += 32) {
        __m256i b = _mm256_or_si256(_mm256_loadu_si256((const __m256i *)(p + k)), _mm256_set1_epi8((char)0x80));
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(b, _mm256_set1_epi8(-1)));
    }
    int found = _mm256_movemask_epi8(any);
    if (k < n) {
        __m128i b = _mm_or_si128(_mm_loadu_si128((const __m128i *)(p + k)), _mm_set1_epi8((char)0x80));
        found |= _mm_movemask_epi8(_mm_cmpeq_epi8(b, _mm_set1_epi8(-1)));
    }
    return found != 0;
}

/* How one row's 128-column block decodes: `by256` = scale * 256, applied to the f16 trick's e4m3 / 256; or, with
 * `table` set, e4m3 from the table times `scale`: when the block holds a NaN byte, or its scale is finite and above
 * 2^100 (scale * 256 could overflow). Checked once a block, so the 16-column steps carry no test but one flag. */
typedef struct {
    V16 scale, by256;
    int table;
} block_decode;

FP8_INLINE block_decode block_of(const cb_fp8matrix *W, int r, int c, int main_cols) {
    float s = cb_fp8_scale(W, r / CB_FP8_BLOCK, c / CB_FP8_BLOCK);
    int n = main_cols - c < CB_FP8_BLOCK ? main_cols - c : CB_FP8_BLOCK;
    const uint8_t *p = W->w + (size_t)r * (size_t)W->cols + (size_t)c;
    block_decode b = {v16_set1(s), v16_set1(s * 256.0f), (isfinite(s) && fabsf(s) > 0x1p100f) || has_nan_byte(p, n)};
    return b;
}

/* 16 weights of a row: e4m3 * scale each. The f16 bits s.0eeee.mmm0000000 are the byte sign-extended to 16 bits,
 * shifted left by 7 (the sign lands in bits 15 and 14), bit 14 cleared. */
FP8_INLINE V16 load_fp8(const uint8_t *p, const block_decode *d) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (__builtin_expect(d->table, 0)) return v16_mul(fp8_gather16(bytes), d->scale);
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16((short)0xbfff));
    return v16_mul(v16_from_f16_bits(h), d->by256);
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
    const int cols = W->cols, main_cols = cols - cols % 16;
    V16 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < nx; j++) acc[j] = v16_zero();
    block_decode d = {v16_zero(), v16_zero(), 0};
    for (int c = 0; c < main_cols; c += 16) {
        if (c % CB_FP8_BLOCK == 0) d = block_of(W, r, c, main_cols);
        V16 w = load_fp8(row + c, &d);
#pragma GCC unroll 4
        for (int j = 0; j < nx; j++) acc[j] = v16_fma(w, v16_load_f32(X + (size_t)j * ldx + c), acc[j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < nx; j++) Y[(size_t)j * ldy + r] = row_tail(W, r, X + (size_t)j * ldx, v16_reduce(acc[j]));
}

/* Rows r .. r+3 against one input, into y[r .. r+3]: four independent fma chains. */
FP8_INLINE void rows4_tile(float *y, const cb_fp8matrix *W, int r, const float *x) {
    const size_t cols = (size_t)W->cols;
    const int main_cols = W->cols - W->cols % 16;
    const uint8_t *row = W->w + (size_t)r * cols;
    V16 acc[4];
    block_decode d[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        acc[i] = v16_zero();
        d[i] = (block_decode){v16_zero(), v16_zero(), 0};
    }
    for (int c = 0; c < main_cols; c += 16) {
        if (c % CB_FP8_BLOCK == 0)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) d[i] = block_of(W, r + i, c, main_cols);
        V16 xv = v16_load_f32(x + c);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) acc[i] = v16_fma(load_fp8(row + (size_t)i * cols + (size_t)c, &d[i]), xv, acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) y[r + i] = row_tail(W, r + i, x, v16_reduce(acc[i]));
}

CB_BLOCKSCALED_ROWS(cb_fp8, cb_fp8matrix, CB_SUFFIX)
