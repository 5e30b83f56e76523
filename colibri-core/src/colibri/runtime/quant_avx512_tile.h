/* quant_avx512_tile.h: the AVX-512 register tiles of quant_impl.h, written once and instantiated by
 * quant_avx512.c for AVX-512 BW (vpmaddubsw + vpmaddwd) and AVX-512 VNNI (vpdpbusd).
 *
 * A tile is R weight rows x N inputs (16 items: 16 x 1, 8 x 2 or 4 x 4); every item has its own 512-bit int32
 * accumulator, each weight vector is loaded once for N inputs and each activation vector once for R rows. The
 * 16 accumulators are then reduced together by a transposing tree (reduce_pair) that leaves item k's sum in lane
 * k, so the float combination runs on 16 items at once: for int4 one vfmadd per group in group order, which is the
 * scalar fmaf chain of quant.h lane by lane. All integer sums are exact (wrapping int32 adds of values whose true
 * total fits int32), so none of this regrouping changes a bit.
 *
 * The includer defines QT_TARGET, QT_SUFFIX and the always-inline primitives:
 *   q8_weights(w)            the int8 weight vector as the step's weight operand
 *   q8_step(acc, wop, w, x)  acc + the 64 products w * x, four per int32 lane
 *   q8_fix(sum, x_sum)       the exact sum(w * x) from the step's sums (x_sum: the input's level sum per lane)
 *   q4_pair(acc, lo, hi, even, odd)  acc + lo * even + hi * odd (unsigned nibbles times signed levels)
 */
#ifndef QT_SUFFIX
#error "quant_avx512_tile.h is a template: define QT_TARGET, QT_SUFFIX and the q8_/q4_ primitives first"
#endif

#define QT_CAT_(a, b) a##b
#define QT_CAT(a, b) QT_CAT_(a, b)
#define QT_NAME(base) QT_CAT(base, QT_SUFFIX)
#define QT_INLINE static inline __attribute__((always_inline)) QT_TARGET

/* Lane-wise sums of 4 vectors whose 128-bit chunk c holds 4 partial sums of item (vector p, chunk c): lane
 * 4c + p of the result is that item's total. */
QT_INLINE __m512i QT_NAME(sum4_)(const __m512i g[4]) {
    __m512i p0 = _mm512_add_epi32(_mm512_unpacklo_epi32(g[0], g[1]), _mm512_unpackhi_epi32(g[0], g[1]));
    __m512i p1 = _mm512_add_epi32(_mm512_unpacklo_epi32(g[2], g[3]), _mm512_unpackhi_epi32(g[2], g[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(p0, p1), _mm512_unpackhi_epi64(p0, p1));
}

/* v[k] holds item k's partial sums, lanes 0..7 for group A and 8..15 for group B. out_a lane k = item k's group
 * A total, out_b lane k its group B total. Chunks are paired (v[T(2m)], v[T(2m+1)]) with T(i) = 4 (i % 4) + i / 4,
 * the transpose that sum4_'s lane order undoes. */
QT_INLINE void QT_NAME(reduce_pair_)(const __m512i v[16], __m512i *out_a, __m512i *out_b) {
    __m512i u[8], ga[4], gb[4];
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) {
        const int i = 2 * m, k = i + 1;
        __m512i a = v[4 * (i % 4) + i / 4], b = v[4 * (k % 4) + k / 4];
        /* [a.A, a.B, b.A, b.B], each 4 partials: chunk 0 + 1 and chunk 2 + 3 of each. */
        u[m] = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        ga[i] = _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0x88);
        gb[i] = _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], 0xdd);
    }
    *out_a = QT_NAME(sum4_)(ga);
    *out_b = QT_NAME(sum4_)(gb);
}

QT_INLINE void QT_NAME(q8_chunk_)(__m512i acc[16], const cb_qtile *t, int c, __mmask64 m, const int R, const int N) {
    __m512i xv[CB_QTILE_MAX_INPUTS];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) xv[j] = _mm512_maskz_loadu_epi8(m, t->x[j] + c);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        __m512i w = _mm512_maskz_loadu_epi8(m, (const int8_t *)t->w[r] + c);
        __m512i wop = q8_weights(w);
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) acc[j * R + r] = q8_step(acc[j * R + r], wop, w, xv[j]);
    }
}

QT_INLINE void QT_NAME(q8_tile_)(float *out, const cb_qtile *t, const int R, const int N) {
    __m512i acc[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_si512();
    const int cols = t->cols, main_cols = cols - cols % 64;
    cb_qprefetch pf = cb_qprefetch_begin(t, cols / 64);
    for (int c = 0; c < main_cols; c += 64) {
        cb_qprefetch_step(&pf);
        QT_NAME(q8_chunk_)(acc, t, c, ~(__mmask64)0, R, N);
    }
    if (main_cols < cols) QT_NAME(q8_chunk_)(acc, t, main_cols, ~(__mmask64)0 >> (64 - (cols - main_cols)), R, N);
    __m512i a, b;
    QT_NAME(reduce_pair_)(acc, &a, &b);
    __m512i sum = q8_fix(_mm512_add_epi32(a, b), _mm512_loadu_si512((const void *)t->x_sum));
    __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_loadu_ps(t->w_scale));
    _mm512_storeu_ps(out, _mm512_mul_ps(y, _mm512_loadu_ps(t->x_scale)));
}

