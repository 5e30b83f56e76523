/* quant_avx2.c: the AVX2 register tiles of quant_impl.h (vpmaddubsw + vpmaddwd), 8 items per tile (8 x 1 or
 * 4 x 2: each weight vector loaded once for N inputs, each activation vector once for R rows).
 *
 * vpmaddubsw multiplies unsigned by signed bytes, so:
 *   int8 x int8:  |w| (unsigned, <= 128) times x with w's sign applied (vpsignb), pairs summed into int16
 *                 (at most 2 * 128 * 127 = 32512: no saturation), then vpmaddwd by 1 into int32.
 *   int4 x int8:  the stored nibble u = level + 8 (unsigned, 0..15) times x; sum(u * x) - 8 * sum(x) is the exact
 *                 sum(level * x). Low nibbles are the group's even columns, high nibbles its odd columns, which is
 *                 why the activations come pre-split (cb_qact.q_split).
 * The 8 accumulators are reduced together (reduce8: item k's sum in lane k), so the float combination of quant.h
 * runs on 8 items at once, lane by lane the scalar order. All sums are exact integers, so the grouping differs
 * from the scalar loop without changing a bit. */
#include "quant_impl.h"

#if CB_HAVE_X86_QUANT
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline)) TARGET

INLINE __m256i reduce8(const __m256i v[8]) {
    __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

INLINE void q8_tile(float *out, const cb_qtile *t, const int R, const int N) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_si256();
    const int cols = t->cols, main_cols = cols - cols % 32;
    cb_qprefetch pf = cb_qprefetch_begin(t, cols / 32);
    for (int c = 0; c < main_cols; c += 32) {
        cb_qprefetch_step(&pf);
        __m256i xv[2];
#pragma GCC unroll 2
        for (int j = 0; j < N; j++) xv[j] = _mm256_loadu_si256((const __m256i *)(t->x[j] + c));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)((const int8_t *)t->w[r] + c)), w_abs = _mm256_abs_epi8(w);
#pragma GCC unroll 2
            for (int j = 0; j < N; j++) {
                __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv[j], w));
                acc[j * R + r] = _mm256_add_epi32(acc[j * R + r], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    int32_t sum[8];
    _mm256_storeu_si256((__m256i *)sum, reduce8(acc));
    for (int k = 0; k < 8; k++) {
        const int8_t *w = t->w[k % R], *x = t->x[k / R];
        for (int c = main_cols; c < cols; c++) sum[k] += (int32_t)w[c] * (int32_t)x[c];
    }
    __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)sum)), _mm256_loadu_ps(t->w_scale));
    _mm256_storeu_ps(out, _mm256_mul_ps(y, _mm256_loadu_ps(t->x_scale)));
}

INLINE void q4_tile(float *out, const cb_qtile *t, const int R, const int N) {
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
    const int groups = t->groups;
    int row_of_lane[8];
    for (int k = 0; k < 8; k++) row_of_lane[k] = (k % R) * groups;
    const __m256i scale_index = _mm256_loadu_si256((const __m256i *)row_of_lane);
    __m256 s = _mm256_setzero_ps();
    cb_qprefetch pf = cb_qprefetch_begin(t, groups);
    for (int g = 0; g < groups; g++) {
        cb_qprefetch_step(&pf);
        __m256i even[2], odd[2], acc[8];
#pragma GCC unroll 2
        for (int j = 0; j < N; j++) {
            even[j] = _mm256_loadu_si256((const __m256i *)(t->x_split[j] + (size_t)g * 64));
            odd[j] = _mm256_loadu_si256((const __m256i *)(t->x_split[j] + (size_t)g * 64 + 32));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)((const uint8_t *)t->w[r] + (size_t)g * 32));
            __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
#pragma GCC unroll 2
            for (int j = 0; j < N; j++) {
                /* Each int16 lane: at most 2 * 15 * 127 = 3810 per product pair, 7620 after the add. */
                __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, even[j]), _mm256_maddubs_epi16(hi, odd[j]));
                acc[j * R + r] = _mm256_madd_epi16(pairs, ones);
            }
        }
        __m256i offset = N == 1 ? _mm256_set1_epi32(t->group_sums[0][g])
                                : _mm256_set_m128i(_mm_set1_epi32(t->group_sums[1][g]), _mm_set1_epi32(t->group_sums[0][g]));
        __m256i sum = _mm256_sub_epi32(reduce8(acc), _mm256_slli_epi32(offset, 3));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_i32gather_ps(t->w_scales + g, scale_index, 4), s);
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(s, _mm256_loadu_ps(t->x_scale)));
}

static TARGET void q8_8x1(float *out, const cb_qtile *t) { q8_tile(out, t, 8, 1); }
static TARGET void q8_4x2(float *out, const cb_qtile *t) { q8_tile(out, t, 4, 2); }
static TARGET void q4_8x1(float *out, const cb_qtile *t) { q4_tile(out, t, 8, 1); }
static TARGET void q4_4x2(float *out, const cb_qtile *t) { q4_tile(out, t, 4, 2); }

TARGET void cb_q8_tile_avx2(float *out, const cb_qtile *t) { (t->N == 1 ? q8_8x1 : q8_4x2)(out, t); }
TARGET void cb_q4_tile_avx2(float *out, const cb_qtile *t) { (t->N == 1 ? q4_8x1 : q4_4x2)(out, t); }

#endif
