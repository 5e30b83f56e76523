/* quant_avx2.c: the integer dot products on AVX2 (vpmaddubsw + vpmaddwd).
 *
 * vpmaddubsw multiplies unsigned by signed bytes, so:
 *   int8 x int8:  |w| (unsigned, <= 127) times x with w's sign applied (vpsignb), pairs summed into int16
 *                 (at most 2 * 127 * 127 = 32258: no saturation), then vpmaddwd by 1 into int32.
 *   int4 x int8:  the stored nibble u = level + 8 (unsigned, 1..15) times x; sum(u * x) - 8 * sum(x) is the exact
 *                 sum(level * x). Low nibbles are the group's even columns, high nibbles its odd columns, which is
 *                 why the activations come pre-split (cb_qact.q_split).
 * All sums are exact integers, so the grouping differs from the scalar loop without changing a bit. */
#include "quant_impl.h"

#if CB_HAVE_X86_QUANT
#include <immintrin.h>

#define TARGET __attribute__((target("avx2")))

TARGET static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

TARGET int32_t cb_q8_dot_avx2(const int8_t *w, const int8_t *x, int cols) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    int c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + c));
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x + c));
        __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
    }
    int32_t sum = hsum_epi32(acc);
    for (; c < cols; c++) sum += (int32_t)w[c] * (int32_t)x[c];
    return sum;
}

TARGET void cb_q4_dot_avx2(int32_t *acc, const uint8_t *w, const int8_t *x, const int8_t *x_split,
                           const int32_t *group_sums, int groups) {
    (void)x;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < groups; g++) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)(w + (size_t)g * 32));
        __m256i lo = _mm256_and_si256(packed, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        __m256i even = _mm256_loadu_si256((const __m256i *)(x_split + (size_t)g * 64));
        __m256i odd = _mm256_loadu_si256((const __m256i *)(x_split + (size_t)g * 64 + 32));
        /* Each int16 lane: at most 2 * 15 * 127 = 3810 per product pair, 7620 after the add. */
        __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
        acc[g] = hsum_epi32(_mm256_madd_epi16(pairs, ones)) - 8 * group_sums[g];
    }
}

#endif
