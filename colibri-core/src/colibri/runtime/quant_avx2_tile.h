/* quant_avx2_tile.h: the AVX2 register tiles of quant_impl.h, written once and instantiated by quant_avx2.c for
 * AVX2 (vpmaddubsw + vpmaddwd) and AVX-VNNI (VEX vpdpbusd on the same 32-byte registers).
 *
 * 8 items per tile (8 x 1 or 4 x 2): each weight vector loaded once for N inputs, each activation vector once for
 * R rows, one int32 accumulator per item. The 8 accumulators are reduced together (reduce8: item k's sum in lane
 * k), so the float combination of quant.h runs on 8 items at once, lane by lane the scalar order. All sums are
 * exact integers (wrapping int32 adds of values whose true total fits), so the grouping differs from the scalar
 * loop without changing a bit.
 *
 * The includer defines QT_TARGET, QT_SUFFIX and the always-inline primitives:
 *   q8_weights(w)            the int8 weight vector as the step's weight operand
 *   q8_step(acc, wop, w, x)  acc + the 32 products w * x, four per int32 lane
 *   q8_fix(sum, x_sum)       the exact sum(w * x) from the step's sums (x_sum: the input's level sum per lane)
 *   QT_Q8_BIAS               what the step adds to each weight level (0, or 128 for vpdpbusd's unsigned operand)
 *   q4_pair(lo, hi, even, odd)  lo * even + hi * odd per int32 lane (unsigned nibbles times signed levels)
 */
#ifndef QT_SUFFIX
#error "quant_avx2_tile.h is a template: define QT_TARGET, QT_SUFFIX and the q8_/q4_ primitives first"
#endif

#define QT_CAT_(a, b) a##b
#define QT_CAT(a, b) QT_CAT_(a, b)
#define QT_NAME(base) QT_CAT(base, QT_SUFFIX)
#define QT_INLINE static inline __attribute__((always_inline)) QT_TARGET

QT_INLINE __m256i QT_NAME(reduce8_)(const __m256i v[8]) {
    __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

QT_INLINE void QT_NAME(q8_tile_)(float *out, const cb_qtile *t, const int R, const int N) {
    __m256i acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_si256();
    const int cols = t->cols, main_cols = cols - cols % 32;
    cb_qprefetch pf = cb_qprefetch_begin(t, cols / 32);
    for (int c = 0; c < main_cols; c += 32) {
        cb_qprefetch_step(&pf);
        __m256i xv[2];
#pragma GCC unroll 2
        for (int j = 0; j < N; j++) xv[j] = _mm256_loadu_si256((const __m256i *)(t->x[j] + c));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)((const int8_t *)t->w[r] + c)), wop = q8_weights(w);
#pragma GCC unroll 2
            for (int j = 0; j < N; j++) acc[j * R + r] = q8_step(acc[j * R + r], wop, w, xv[j]);
        }
    }
    /* The last cols % 32 columns one by one, with the step's weight bias, so q8_fix's correction covers them too. */
    int32_t sum[8];
    _mm256_storeu_si256((__m256i *)sum, QT_NAME(reduce8_)(acc));
    for (int k = 0; k < 8; k++) {
        const int8_t *w = t->w[k % R], *x = t->x[k / R];
        for (int c = main_cols; c < cols; c++) sum[k] += ((int32_t)w[c] + QT_Q8_BIAS) * (int32_t)x[c];
    }
    __m256i exact = q8_fix(_mm256_loadu_si256((const __m256i *)sum), _mm256_loadu_si256((const __m256i *)t->x_sum));
    __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_loadu_ps(t->w_scale));
    _mm256_storeu_ps(out, _mm256_mul_ps(y, _mm256_loadu_ps(t->x_scale)));
}

/* int4 x int8: the stored nibble u = level + 8 (unsigned, 0..15) times x; sum(u * x) - 8 * sum(x) is the exact
 * sum(level * x). Low nibbles are the group's even columns, high nibbles its odd columns, which is why the
 * activations come pre-split (cb_qact.q_split). */
QT_INLINE void QT_NAME(q4_tile_)(float *out, const cb_qtile *t, const int R, const int N) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int groups = t->groups;
    int row_of_lane[8];
    for (int k = 0; k < 8; k++) row_of_lane[k] = (k % R) * groups;
    const __m256i scale_index = _mm256_loadu_si256((const __m256i *)row_of_lane);
    __m256 s = _mm256_setzero_ps();
    cb_qprefetch pf = cb_qprefetch_begin(t, groups);
    for (int g = 0; g < groups; g++) {
        cb_qprefetch_step(&pf);
        __m256i even[2], odd[2], acc[8];
#pragma GCC unroll 2
        for (int j = 0; j < N; j++) {
            even[j] = _mm256_loadu_si256((const __m256i *)(t->x_split[j] + (size_t)g * 64));
            odd[j] = _mm256_loadu_si256((const __m256i *)(t->x_split[j] + (size_t)g * 64 + 32));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)((const uint8_t *)t->w[r] + (size_t)g * 32));
            __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
#pragma GCC unroll 2
            for (int j = 0; j < N; j++) acc[j * R + r] = q4_pair(lo, hi, even[j], odd[j]);
        }
        __m256i offset = N == 1 ? _mm256_set1_epi32(t->group_sums[0][g])
                                : _mm256_set_m128i(_mm_set1_epi32(t->group_sums[1][g]), _mm_set1_epi32(t->group_sums[0][g]));
        __m256i sum = _mm256_sub_epi32(QT_NAME(reduce8_)(acc), _mm256_slli_epi32(offset, 3));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_i32gather_ps(t->w_scales + g, scale_index, 4), s);
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(s, _mm256_loadu_ps(t->x_scale)));
}

/* One out-of-line body per tile shape, so R and N are constants in the unrolled loops. */
#define QT_SHAPES(KIND)                                                                                            \
    static QT_TARGET void QT_NAME(KIND##_8x1_)(float *out, const cb_qtile *t) { QT_NAME(KIND##_tile_)(out, t, 8, 1); } \
    static QT_TARGET void QT_NAME(KIND##_4x2_)(float *out, const cb_qtile *t) { QT_NAME(KIND##_tile_)(out, t, 4, 2); } \
    QT_TARGET void QT_NAME(cb_##KIND##_tile)(float *out, const cb_qtile *t) {                                    \
        (t->N == 1 ? QT_NAME(KIND##_8x1_) : QT_NAME(KIND##_4x2_))(out, t);                                        \
    }

QT_SHAPES(q8)
QT_SHAPES(q4)

#undef QT_SHAPES
#undef QT_INLINE
#undef QT_NAME
#undef QT_CAT
#undef QT_CAT_
