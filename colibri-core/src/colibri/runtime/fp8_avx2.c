/* fp8_avx2.c: the AVX2 instantiation of fp8_simd.h (a V16 is two 8-lane registers). Compiled with target
 * attributes; the dispatcher only calls it when cb_get_isa() is AVX2 or better. */
#include "fp8.h"

#include "kernels_impl.h"

#if CB_HAVE_X86_KERNELS
#include <immintrin.h>

#define CB_TARGET __attribute__((target("avx2,fma,f16c")))
#define CB_SUFFIX _avx2
#include "kernels_v16_avx2.h"

/* cb_e4m3_table at 16 byte indices: two 8-lane gathers. */
static inline __attribute__((always_inline)) CB_TARGET V16 fp8_gather16(__m128i bytes) {
    __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
    V16 v = {_mm256_i32gather_ps(cb_e4m3_table, lo, 4), _mm256_i32gather_ps(cb_e4m3_table, hi, 4)};
    return v;
}

#include "fp8_simd.h"

#endif
