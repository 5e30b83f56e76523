/* kernels_v16_avx512.h: the 16-lane primitives of kernels_simd.h on one AVX-512 register; the reduction folds
 * 512 -> 256 bits first (lane i + lane i+8), then the shared 8-lane tree, exactly as the AVX2 and scalar paths do.
 * Included by kernels_avx512.c and fp8_avx512.c. The includer defines CB_TARGET (at least "avx512f,avx2,fma,f16c")
 * and includes <immintrin.h>. */
#ifndef COLIBRI_KERNELS_V16_AVX512_H
#define COLIBRI_KERNELS_V16_AVX512_H

#include "kernels_tree8.h"

typedef __m512 V16;

static inline __attribute__((always_inline)) CB_TARGET V16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) CB_TARGET V16 v16_load_f32(const float *p) {
    return _mm512_loadu_ps(p);
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_load_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_fma(V16 w, V16 x, V16 acc) {
    return _mm512_fmadd_ps(w, x, acc);
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_set1(float a) { return _mm512_set1_ps(a); }
static inline __attribute__((always_inline)) CB_TARGET V16 v16_add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
static inline __attribute__((always_inline)) CB_TARGET V16 v16_mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) CB_TARGET void v16_store(float *p, V16 v) { _mm512_storeu_ps(p, v); }
static inline __attribute__((always_inline)) CB_TARGET float v16_reduce(V16 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);                                           /* s8[i] = l[i] + l[i+8] */
    return cb_tree8_reduce(s8);
}

/* 16 f16 bit patterns as f32, exactly. */
static inline __attribute__((always_inline)) CB_TARGET V16 v16_from_f16_bits(__m256i h) { return _mm512_cvtph_ps(h); }

#endif
