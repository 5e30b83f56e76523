/* test_quant.c: the contract of quant.h, bit for bit.
 *
 * The scalar path against an independent reference written here from the format's definition (nibble order,
 * offset, F16 scales, the fixed float combination); every SIMD path against the scalar path (memcmp) on random
 * bytes over odd row counts, odd column counts and tails (int8: any cols; int4: cols a multiple of 64);
 * matmul rows against matvec; the fused gate+up against two matmuls; 1/2/3 threads; scales at odd addresses;
 * activation quantization (rounding, zero and non-finite rows); refusals. A path the CPU lacks is skipped and
 * said so. Prints "N passed, N failed"; exits 1 on any failure.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant.h"

static int passed, failed;

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *fmt, ...) {
    if (ok) {
        passed++;
        return;
    }
    failed++;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

static uint64_t rng_state = 0x853c49e6748fea9bull;
static uint64_t next_u64(void) {
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545f4914f6cdd1dull;
}
static float random_f32(void) {
    static const float scales[7] = {0.01f, 0.1f, 0.5f, 1.0f, 3.0f, 30.0f, 1000.0f};
    uint64_t r = next_u64();
    return ((float)(r >> 40) * (1.0f / 8388608.0f) - 1.0f) * scales[r % 7];
}
/* A positive finite F16 pattern over the whole range, subnormals included. */
static uint16_t random_f16_scale(void) { return (uint16_t)(1 + next_u64() % 0x7bff); }

/* ---- a quantized matrix with its own storage ------------------------------------------------------------- */

typedef struct {
    cb_qmatrix m;
    uint8_t *q;
    uint8_t *scale_buf;        /* scales start at scale_buf + misalign */
} test_matrix;

static test_matrix make_matrix(cb_qscheme scheme, int rows, int cols, int misalign) {
    test_matrix t;
    size_t qbytes = (size_t)rows * cb_qrow_bytes(scheme, cols);
    size_t nscales = cb_qscale_count(scheme, rows, cols);
    t.q = malloc(qbytes);
    t.scale_buf = malloc(2 * nscales + 1);
    for (size_t i = 0; i < qbytes; i++) t.q[i] = (uint8_t)next_u64();   /* every byte, -128 and nibble 0 too */
    for (size_t i = 0; i < nscales; i++) {
        uint16_t h = random_f16_scale();
        memcpy(t.scale_buf + misalign + 2 * i, &h, 2);
    }
    t.m = (cb_qmatrix){scheme, rows, cols, t.q, t.scale_buf + misalign};
    return t;
}

static void free_matrix(test_matrix *t) {
    free(t->q);
    free(t->scale_buf);
}

static float *random_inputs(int n, int cols) {
    float *x = malloc((size_t)n * cols * sizeof *x);
    for (size_t i = 0; i < (size_t)n * cols; i++) x[i] = random_f32();
    if (n > 2) memset(x + (size_t)2 * cols, 0, (size_t)cols * sizeof *x);     /* an all-zero input */
    return x;
}

/* ---- the reference, from the definition in quant.h / docs/formats.md ------------------------------------ */

static float f16_at(const void *scales, size_t i) {
    uint16_t h;
    memcpy(&h, (const char *)scales + 2 * i, 2);
    return cb_f16_to_f32(h);
}

static int weight_level(const cb_qmatrix *W, int r, int c) {
    const uint8_t *row = (const uint8_t *)W->q + (size_t)r * cb_qrow_bytes(W->scheme, W->cols);
    if (W->scheme == CB_Q8_ROW) return (int8_t)row[c];
    return (c % 2 == 0 ? (row[c / 2] & 0x0f) : (row[c / 2] >> 4)) - 8;
}

static float reference_output(const cb_qmatrix *W, int r, const int8_t *xq, float xs) {
    if (W->scheme == CB_Q8_ROW) {
        long long acc = 0;
        for (int c = 0; c < W->cols; c++) acc += (long long)weight_level(W, r, c) * xq[c];
        return ((float)(int32_t)acc * f16_at(W->scales, (size_t)r)) * xs;
    }
    int groups = W->cols / 64;
    float s = 0.0f;
    for (int g = 0; g < groups; g++) {
        long long acc = 0;
        for (int c = g * 64; c < g * 64 + 64; c++) acc += (long long)weight_level(W, r, c) * xq[c];
        s = fmaf((float)(int32_t)acc, f16_at(W->scales, (size_t)r * groups + g), s);
    }
    return s * xs;
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof *a) == 0; }

/* ---- tests ------------------------------------------------------------------------------------------------ */

