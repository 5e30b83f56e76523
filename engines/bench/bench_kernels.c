/* bench_kernels.c: matvec/matmul throughput per ISA, as GB/s of weight bytes read, and the integer kernels (int8,
 * int4-g64) per path at the OLMoE-1B-7B expert shapes for 1, 4, 16 and 64 input rows, as GB/s of weight bytes and
 * GOP/s (2 * rows * cols * n); block-scaled fp8 (e4m3, 128x128 f32 scales) at DeepSeek-V3's dense shapes and fp4 at
 * a routed expert's, as GB/s. Not a test: it never asserts, and the numbers are only meaningful on an otherwise idle
 * machine.
 *
 *   bench_kernels [threads] [float|quant|fp8]      (default: every section; threads 0 = physical cores)
 *
 * The quant and fp8 sections use only the public APIs of quant.h, fp8.h and fp4.h, so they build against an older
 * runtime for before/after. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fp4.h"
#include "fp8.h"
#include "kernels.h"
#include "quant.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Best of 5 trials of >= 60 ms each, in seconds per call: other processes only ever make a trial slower. */
static double time_matmul(float *Y, const void *W, cb_dtype dt, const float *X, int n, int rows, int cols) {
    cb_matmul(Y, W, dt, X, n, rows, cols);
    double best = 1e30;
    for (int trial = 0; trial < 5; trial++) {
        int reps = 0;
        double start = now(), elapsed;
        do {
            cb_matmul(Y, W, dt, X, n, rows, cols);
            reps++;
            elapsed = now() - start;
        } while (elapsed < 0.06);
        if (elapsed / reps < best) best = elapsed / reps;
    }
    return best;
}

/* Best of 5 trials of >= 60 ms each, in seconds per cb_qmatmul. */
static double time_qmatmul(float *Y, const cb_qmatrix *W, const cb_qact *a) {
    cb_qmatmul(Y, W, a);
    double best = 1e30;
    for (int trial = 0; trial < 5; trial++) {
        int reps = 0;
        double start = now(), elapsed;
        do {
            cb_qmatmul(Y, W, a);
            reps++;
            elapsed = now() - start;
        } while (elapsed < 0.06);
        if (elapsed / reps < best) best = elapsed / reps;
    }
    return best;
}

static void bench_quant(int threads) {
    static const int shapes[][2] = {{1024, 2048}, {2048, 1024}};   /* OLMoE expert gate/up and down */
    static const int counts[] = {1, 4, 16, 64};
    const int max_cols = 2048, max_n = 64;
    size_t max_elems = (size_t)2048 * 1024;
    unsigned char *q = malloc(max_elems);
    uint16_t *scales = malloc(max_elems / 64 * sizeof *scales + 2 * 2048);
    float *X = malloc((size_t)max_n * max_cols * sizeof *X), *Y = malloc((size_t)max_n * 2048 * sizeof *Y);
    for (size_t i = 0; i < max_elems; i++) q[i] = (unsigned char)((i * 2654435761u) >> 13);
    for (size_t i = 0; i < max_elems / 64 + 2048; i++) scales[i] = (uint16_t)(0x2000 + (i * 40503u) % 0x0800);
    for (int i = 0; i < max_n * max_cols; i++) X[i] = (float)((i * 7919) % 211) * 0.01f - 1.0f;
    for (size_t i = 0; i < max_elems; i++)   /* int8 levels in [-127, 127] as the format stores them */
        if (q[i] == 0x80) q[i] = 0x81;
    cb_threads_init(threads);
    printf("%-12s %-5s %-10s %4s %7s %9s %9s %10s\n", "path", "quant", "shape", "n", "threads", "GB/s", "GOP/s",
           "us/call");
    for (int p = CB_QPATH_SCALAR; p < CB_QPATH_COUNT; p++) {
        if (cb_qpath_set((cb_qpath)p) != 0) continue;
        for (int scheme = CB_Q8_ROW; scheme <= CB_Q4_G64; scheme++)
            for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
                int rows = shapes[s][0], cols = shapes[s][1];
                cb_qmatrix W = {(cb_qscheme)scheme, rows, cols, q, scales};
                double bytes = (double)rows * cb_qrow_bytes(W.scheme, cols);
                for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
                    int n = counts[c];
                    if (p == CB_QPATH_SCALAR && n > 4) continue;
                    cb_qact a;
                    if (cb_qact_init(&a, n, cols) || cb_qact_quantize(&a, X, n)) return;
                    double sec = time_qmatmul(Y, &W, &a);
                    char shape[32];
                    snprintf(shape, sizeof shape, "%dx%d", rows, cols);
                    printf("%-12s %-5s %-10s %4d %7d %9.2f %9.2f %10.1f\n", cb_qpath_name((cb_qpath)p),
                           scheme == CB_Q8_ROW ? "int8" : "int4", shape, n, cb_threads_count(), bytes / sec / 1e9,
                           2.0 * rows * cols * n / sec / 1e9, sec * 1e6);
                    cb_qact_free(&a);
                }
            }
    }
    cb_qpath_reset();
    free(q), free(scales), free(X), free(Y);
}

