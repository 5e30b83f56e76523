/* fp8_avx512.c: the AVX-512 instantiation of fp8_simd.h (a V16 is one 16-lane register: one f16 conversion and one
 * fma per 16 weights, where AVX2 needs two of each). Compiled with target attributes; the dispatcher only calls it
 * when cb_get_isa() is AVX-512. */
#include "fp8.h"

#include "kernels_impl.h"

#if CB_HAVE_X86_KERNELS
#include <immintrin.h>

#define CB_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
#define CB_SUFFIX _avx512
#include "kernels_v16_avx512.h"

/* cb_e4m3_table at 16 byte indices: one 16-lane gather. */
static inline __attribute__((always_inline)) CB_TARGET V16 fp8_gather16(__m128i bytes) {
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(bytes), cb_e4m3_table, 4);
}

#include "fp8_simd.h"

#endif
