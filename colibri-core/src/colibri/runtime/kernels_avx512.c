/* kernels_avx512.c: AVX-512F instantiation of kernels_simd.h (one 16-lane register per accumulator; the
 * reduction tree folds 512 -> 256 -> 128 bits exactly as the AVX2 and scalar paths do). Compiled with target
 * attributes, so the file builds with plain `cc -O2`; it only runs when the dispatcher has checked the CPU.
 *
 * CB_AVX512_ON_AVX2 (tests only): build the same tile shapes on AVX2 registers under the suffix _avx512_on_avx2,
 * so a machine without AVX-512 still checks everything but the primitives below. */
#include "kernels_impl.h"

#if CB_HAVE_X86_KERNELS
#include <immintrin.h>

#define MV_ROWS 4
#define MM_ROWS 4
#define MM_INPUTS 4

#ifndef CB_AVX512_ON_AVX2

#define CB_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
#define CB_SUFFIX _avx512

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

/* As cb_axpy_avx2: a rounded product, then a rounded sum, lane by lane. */
CB_TARGET void cb_axpy_avx512(float *y, float a, const float *x, size_t n) {
    __m512 va = _mm512_set1_ps(a);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_mul_ps(va, _mm512_loadu_ps(x + i))));
    for (; i < n; i++) y[i] += a * x[i];
}

#else /* CB_AVX512_ON_AVX2 */

#define CB_TARGET __attribute__((target("avx2,fma,f16c")))
#define CB_SUFFIX _avx512_on_avx2

#include "kernels_v16_avx2.h"

void cb_rows_avx512_on_avx2(float *Y, size_t ldy, const void *W, cb_dtype dt, const float *X, size_t ldx, int n,
                            int r0, int r1, int cols);
void cb_convert_avx512_on_avx2(float *out, const void *in, cb_dtype dt, size_t n);
void cb_axpy_rows_avx512_on_avx2(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m,
                                 size_t n);

#endif /* CB_AVX512_ON_AVX2 */

#include "kernels_simd.h"

#endif
