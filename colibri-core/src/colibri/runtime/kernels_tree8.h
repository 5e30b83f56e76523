/* kernels_tree8.h: the last three levels of the reduction tree (8 -> 4 -> 2 -> 1 lanes) that every x86 16-lane
 * path ends with, so AVX2 and AVX-512 fold in the same order as the scalar cb_lane16_reduce. The includer defines
 * CB_TARGET and includes <immintrin.h>. */
#ifndef COLIBRI_KERNELS_TREE8_H
#define COLIBRI_KERNELS_TREE8_H

static inline __attribute__((always_inline)) CB_TARGET float cb_tree8_reduce(__m256 s8) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* s8[i] + s8[i+4] */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                            /* s4[i] + s4[i+2] */
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));                        /* s2[0] + s2[1] */
    return _mm_cvtss_f32(s1);
}

#endif
