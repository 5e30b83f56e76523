/* quant_avx512.c: the integer dot products on AVX-512 BW (vpmaddubsw/vpmaddwd on 64 bytes) and AVX-512 VNNI
 * (vpdpbusd: unsigned x signed bytes, four products summed straight into int32).
 *
 * The sign handling is the one of quant_avx2.c: |w| as the unsigned operand and x negated where w < 0 (AVX-512 has
 * no vpsignb, so a mask from w's sign bits selects 0 - x; x is never -128, so the negation is exact). int4 uses the
 * offset nibbles u = level + 8 against the split activations and subtracts 8 * sum(x) per group. One 64-byte
 * register of packed int4 weights covers two groups; their sums are reduced separately (low and high 256 bits). */
#include "quant_impl.h"

#if CB_HAVE_X86_QUANT
#include <immintrin.h>

#define TARGET_BW __attribute__((target("avx512f,avx512bw")))
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* Horizontal int32 sums of 256 and 512 bits, once per target: an inline function cannot be inlined into a caller
 * compiled for a wider target set, so each target gets its own copy of the same body. */
#define DEFINE_HSUM(SUFFIX, TARGET)                                                                               \
    TARGET static inline int32_t hsum256_##SUFFIX(__m256i v) {                                                    \
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));                    \
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));                                     \
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));                                     \
        return _mm_cvtsi128_si32(s);                                                                              \
    }                                                                                                             \
    TARGET static inline int32_t hsum512_##SUFFIX(__m512i v) {                                                    \
        return hsum256_##SUFFIX(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));   \
    }

DEFINE_HSUM(bw, TARGET_BW)
DEFINE_HSUM(vnni, TARGET_VNNI)

/* x with w's sign applied: 0 - x in the lanes where w < 0 (lanes where w == 0 are multiplied by |w| = 0). */
#define SIGNED_X(xv, wv) _mm512_mask_sub_epi8((xv), _mm512_movepi8_mask(wv), _mm512_setzero_si512(), (xv))

/* One 64-byte chunk's products |w| * (signed x), four bytes summed into each int32 lane of acc: vpmaddubsw +
 * vpmaddwd on BW, one vpdpbusd on VNNI (the same exact integers). */
TARGET_BW static inline __m512i q8_step_bw(__m512i acc, __m512i w_abs, __m512i x_signed) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w_abs, x_signed), _mm512_set1_epi16(1)));
}

TARGET_VNNI static inline __m512i q8_step_vnni(__m512i acc, __m512i w_abs, __m512i x_signed) {
    return _mm512_dpbusd_epi32(acc, w_abs, x_signed);
}

#define Q8_DOT_BODY(STEP, HSUM)                                                                                   \
    __m512i acc = _mm512_setzero_si512();                                                                         \
    int c = 0;                                                                                                    \
    for (; c + 64 <= cols; c += 64) {                                                                             \
        __m512i wv = _mm512_loadu_si512((const void *)(w + c));                                                   \
        __m512i xv = _mm512_loadu_si512((const void *)(x + c));                                                   \
        acc = STEP(acc, _mm512_abs_epi8(wv), SIGNED_X(xv, wv));                                                   \
    }                                                                                                             \
    int32_t sum = HSUM(acc);                                                                                      \
    for (; c < cols; c++) sum += (int32_t)w[c] * (int32_t)x[c];                                                   \
    return sum;

TARGET_BW int32_t cb_q8_dot_avx512(const int8_t *w, const int8_t *x, int cols) {
    Q8_DOT_BODY(q8_step_bw, hsum512_bw)
}

TARGET_VNNI int32_t cb_q8_dot_avx512vnni(const int8_t *w, const int8_t *x, int cols) {
    Q8_DOT_BODY(q8_step_vnni, hsum512_vnni)
}

/* Two groups' packed weights (64 bytes) as low nibbles and high nibbles, with their activations in the same
 * lane order: lanes 0..31 group g, lanes 32..63 group g + 1. */
#define Q4_PAIR_OPERANDS                                                                                          \
    __m512i packed = _mm512_loadu_si512((const void *)(w + (size_t)g * 32));                                      \
    __m512i lo = _mm512_and_si512(packed, low4);                                                                  \
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);                                            \
    const int8_t *xs = x_split + (size_t)g * 64;                                                                  \
    __m512i even = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xs)),            \
                                      _mm256_loadu_si256((const __m256i *)(xs + 64)), 1);                         \
    __m512i odd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xs + 32))),      \
                                     _mm256_loadu_si256((const __m256i *)(xs + 96)), 1);

/* Both groups' sum(u * x) per 32-bit lane (lanes 0..7 group g, 8..15 group g + 1). */
TARGET_BW static inline __m512i q4_pair_bw(__m512i lo, __m512i even, __m512i hi, __m512i odd) {
    __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, even), _mm512_maddubs_epi16(hi, odd));
    return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
}

TARGET_VNNI static inline __m512i q4_pair_vnni(__m512i lo, __m512i even, __m512i hi, __m512i odd) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, even), hi, odd);
}

#define Q4_DOT_BODY(PAIR, HSUM)                                                                                   \
    const __m512i low4 = _mm512_set1_epi8(0x0f);                                                                  \
    int g = 0;                                                                                                    \
    for (; g + 2 <= groups; g += 2) {                                                                             \
        Q4_PAIR_OPERANDS                                                                                          \
        __m512i sums = PAIR(lo, even, hi, odd);                                                                   \
        acc[g] = HSUM(_mm512_castsi512_si256(sums)) - 8 * group_sums[g];                                          \
        acc[g + 1] = HSUM(_mm512_extracti64x4_epi64(sums, 1)) - 8 * group_sums[g + 1];                            \
    }                                                                                                             \
    if (g < groups) cb_q4_dot_scalar(acc + g, w + (size_t)g * 32, x + (size_t)g * 64, NULL, NULL, groups - g);

TARGET_BW void cb_q4_dot_avx512(int32_t *acc, const uint8_t *w, const int8_t *x, const int8_t *x_split,
                                const int32_t *group_sums, int groups) {
    Q4_DOT_BODY(q4_pair_bw, hsum256_bw)
}

TARGET_VNNI void cb_q4_dot_avx512vnni(int32_t *acc, const uint8_t *w, const int8_t *x, const int8_t *x_split,
                                      const int32_t *group_sums, int groups) {
    Q4_DOT_BODY(q4_pair_vnni, hsum256_vnni)
}

#endif