static void test_activation_quantization(void) {
    const int cols = 7;
    float x[3 * 7] = {1.0f, -2.0f, 0.5f, 127.0f, -127.0f, 0.25f, 3.0f,      /* absmax 127: level = x, rounded */
                      0, 0, 0, 0, 0, 0, 0,
                      1.0f, NAN, 2.0f, 0, 0, 0, 0};
    x[4] = -127.0f;
    x[5] = 2.5f;          /* 2.5 -> 2 (half to even) */
    x[6] = 3.5f;          /* 3.5 -> 4 */
    cb_qact a;
    check(cb_qact_init(&a, 3, cols) == 0, "cb_qact_init");
    check(cb_qact_quantize(&a, x, 3) == 0, "cb_qact_quantize");
    const int8_t want[7] = {1, -2, 0, 127, -127, 2, 4};
    check(memcmp(a.q, want, 7) == 0, "levels round half to even: got %d %d %d %d %d %d %d", a.q[0], a.q[1], a.q[2],
          a.q[3], a.q[4], a.q[5], a.q[6]);
    check(a.scale[0] == 1.0f, "scale = absmax / 127 (got %g)", a.scale[0]);
    check(a.scale[1] == 0.0f && !memcmp(a.q + 7, "\0\0\0\0\0\0\0", 7), "zero row: zero levels, zero scale");
    check(isnan(a.scale[2]), "NaN row: NaN scale");
    check(a.q_split == NULL, "no split activations when cols %% 64 != 0");
    check(cb_qact_quantize(&a, x, 4) == -1, "more rows than the capacity are refused");
    cb_qact_free(&a);

    /* Group sums and the even/odd split on a 128-column row. */
    float y[128];
    for (int c = 0; c < 128; c++) y[c] = (float)(c - 64);
    check(cb_qact_init(&a, 1, 128) == 0 && cb_qact_quantize(&a, y, 1) == 0, "quantize 128 columns");
    int32_t s0 = 0, s1 = 0;
    for (int c = 0; c < 64; c++) s0 += a.q[c];
    for (int c = 64; c < 128; c++) s1 += a.q[c];
    check(a.group_sums[0] == s0 && a.group_sums[1] == s1, "group sums");
    check(a.q_split[0] == a.q[0] && a.q_split[1] == a.q[2] && a.q_split[32] == a.q[1] &&
              a.q_split[64 + 33] == a.q[64 + 3],
          "split order: even columns then odd columns per group");
    cb_qact_free(&a);
}

static void test_nan_and_inf_inputs(void) {
    test_matrix t = make_matrix(CB_Q8_ROW, 3, 10, 0);
    float x[10] = {0}, y[3];
    x[3] = INFINITY;
    check(cb_qmatvec_f32(y, &t.m, x) == 0 && isnan(y[0]) && isnan(y[1]) && isnan(y[2]), "inf input -> NaN out");
    x[3] = 0;
    check(cb_qmatvec_f32(y, &t.m, x) == 0 && y[0] == 0 && y[1] == 0 && y[2] == 0, "zero input -> zero out");
    free_matrix(&t);
}

static void test_refusals(void) {
    test_matrix t = make_matrix(CB_Q4_G64, 2, 64, 0);
    cb_qmatrix bad = t.m;
    bad.cols = 96;
    check(cb_qmatrix_check(&bad) == -1, "int4 with cols %% 64 != 0 is refused");
    bad = t.m;
    bad.scheme = (cb_qscheme)7;
    check(cb_qmatrix_check(&bad) == -1, "unknown scheme is refused");
    bad = t.m;
    bad.cols = CB_Q_MAX_COLS + 64;
    check(cb_qmatrix_check(&bad) == -1, "cols past CB_Q_MAX_COLS are refused");
    cb_qact a;
    float x[128] = {1.0f}, y[2];
    check(cb_qact_init(&a, 1, 128) == 0 && cb_qact_quantize(&a, x, 1) == 0, "activations");
    check(cb_qmatvec(y, &t.m, &a, 0) == -1, "activation cols != matrix cols is refused");
    check(cb_qmatvec(y, &t.m, &a, 1) == -1, "input index past n is refused");
    cb_qact_free(&a);
    check(cb_qact_init(&a, 0, 64) == -1, "zero-capacity activations are refused");
    free_matrix(&t);
}

