/* int4_packed_avx2.c: the AVX2 decode of int4_packed.h. 16 columns (8 bytes) at a time: the nibbles are split and
 * interleaved back into column order, widened to int32, offset by -8, converted (exact) and multiplied by the
 * group's scale: the scalar path's f32 product, so the rows equal cb_i4p_dequant_row_scalar bit for bit. Compiled
 * with target attributes; the dispatcher only calls it when cb_get_isa() is AVX2 or better. */
#include "int4_packed.h"
#include "kernels_impl.h"

#if CB_HAVE_X86_KERNELS
#include <immintrin.h>
#include <string.h>

#define CB_TARGET __attribute__((target("avx2,fma,f16c")))

CB_TARGET void cb_i4p_dequant_row_avx2(float *out, const cb_i4pmatrix *W, int r) {
    const uint8_t *row = W->w + (size_t)r * (size_t)(W->cols / 2);
    const __m128i mask = _mm_set1_epi8(15);
    const __m256i offset = _mm256_set1_epi32(CB_I4P_OFFSET);
    __m256 scale = _mm256_setzero_ps();
    for (int c = 0; c < W->cols; c += CB_I4P_LANES) {
        if (c % W->group == 0) scale = _mm256_set1_ps(cb_i4p_scale(W, r, c / W->group));
        long long packed;
        memcpy(&packed, row + c / 2, 8);
        __m128i bytes = _mm_cvtsi64_si128(packed);
        __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        __m128i nib = _mm_unpacklo_epi8(lo, hi);   /* column order: byte i low, byte i high, ... */
        __m256i a = _mm256_sub_epi32(_mm256_cvtepu8_epi32(nib), offset);
        __m256i b = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(nib, nib)), offset);
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_cvtepi32_ps(a), scale));
        _mm256_storeu_ps(out + c + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(b), scale));
    }
}

#endif
