/* quant_avx2.c: the AVX2 register tiles (quant_avx2_tile.h) for AVX2 and AVX-VNNI.
 *
 * int8 x int8: vpmaddubsw and vpdpbusd multiply unsigned by signed bytes.
 *   AVX2:     |w| (unsigned, <= 128) times x with w's sign applied (vpsignb), pairs summed into int16 (at most
 *             2 * 128 * 127 = 32512: no saturation), then vpmaddwd by 1 into int32. The sign step depends on both
 *             operands, so it runs per item.
 *   AVX-VNNI: w + 128 (w XOR 0x80, unsigned 0..255, once per weight vector) times x straight into int32, then
 *             sum(w * x) = sum((w + 128) * x) - 128 * sum(x) with the input's level sum from cb_qact.sums. The
 *             partial sums may wrap int32; the adds wrap, and the true total fits, so the result is exact.
 * int4 x int8: vpmaddubsw pairs into int16 (at most 2 * 15 * 127 = 3810 a pair, 7620 after adding the odd
 * columns' pair) then vpmaddwd by 1, or two vpdpbusd straight into int32. */
#include "quant_impl.h"

#if CB_HAVE_X86_QUANT
#include <immintrin.h>

/* ---- AVX2 ---- */
#define QT_TARGET __attribute__((target("avx2,fma")))
#define QT_SUFFIX _avx2
#define QT_Q8_BIAS 0
#define QT_PRIM static inline __attribute__((always_inline)) QT_TARGET

QT_PRIM __m256i q8_weights(__m256i w) { return _mm256_abs_epi8(w); }
QT_PRIM __m256i q8_step(__m256i acc, __m256i w_abs, __m256i w, __m256i x) {
    __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
QT_PRIM __m256i q8_fix(__m256i sum, __m256i x_sum) {
    (void)x_sum;
    return sum;
}
QT_PRIM __m256i q4_pair(__m256i lo, __m256i hi, __m256i even, __m256i odd) {
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

#include "quant_avx2_tile.h"

#undef QT_PRIM
#undef QT_Q8_BIAS
#undef QT_SUFFIX
#undef QT_TARGET

/* ---- AVX-VNNI ---- */
#if CB_HAVE_AVX_VNNI
#define QT_TARGET __attribute__((target("avx2,fma,avxvnni")))
#define QT_SUFFIX _avx2vnni
#define QT_Q8_BIAS 128
#define QT_PRIM static inline __attribute__((always_inline)) QT_TARGET

#define q8_weights q8_weights_vnni
#define q8_step q8_step_vnni
#define q8_fix q8_fix_vnni
#define q4_pair q4_pair_vnni

QT_PRIM __m256i q8_weights_vnni(__m256i w) { return _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)); }
QT_PRIM __m256i q8_step_vnni(__m256i acc, __m256i w_biased, __m256i w, __m256i x) {
    (void)w;
    return _mm256_dpbusd_avx_epi32(acc, w_biased, x);
}
QT_PRIM __m256i q8_fix_vnni(__m256i sum, __m256i x_sum) { return _mm256_sub_epi32(sum, _mm256_slli_epi32(x_sum, 7)); }
QT_PRIM __m256i q4_pair_vnni(__m256i lo, __m256i hi, __m256i even, __m256i odd) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, even), hi, odd);
}

#include "quant_avx2_tile.h"
#endif

#endif