static void test_dequant_row(void) {
    for (int s = 0; s < 2; s++) {
        cb_qscheme scheme = s ? CB_Q4_G64 : CB_Q8_ROW;
        test_matrix t = make_matrix(scheme, 3, 128, 1);
        float out[128];
        int ok = 1;
        for (int r = 0; r < 3; r++) {
            check(cb_qdequant_row(out, &t.m, r) == 0, "cb_qdequant_row");
            for (int c = 0; c < 128; c++) {
                size_t si = scheme == CB_Q8_ROW ? (size_t)r : (size_t)r * 2 + (size_t)(c / 64);
                ok &= out[c] == (float)weight_level(&t.m, r, c) * f16_at(t.m.scales, si);
            }
        }
        check(ok, "dequantized %s rows equal level * scale", s ? "int4" : "int8");
        free_matrix(&t);
    }
}

/* Scalar against the reference, every other path against scalar, matmul rows against matvec, gate+up against
 * two matmuls, for one shape. */
static void check_shape(cb_qscheme scheme, int rows, int cols, int n, int misalign) {
    const char *name = scheme == CB_Q8_ROW ? "int8" : "int4";
    test_matrix W = make_matrix(scheme, rows, cols, misalign), U = make_matrix(scheme, rows, cols, 1 - misalign);
    float *x = random_inputs(n, cols);
    cb_qact a;
    if (cb_qact_init(&a, n, cols) != 0 || cb_qact_quantize(&a, x, n) != 0) {
        check(0, "activations for %dx%d", rows, cols);
        return;
    }
    size_t out_n = (size_t)n * rows;
    float *ref = malloc(out_n * sizeof *ref), *scalar = malloc(out_n * sizeof *scalar);
    float *got = malloc(out_n * sizeof *got), *got_u = malloc(out_n * sizeof *got_u);
    float *scalar_u = malloc(out_n * sizeof *scalar_u), *vec = malloc((size_t)rows * sizeof *vec);
    for (int i = 0; i < n; i++)
        for (int r = 0; r < rows; r++) ref[(size_t)i * rows + r] = reference_output(&W.m, r, a.q + (size_t)i * cols,
                                                                                     a.scale[i]);
    cb_qpath_set(CB_QPATH_SCALAR);
    check(cb_qmatmul(scalar, &W.m, &a) == 0, "scalar matmul %s %dx%d", name, rows, cols);
    check(same_bits(scalar, ref, out_n), "scalar %s %dx%d n=%d equals the reference", name, rows, cols, n);
    check(cb_qmatmul(scalar_u, &U.m, &a) == 0, "scalar matmul U");
    for (int p = CB_QPATH_SCALAR; p < CB_QPATH_COUNT; p++) {
        if (cb_qpath_set((cb_qpath)p) != 0) continue;
        const char *pname = cb_qpath_name((cb_qpath)p);
        check(cb_qmatmul(got, &W.m, &a) == 0 && same_bits(got, scalar, out_n),
              "%s matmul %s %dx%d n=%d misalign=%d is bit-identical to scalar", pname, name, rows, cols, n, misalign);
        int rows_ok = 1;
        for (int i = 0; i < n; i++) {
            rows_ok &= cb_qmatvec(vec, &W.m, &a, i) == 0;
            rows_ok &= same_bits(vec, scalar + (size_t)i * rows, (size_t)rows);
        }
        check(rows_ok, "%s matmul rows equal matvec %s %dx%d", pname, name, rows, cols);
        check(cb_qgate_up(got, got_u, &W.m, &U.m, &a) == 0 && same_bits(got, scalar, out_n) &&
                  same_bits(got_u, scalar_u, out_n),
              "%s gate+up equals two matmuls %s %dx%d", pname, name, rows, cols);
    }
    cb_qpath_reset();
    cb_qact_free(&a);
    free(ref), free(scalar), free(got), free(got_u), free(scalar_u), free(vec), free(x);
    free_matrix(&W), free_matrix(&U);
}

static void test_paths_bit_identical(void) {
    static const int q8_cols[] = {1, 5, 31, 32, 33, 63, 64, 65, 127, 129, 200, 1000, 2048};
    static const int q4_cols[] = {64, 128, 192, 320, 1024, 2048, 16448};     /* odd group counts included */
    static const int row_counts[] = {1, 3, 17, 33};
    for (size_t c = 0; c < sizeof q8_cols / sizeof *q8_cols; c++)
        for (size_t r = 0; r < sizeof row_counts / sizeof *row_counts; r++)
            check_shape(CB_Q8_ROW, row_counts[r], q8_cols[c], 1 + (int)(c % 4), (int)(r % 2));
    for (size_t c = 0; c < sizeof q4_cols / sizeof *q4_cols; c++)
        for (size_t r = 0; r < sizeof row_counts / sizeof *row_counts; r++)
            check_shape(CB_Q4_G64, row_counts[r], q4_cols[c], 1 + (int)(c % 4), (int)(r % 2));
}