/* Integer sums of groups g and g + 1 (or g alone when `two` is 0: the upper 256 bits are then zero) for every item,
 * offset-corrected: lane k of *a / *b is item k's exact sum(level * x) over that group. */
QT_INLINE void QT_NAME(q4_groups_)(__m512i *a, __m512i *b, const cb_qtile *t, int g, const int two, const int R,
                                   const int N) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i to_lanes_0_8 = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i even[CB_QTILE_MAX_INPUTS], odd[CB_QTILE_MAX_INPUTS], corr[CB_QTILE_MAX_INPUTS], acc[16];
#pragma GCC unroll 4
    for (int j = 0; j < N; j++) {
        const int8_t *xs = t->x_split[j] + (size_t)g * 64;
        __m256i e0 = _mm256_loadu_si256((const __m256i *)xs), o0 = _mm256_loadu_si256((const __m256i *)(xs + 32));
        __m256i e1 = two ? _mm256_loadu_si256((const __m256i *)(xs + 64)) : _mm256_setzero_si256();
        __m256i o1 = two ? _mm256_loadu_si256((const __m256i *)(xs + 96)) : _mm256_setzero_si256();
        even[j] = _mm512_inserti64x4(_mm512_castsi256_si512(e0), e1, 1);
        odd[j] = _mm512_inserti64x4(_mm512_castsi256_si512(o0), o1, 1);
        /* -8 * sum(x) of each group in the first partial lane of its half: u = level + 8. */
        __m128i sums = two ? _mm_loadl_epi64((const __m128i *)(t->group_sums[j] + g))
                           : _mm_cvtsi32_si128(t->group_sums[j][g]);
        __m128i neg8 = _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sums, 3));
        corr[j] = _mm512_maskz_permutexvar_epi32(0x0101, to_lanes_0_8, _mm512_castsi128_si512(neg8));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        const uint8_t *w = (const uint8_t *)t->w[r] + (size_t)g * 32;
        __m512i packed = two ? _mm512_loadu_si512((const void *)w)
                             : _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256((const __m256i *)w), 0);
        __m512i lo = _mm512_and_si512(packed, low4), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
#pragma GCC unroll 4
        for (int j = 0; j < N; j++) acc[j * R + r] = q4_pair(corr[j], lo, hi, even[j], odd[j]);
    }
    QT_NAME(reduce_pair_)(acc, a, b);
}

QT_INLINE void QT_NAME(q4_tile_)(float *out, const cb_qtile *t, const int R, const int N) {
    const int groups = t->groups;
    int row_of_lane[16];
    for (int k = 0; k < 16; k++) row_of_lane[k] = (k % R) * groups;
    const __m512i scale_index = _mm512_loadu_si512((const void *)row_of_lane);
    __m512 s = _mm512_setzero_ps();
    cb_qprefetch pf = cb_qprefetch_begin(t, groups / 2);
    int g = 0;
    for (; g + 2 <= groups; g += 2) {
        cb_qprefetch_step(&pf);
        __m512i a, b;
        QT_NAME(q4_groups_)(&a, &b, t, g, 1, R, N);
        s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_i32gather_ps(scale_index, t->w_scales + g, 4), s);
        s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_i32gather_ps(scale_index, t->w_scales + g + 1, 4), s);
    }
    if (g < groups) {
        __m512i a, b;
        QT_NAME(q4_groups_)(&a, &b, t, g, 0, R, N);
        s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_i32gather_ps(scale_index, t->w_scales + g, 4), s);
    }
    _mm512_storeu_ps(out, _mm512_mul_ps(s, _mm512_loadu_ps(t->x_scale)));
}

/* One out-of-line body per tile shape, so R and N are constants in the unrolled loops. */
#define QT_SHAPES(KIND)                                                                                            \
    static QT_TARGET void QT_NAME(KIND##_16x1_)(float *out, const cb_qtile *t) { QT_NAME(KIND##_tile_)(out, t, 16, 1); } \
    static QT_TARGET void QT_NAME(KIND##_8x2_)(float *out, const cb_qtile *t) { QT_NAME(KIND##_tile_)(out, t, 8, 2); }   \
    static QT_TARGET void QT_NAME(KIND##_4x4_)(float *out, const cb_qtile *t) { QT_NAME(KIND##_tile_)(out, t, 4, 4); }   \
    QT_TARGET void QT_NAME(cb_##KIND##_tile)(float *out, const cb_qtile *t) {                                    \
        if (t->N == 1) QT_NAME(KIND##_16x1_)(out, t);                                                             \
        else if (t->N == 2) QT_NAME(KIND##_8x2_)(out, t);                                                         \
        else QT_NAME(KIND##_4x4_)(out, t);                                                                        \
    }

QT_SHAPES(q8)
QT_SHAPES(q4)

#undef QT_SHAPES
#undef QT_INLINE
#undef QT_NAME
#undef QT_CAT
#undef QT_CAT_
