/* quant_avx512.c: the AVX-512 register tiles (quant_avx512_tile.h) for AVX-512 BW and AVX-512 VNNI.
 *
 * int8 x int8: vpmaddubsw and vpdpbusd multiply unsigned by signed bytes.
 *   BW:   |w| (unsigned, <= 128) times x with w's sign applied (a mask from w's sign bits selects 0 - x; x is never
 *         -128, so the negation is exact); pairs summed into int16 (at most 2 * 128 * 127 = 32512: no saturation),
 *         then vpmaddwd by 1 into int32. The sign step depends on both operands, so it runs per item.
 *   VNNI: w + 128 (w XOR 0x80, unsigned 0..255, once per weight vector) times x straight into int32, then
 *         sum(w * x) = sum((w + 128) * x) - 128 * sum(x) with the input's level sum from cb_qact.sums. The partial
 *         sums may wrap int32; the adds wrap, and the true total fits, so the result is exact.
 * int4 x int8: the stored nibble u = level + 8 (unsigned) times the split activations, -8 * sum(x) per group added
 * into each item's first lane of that group. One 64-byte register of packed weights covers two groups. */
#include "quant_impl.h"

#if CB_HAVE_X86_QUANT
#include <immintrin.h>

/* ---- AVX-512 BW ---- */
#define QT_TARGET __attribute__((target("avx512f,avx512bw")))
#define QT_SUFFIX _avx512
#define QT_PRIM static inline __attribute__((always_inline)) QT_TARGET

QT_PRIM __m512i q8_weights(__m512i w) { return _mm512_abs_epi8(w); }
QT_PRIM __m512i q8_step(__m512i acc, __m512i w_abs, __m512i w, __m512i x) {
    __m512i x_signed = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w_abs, x_signed), _mm512_set1_epi16(1)));
}
QT_PRIM __m512i q8_fix(__m512i sum, __m512i x_sum) {
    (void)x_sum;
    return sum;
}
QT_PRIM __m512i q4_pair(__m512i acc, __m512i lo, __m512i hi, __m512i even, __m512i odd) {
    /* Each int16 lane: at most 2 * 15 * 127 = 3810 per product pair, 7620 after the add. */
    __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, even), _mm512_maddubs_epi16(hi, odd));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}

#include "quant_avx512_tile.h"

#undef QT_PRIM
#undef QT_SUFFIX
#undef QT_TARGET

/* ---- AVX-512 VNNI ---- */
#define QT_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define QT_SUFFIX _avx512vnni
#define QT_PRIM static inline __attribute__((always_inline)) QT_TARGET

#undef q8_weights
#define q8_weights q8_weights_vnni
#define q8_step q8_step_vnni
#define q8_fix q8_fix_vnni
#define q4_pair q4_pair_vnni

QT_PRIM __m512i q8_weights_vnni(__m512i w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }
QT_PRIM __m512i q8_step_vnni(__m512i acc, __m512i w_biased, __m512i w, __m512i x) {
    (void)w;
    return _mm512_dpbusd_epi32(acc, w_biased, x);
}
QT_PRIM __m512i q8_fix_vnni(__m512i sum, __m512i x_sum) { return _mm512_sub_epi32(sum, _mm512_slli_epi32(x_sum, 7)); }
QT_PRIM __m512i q4_pair_vnni(__m512i acc, __m512i lo, __m512i hi, __m512i even, __m512i odd) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, even), hi, odd);
}

#include "quant_avx512_tile.h"

#endif