/* The SIMD paths' register tiles (R rows x N inputs) against scalar at every batch size up to past two 4 x 4 tiles,
 * row counts that leave every remainder of 4, 8 and 16, column tails, int8 weight levels of -128, and scales that
 * are zero, negative zero or negative. */
static void test_tile_shapes(void) {
    static const int q8_cols[] = {7, 64, 100, 2055};
    static const int q4_cols[] = {64, 192, 1024};
    static const int row_counts[] = {1, 5, 16, 19, 36};
    static const uint16_t odd_scales[] = {0x0000, 0x8000, 0xbc00, 0x8001, 0x3c00};
    for (int s = 0; s < 2; s++) {
        const cb_qscheme scheme = s ? CB_Q4_G64 : CB_Q8_ROW;
        const int *cols_list = s ? q4_cols : q8_cols;
        const int n_cols = s ? 3 : 4;
        for (int ci = 0; ci < n_cols; ci++)
            for (size_t ri = 0; ri < sizeof row_counts / sizeof *row_counts; ri++) {
                const int rows = row_counts[ri], cols = cols_list[ci], n = 1 + (int)((ci * 5 + ri) % 9);
                test_matrix W = make_matrix(scheme, rows, cols, (int)(ri % 2));
                size_t nscales = cb_qscale_count(scheme, rows, cols), qbytes = (size_t)rows * cb_qrow_bytes(scheme, cols);
                for (size_t i = 0; i < nscales; i += 3)
                    memcpy((uint8_t *)W.m.scales + 2 * i, &odd_scales[i % 5], 2);
                if (scheme == CB_Q8_ROW)
                    for (size_t i = 0; i < qbytes; i += 5) W.q[i] = 0x80;      /* level -128 */
                float *x = random_inputs(n, cols);
                cb_qact a;
                size_t out_n = (size_t)n * rows;
                float *scalar = malloc(out_n * sizeof *scalar), *got = malloc(out_n * sizeof *got);
                int ok = cb_qact_init(&a, n, cols) == 0 && cb_qact_quantize(&a, x, n) == 0;
                cb_qpath_set(CB_QPATH_SCALAR);
                ok = ok && cb_qmatmul(scalar, &W.m, &a) == 0;
                for (int p = CB_QPATH_AVX2; ok && p < CB_QPATH_COUNT; p++) {
                    if (cb_qpath_set((cb_qpath)p) != 0) continue;
                    check(cb_qmatmul(got, &W.m, &a) == 0 && same_bits(got, scalar, out_n),
                          "%s tiles %s %dx%d n=%d (zero/negative scales, -128 levels) equal scalar",
                          cb_qpath_name((cb_qpath)p), s ? "int4" : "int8", rows, cols, n);
                }
                check(ok, "tile shape setup %dx%d n=%d", rows, cols, n);
                cb_qpath_reset();
                cb_qact_free(&a);
                free(scalar), free(got), free(x);
                free_matrix(&W);
            }
    }
}

/* Extreme levels: every weight and activation at +-127 (int4: +-7) makes the int32 sums as large as they get. */
static void test_extreme_sums(void) {
    const int cols = 8192, rows = 2;
    int8_t *w = malloc((size_t)rows * cols);
    uint8_t *w4 = malloc((size_t)rows * cols / 2);
    uint16_t scales[2 * 128];
    for (int i = 0; i < rows * cols; i++) w[i] = (i % 3) ? 127 : -127;
    for (int i = 0; i < rows * cols / 2; i++) w4[i] = (uint8_t)(15 | (1 << 4));   /* levels +7, -7 */
    for (int i = 0; i < 2 * 128; i++) scales[i] = 0x3c00;                        /* 1.0 */
    float *x = malloc((size_t)cols * sizeof *x), y_ref[2], y[2];
    for (int c = 0; c < cols; c++) x[c] = (c % 2) ? -1.0f : 1.0f;
    cb_qmatrix W8 = {CB_Q8_ROW, rows, cols, w, scales}, W4 = {CB_Q4_G64, rows, cols, w4, scales};
    const cb_qmatrix *mats[2] = {&W8, &W4};
    for (int m = 0; m < 2; m++) {
        cb_qpath_set(CB_QPATH_SCALAR);
        check(cb_qmatvec_f32(y_ref, mats[m], x) == 0, "scalar extreme");
        for (int p = CB_QPATH_AVX2; p < CB_QPATH_COUNT; p++) {
            if (cb_qpath_set((cb_qpath)p) != 0) continue;
            check(cb_qmatvec_f32(y, mats[m], x) == 0 && same_bits(y, y_ref, 2), "%s extreme sums %s",
                  cb_qpath_name((cb_qpath)p), m ? "int4" : "int8");
        }
    }
    /* int4: levels 7 at even columns times x = +127 and -7 at odd columns times -127: 64 * 7 * 127 per group. */
    check(y_ref[0] == (float)(128 * 64 * 7 * 127) * (1.0f / 127.0f), "int4 extreme value (got %.9g)", y_ref[0]);
    cb_qpath_reset();
    free(w), free(w4), free(x);
}