/* One block-scaled matmul, fp8 or fp4, as a callback for best_seconds. */
typedef struct {
    const cb_fp8matrix *f8;
    const cb_fp4matrix *f4;
    float *Y;
    const float *X;
    int n;
} scaled_call;

static void run_scaled(const scaled_call *c) {
    if (c->f8) cb_fp8_matmul(c->Y, c->f8, c->X, c->n);
    else cb_fp4_matmul(c->Y, c->f4, c->X, c->n);
}

/* Best of 5 trials of >= 60 ms each, in seconds per call (after one untimed call). */
static double best_seconds(const scaled_call *c) {
    run_scaled(c);
    double best = 1e30;
    for (int trial = 0; trial < 5; trial++) {
        int reps = 0;
        double start = now(), elapsed;
        do {
            run_scaled(c);
            reps++;
            elapsed = now() - start;
        } while (elapsed < 0.06);
        if (elapsed / reps < best) best = elapsed / reps;
    }
    return best;
}

static void print_scaled(cb_isa isa, const char *dtype, int rows, int cols, int n, int threads, double bytes,
                         double sec) {
    char shape[32];
    snprintf(shape, sizeof shape, "%dx%d", rows, cols);
    printf("%-7s %-5s %-12s %4d %7d %9.2f %9.1f\n", cb_isa_name(isa), dtype, shape, n, threads, bytes / sec / 1e9,
           sec * 1e6);
}

/* fp8 at DeepSeek-V3's widths (hidden 7168): the MLA down-projections (q_a 1536, kv_a 576 rows), the shared
 * expert's down [7168, 2048], the dense MLP's gate/up [18432, 7168] and the o_proj [7168, 16384]; then fp4 (e2m1, a
 * ue8m0 scale per 32 columns) at a routed expert's shapes. Scalar and the CPU's best body, 1 and 4 inputs, as GB/s
 * of weight bytes read. */
static void bench_fp8(int threads) {
    static const int shapes[][2] = {{1536, 7168}, {576, 7168}, {7168, 2048}, {18432, 7168}, {7168, 16384}};
    static const int fp4_shapes[][2] = {{2048, 7168}, {7168, 2048}};
    static const int counts[] = {1, 4};
    size_t max_bytes = (size_t)18432 * 7168, n_scales = ((size_t)18432 / 128) * (16384 / 128);
    uint8_t *w = malloc(max_bytes), *e8m0 = malloc(max_bytes / CB_FP4_GROUP);
    for (size_t i = 0; i < max_bytes; i++) {
        uint8_t b = (uint8_t)((i * 2654435761u) >> 13);
        w[i] = (b & 0x7f) == 0x7f ? 0x38 : b;   /* no NaN bytes, as in a real checkpoint */
    }
    for (size_t i = 0; i < max_bytes / CB_FP4_GROUP; i++) e8m0[i] = (uint8_t)(120 + i % 8);
    float *scales = malloc(n_scales * sizeof(float));
    for (size_t i = 0; i < n_scales; i++) scales[i] = 1e-3f * (float)(1 + i % 7);
    float *X = malloc(4 * 16384 * sizeof(float)), *Y = malloc(4 * 18432 * sizeof(float));
    for (int i = 0; i < 4 * 16384; i++) X[i] = (float)(i % 97) * 0.01f - 0.5f;
    cb_threads_init(threads);
    int nt = cb_threads_count();
    cb_isa isas[2] = {CB_ISA_SCALAR, cb_isa_detect()};
    printf("%-7s %-5s %-12s %4s %7s %9s %9s\n", "isa", "dtype", "shape", "n", "threads", "GB/s", "us/call");
    for (int k = 0; k < 2; k++) {
        cb_set_isa(isas[k]);
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
                cb_fp8matrix W = {shapes[s][0], shapes[s][1], w, scales, CB_FP8_SCALE_F32};
                scaled_call call = {&W, NULL, Y, X, counts[c]};
                print_scaled(isas[k], "fp8", W.rows, W.cols, counts[c], nt, (double)W.rows * W.cols,
                             best_seconds(&call));
            }
        for (size_t s = 0; s < sizeof fp4_shapes / sizeof fp4_shapes[0]; s++)
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
                cb_fp4matrix W = {fp4_shapes[s][0], fp4_shapes[s][1], w, e8m0, CB_FP8_SCALE_E8M0};
                scaled_call call = {NULL, &W, Y, X, counts[c]};
                print_scaled(isas[k], "fp4", W.rows, W.cols, counts[c], nt, (double)W.rows * W.cols / 2,
                             best_seconds(&call));
            }
    }
    cb_set_isa(cb_isa_detect());
    free(w);
    free(e8m0);
    free(scales);
    free(X);
    free(Y);
}

