/* kernels_avx2.c: AVX2 + FMA + F16C instantiation of kernels_simd.h (16-lane primitives in kernels_v16_avx2.h).
 * Compiled with target attributes: the file builds with plain `cc -O2` and only runs when the dispatcher has
 * checked the CPU. Tiles are smaller than AVX-512's because a 16-lane accumulator takes two of the 16 registers. */
#include "kernels_impl.h"

#if CB_HAVE_X86_KERNELS
#include <immintrin.h>

#define CB_TARGET __attribute__((target("avx2,fma,f16c")))
#define CB_SUFFIX _avx2
#define MV_ROWS 4
#define MM_ROWS 2
#define MM_INPUTS 2

#include "kernels_v16_avx2.h"
#include "kernels_simd.h"

/* A product, then a sum, each rounded (the file is built with -ffp-contract=off, so neither the intrinsics nor the
 * tail's C become a fused multiply-add): the scalar expression's bits in every lane. */
CB_TARGET void cb_axpy_avx2(float *y, float a, const float *x, size_t n) {
    __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_mul_ps(va, _mm256_loadu_ps(x + i))));
    for (; i < n; i++) y[i] += a * x[i];
}

#endif