/* At CB_Q_MAX_COLS the int8 VNNI path's biased sums ((w + 128) * x) pass 2^31 and wrap; the exact total must
 * still come out: all +127 (the largest positive total) and all -128 (the largest negative). */
static void test_max_cols_wrap(void) {
    const int cols = CB_Q_MAX_COLS;
    int8_t *w = malloc((size_t)cols);
    float *x = malloc((size_t)cols * sizeof *x);
    uint16_t scale = 0x3c00;
    for (int c = 0; c < cols; c++) x[c] = 1.0f;
    for (int v = 0; v < 2; v++) {
        memset(w, v ? 0x80 : 0x7f, (size_t)cols);
        cb_qmatrix W = {CB_Q8_ROW, 1, cols, w, &scale};
        float want = (float)(int32_t)((v ? -128 : 127) * 127 * cols) * (1.0f / 127.0f), ref, y;
        cb_qpath_set(CB_QPATH_SCALAR);
        check(cb_qmatvec_f32(&ref, &W, x) == 0 && ref == want, "scalar max-cols sum %d (got %.9g)", v, ref);
        for (int p = CB_QPATH_AVX2; p < CB_QPATH_COUNT; p++) {
            if (cb_qpath_set((cb_qpath)p) != 0) continue;
            check(cb_qmatvec_f32(&y, &W, x) == 0 && same_bits(&y, &ref, 1), "%s max-cols sum %s",
                  cb_qpath_name((cb_qpath)p), v ? "-128" : "+127");
        }
    }
    cb_qpath_reset();
    free(w), free(x);
}

/* Every thread count gives the bits of one thread and of the scalar path: for a prefill (3 inputs: 16-row tasks) and
 * for decode (1 and 2 inputs: 64-row tasks, the last one partial, each prefetching the next row block). */
static void test_thread_counts(void) {
    for (int s = 0; s < 2; s++)
        for (int n = 1; n <= 3; n++) {
            const cb_qscheme scheme = s ? CB_Q4_G64 : CB_Q8_ROW;
            const int rows = 161, cols = 256;
            test_matrix t = make_matrix(scheme, rows, cols, 1);
            float *x = random_inputs(n, cols), y1[3 * 161], y[3 * 161];
            cb_qact a;
            cb_qact_init(&a, n, cols);
            cb_qact_quantize(&a, x, n);
            cb_qpath_set(CB_QPATH_SCALAR);
            check(cb_qmatmul(y1, &t.m, &a) == 0, "scalar matmul %dx%d n=%d", rows, cols, n);
            cb_qpath_reset();
            for (int threads = 1; threads <= 3; threads++) {
                if (cb_threads_init(threads) != 0) {
                    check(0, "cb_threads_init(%d)", threads);
                    continue;
                }
                check(cb_qmatmul(y, &t.m, &a) == 0 && same_bits(y, y1, (size_t)n * rows),
                      "%s n=%d with %d threads gives the scalar bits", s ? "int4" : "int8", n, threads);
                cb_threads_shutdown();
            }
            cb_qact_free(&a);
            free(x);
            free_matrix(&t);
        }
}

int main(void) {
    printf("test_quant: best path %s; paths run:", cb_qpath_name(cb_qpath_detect()));
    for (int p = CB_QPATH_SCALAR; p < CB_QPATH_COUNT; p++)
        printf(" %s%s", cb_qpath_name((cb_qpath)p), cb_qpath_available((cb_qpath)p) ? "" : " (skipped: CPU lacks it)");
    printf("\n");
    test_activation_quantization();
    test_nan_and_inf_inputs();
    test_refusals();
    test_dequant_row();
    test_paths_bit_identical();
    test_tile_shapes();
    test_extreme_sums();
    test_max_cols_wrap();
    test_thread_counts();
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