int main(int argc, char **argv) {
    int max_threads = argc > 1 ? atoi(argv[1]) : 0;
    const char *section = argc > 2 ? argv[2] : "";
    if (strcmp(section, "fp8") == 0 || !*section) bench_fp8(max_threads);
    if (strcmp(section, "fp8") == 0) return 0;
    if (strcmp(section, "float") != 0) bench_quant(max_threads);
    if (strcmp(section, "quant") == 0) return 0;
    static const int shapes[][2] = {{2048, 1024}, {1024, 2048}, {4096, 4096}, {50304, 2048}};
    static const cb_dtype dtypes[] = {CB_F32, CB_BF16, CB_F16};
    static const char *dtype_names[] = {"f32", "bf16", "f16"};
    size_t max_elems = (size_t)50304 * 2048;
    float *Wf = malloc(max_elems * sizeof(float));
    for (size_t i = 0; i < max_elems; i++) Wf[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    uint16_t *Wh = malloc(max_elems * sizeof(uint16_t));
    for (size_t i = 0; i < max_elems; i++) Wh[i] = (uint16_t)(0x3000 + (i * 40503u) % 0x0c00);  /* finite in both */
    float *X = malloc(64 * 4096 * sizeof(float)), *Y = malloc((size_t)64 * 50304 * sizeof(float));
    for (int i = 0; i < 64 * 4096; i++) X[i] = (float)(i % 97) * 0.01f;

    cb_threads_init(max_threads);
    int threads = cb_threads_count();
    printf("%-7s %-5s %-12s %7s %9s %9s\n", "isa", "dtype", "shape", "threads", "GB/s", "us/call");
    for (int isa = CB_ISA_SCALAR; isa <= CB_ISA_AVX512; isa++) {
        if (cb_set_isa((cb_isa)isa) != 0) {
            printf("%-7s (not supported by this CPU)\n", cb_isa_name((cb_isa)isa));
            continue;
        }
        for (int d = 0; d < 3; d++) {
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                int rows = shapes[s][0], cols = shapes[s][1];
                if (isa == CB_ISA_SCALAR && (size_t)rows * cols > 4u << 20) continue;
                const void *W = dtypes[d] == CB_F32 ? (const void *)Wf : (const void *)Wh;
                double bytes = (double)rows * cols * cb_dtype_size(dtypes[d]);
                int counts[2] = {1, threads};
                for (int t = 0; t < (threads > 1 ? 2 : 1); t++) {
                    cb_threads_init(counts[t]);
                    double sec = time_matmul(Y, W, dtypes[d], X, 1, rows, cols);
                    char shape[32];
                    snprintf(shape, sizeof shape, "%dx%d", rows, cols);
                    printf("%-7s %-5s %-12s %7d %9.2f %9.1f\n", cb_isa_name((cb_isa)isa), dtype_names[d], shape,
                           counts[t], bytes / sec / 1e9, sec * 1e6);
                }
            }
        }
        /* matmul: n inputs against one matrix, as n matvecs vs one cb_matmul (weights reused from cache) */
        for (int d = 1; d < 2; d++) {
            int rows = 2048, cols = 2048, n = 16;
            if (isa == CB_ISA_SCALAR) continue;
            cb_threads_init(threads);
            double t_mm = time_matmul(Y, Wh, dtypes[d], X, n, rows, cols);
            double t_mv = 1e30;
            for (int trial = 0; trial < 5; trial++) {
                double start = now();
                for (int i = 0; i < n; i++) cb_matvec(Y + (size_t)i * rows, Wh, dtypes[d], X + (size_t)i * cols, rows, cols);
                if (now() - start < t_mv) t_mv = now() - start;
            }
            printf("%-7s %-5s matmul 2048x2048 n=16, %d threads: %.0f us vs %.0f us as 16 matvecs (%.2fx)\n",
                   cb_isa_name((cb_isa)isa), dtype_names[d], threads, t_mm * 1e6, t_mv * 1e6, t_mv / t_mm);
        }
    }
    cb_threads_shutdown();
    free(Wf);
    free(Wh);
    free(X);
    free(Y);
    return 0;
}
