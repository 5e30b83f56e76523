/* kernels_v16_avx2.h: the 16-lane primitives of kernels_simd.h on two AVX2 registers (lanes 0-7 and 8-15), so
 * the first step of the reduction tree (lane i + lane i+8) is one add of the two halves. Included by
 * kernels_avx2.c, and by kernels_avx512.c in its test-only CB_AVX512_ON_AVX2 build. The includer defines
 * CB_TARGET (at least "avx2,fma,f16c") and includes <immintrin.h>. */
#ifndef COLIBRI_KERNELS_V16_AVX2_H
#define COLIBRI_KERNELS_V16_AVX2_H

#include "kernels_tree8.h"

typedef struct {
    __m256 lo, hi;
} V16;

static inline __attribute__((always_inline)) CB_TARGET V16 v16_zero(void) {
    V16 v = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return v;
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_load_f32(const float *p) {
    V16 v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return v;
}
static inline __attribute__((always_inline)) CB_TARGET __m256 bf16x8_to_f32(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_load_bf16(const uint16_t *p) {
    V16 v = {bf16x8_to_f32(p), bf16x8_to_f32(p + 8)};
    return v;
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_load_f16(const uint16_t *p) {
    V16 v = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
    return v;
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_fma(V16 w, V16 x, V16 acc) {
    V16 v = {_mm256_fmadd_ps(w.lo, x.lo, acc.lo), _mm256_fmadd_ps(w.hi, x.hi, acc.hi)};
    return v;
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_set1(float a) {
    V16 v = {_mm256_set1_ps(a), _mm256_set1_ps(a)};
    return v;
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_add(V16 a, V16 b) {
    V16 v = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
    return v;
}
static inline __attribute__((always_inline)) CB_TARGET V16 v16_mul(V16 a, V16 b) {
    V16 v = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
    return v;
}
static inline __attribute__((always_inline)) CB_TARGET void v16_store(float *p, V16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline __attribute__((always_inline)) CB_TARGET float v16_reduce(V16 v) {
    __m256 s8 = _mm256_add_ps(v.lo, v.hi);                                       /* s8[i] = l[i] + l[i+8] */
    return cb_tree8_reduce(s8);
}
/* 16 f16 bit patterns as f32, exactly. */
static inline __attribute__((always_inline)) CB_TARGET V16 v16_from_f16_bits(__m256i h) {
    V16 v = {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
    return v;
}

#endif
