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

#include "kernels_v16_avx512.h"

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
