/* quant.c: path selection, activation quantization, the scalar integer dot products and row driver (the reference
 * every SIMD path must match), and the tile driver that runs the SIMD paths' register tiles (quant_impl.h). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant_impl.h"

/* ---- path selection ------------------------------------------------------------------------------------------ */

static atomic_int g_forced_path = -1;      /* -1: follow cb_get_isa() */

#if CB_HAVE_X86_QUANT
#include <cpuid.h>

/* AVX-VNNI is CPUID leaf 7, sub-leaf 1, EAX bit 4; its YMM state is the one AVX2's check already asked the OS for.
 * Asked once: every matmul picks its path, and CPUID serialises the core (in a VM it exits to the hypervisor). */
static int cpu_has_avx_vnni(void) {
    static atomic_int known = -1;
    int v = atomic_load(&known);
    if (v < 0) {
        unsigned a, b, c, d;
        v = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
        atomic_store(&known, v);
    }
    return v;
}
#endif

int cb_qpath_available(cb_qpath path) {
    if (path == CB_QPATH_SCALAR) return 1;
#if CB_HAVE_X86_QUANT
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    switch (path) {
    case CB_QPATH_AVX2: return avx2;
    case CB_QPATH_AVX2_VNNI: return CB_HAVE_AVX_VNNI && avx2 && cpu_has_avx_vnni();
    case CB_QPATH_AVX512: return bw;
    case CB_QPATH_AVX512_VNNI: return bw && __builtin_cpu_supports("avx512vnni");
    default: return 0;
    }
#else
    return 0;
#endif
}

/* Fastest first. AVX-512 BW before AVX-VNNI decides nothing on a known CPU (none has those two without AVX-512 VNNI);
 * on a Sapphire Rapids they came within 25 % of each other, either one ahead depending on the shape. */
static const cb_qpath by_speed[] = {CB_QPATH_AVX512_VNNI, CB_QPATH_AVX512, CB_QPATH_AVX2_VNNI, CB_QPATH_AVX2};

cb_qpath cb_qpath_detect(void) {
    for (size_t i = 0; i < sizeof by_speed / sizeof by_speed[0]; i++)
        if (cb_qpath_available(by_speed[i])) return by_speed[i];
    return CB_QPATH_SCALAR;
}

const char *cb_qpath_name(cb_qpath path) {
    switch (path) {
    case CB_QPATH_SCALAR: return "scalar";
    case CB_QPATH_AVX2: return "avx2";
    case CB_QPATH_AVX2_VNNI: return "avx2-vnni";
    case CB_QPATH_AVX512: return "avx512";
    case CB_QPATH_AVX512_VNNI: return "avx512-vnni";
    case CB_QPATH_COUNT: break;
    }
    return "unknown";
}

int cb_qpath_set(cb_qpath path) {
    if (path < CB_QPATH_SCALAR || path >= CB_QPATH_COUNT || !cb_qpath_available(path)) return -1;
    atomic_store(&g_forced_path, (int)path);
    return 0;
}

void cb_qpath_reset(void) { atomic_store(&g_forced_path, -1); }

/* COLIBRI_QPATH=scalar|avx2|avx2-vnni|avx512|avx512-vnni picks one integer path for a whole engine (tests of every
 * path end to end); a value this CPU lacks, or an unknown one, is ignored: every path gives the same bits. */
static int env_path(void) {
    static atomic_int cached = -2;          /* -2: not read yet; -1: unset or unusable */
    int v = atomic_load(&cached);
    if (v != -2) return v;
    const char *name = getenv("COLIBRI_QPATH");
    v = -1;
    for (int p = CB_QPATH_SCALAR; name && p < CB_QPATH_COUNT; p++)
        if (strcmp(name, cb_qpath_name((cb_qpath)p)) == 0 && cb_qpath_available((cb_qpath)p)) v = p;
    atomic_store(&cached, v);
    return v;
}

cb_qpath cb_qpath_get(void) {
    int forced = atomic_load(&g_forced_path);
    if (forced >= 0) return (cb_qpath)forced;
    int from_env = env_path();
    if (from_env >= 0) return (cb_qpath)from_env;
    /* Follow the float kernels' ISA level (so COLIBRI_ISA=scalar really means scalar everywhere). */
    switch (cb_get_isa()) {
    case CB_ISA_SCALAR: return CB_QPATH_SCALAR;
    case CB_ISA_AVX2:
        if (cb_qpath_available(CB_QPATH_AVX2_VNNI)) return CB_QPATH_AVX2_VNNI;
        return cb_qpath_available(CB_QPATH_AVX2) ? CB_QPATH_AVX2 : CB_QPATH_SCALAR;
    case CB_ISA_AVX512: return cb_qpath_detect();
    }
    return CB_QPATH_SCALAR;
}

/* The register tiles of a SIMD path and how many items (weight row x input pairs) one tile computes. */
typedef struct {
    int lanes;
    cb_qtile_fn q8, q4;
} qtiles;

static qtiles tiles_for(cb_qpath path) {
    switch (path) {
#if CB_HAVE_X86_QUANT
    case CB_QPATH_AVX512_VNNI: return (qtiles){16, cb_q8_tile_avx512vnni, cb_q4_tile_avx512vnni};
    case CB_QPATH_AVX512: return (qtiles){16, cb_q8_tile_avx512, cb_q4_tile_avx512};
#if CB_HAVE_AVX_VNNI
    case CB_QPATH_AVX2_VNNI: return (qtiles){8, cb_q8_tile_avx2vnni, cb_q4_tile_avx2vnni};
#endif
    case CB_QPATH_AVX2: return (qtiles){8, cb_q8_tile_avx2, cb_q4_tile_avx2};
#endif
    default: return (qtiles){0, NULL, NULL};
    }
}

/* ---- shapes ------------------------------------------------------------------------------------------------- */

int cb_qmatrix_check(const cb_qmatrix *W) {
    if (!W || !W->q || !W->scales || W->rows < 1 || W->cols < 1 || W->cols > CB_Q_MAX_COLS) return -1;
    if (W->scheme == CB_Q8_ROW) return 0;
    if (W->scheme == CB_Q4_G64) return W->cols % CB_Q4_GROUP == 0 ? 0 : -1;
    return -1;
}

size_t cb_qrow_bytes(cb_qscheme scheme, int cols) {
    return scheme == CB_Q4_G64 ? (size_t)cols / 2 : (size_t)cols;
}

size_t cb_qscale_count(cb_qscheme scheme, int rows, int cols) {
    return scheme == CB_Q4_G64 ? (size_t)rows * (size_t)(cols / CB_Q4_GROUP) : (size_t)rows;
}

static float scale_at(const void *scales, size_t i) {
    uint16_t h;
    memcpy(&h, (const char *)scales + 2 * i, sizeof h);
    return cb_f16_to_f32(h);
}

/* ---- activations -------------------------------------------------------------------------------------------- */

void cb_qact_free(cb_qact *a) {
    if (!a) return;
    free(a->q);
    free(a->q_split);
    free(a->group_sums);
    free(a->sums);
    free(a->scale);
    memset(a, 0, sizeof *a);
}

int cb_qact_init(cb_qact *a, int max_n, int cols) {
    memset(a, 0, sizeof *a);
    if (max_n < 1 || cols < 1 || cols > CB_Q_MAX_COLS) return -1;
    size_t n = (size_t)max_n, c = (size_t)cols;
    a->capacity_n = max_n;
    a->cols = cols;
    a->q = malloc(n * c);
    a->scale = malloc(n * sizeof *a->scale);
    a->sums = malloc(n * sizeof *a->sums);
    int ok = a->q && a->scale && a->sums;
    if (cols % CB_Q4_GROUP == 0) {
        a->q_split = malloc(n * c);
        a->group_sums = malloc(n * (c / CB_Q4_GROUP) * sizeof *a->group_sums);
        ok = ok && a->q_split && a->group_sums;
    }
    if (!ok) {
        cb_qact_free(a);
        return -1;
    }
    return 0;
}

static int8_t level_of(float v) {
    float r = nearbyintf(v);                 /* the default rounding mode: half to even */
    if (!(r >= -127.0f)) return r != r ? 0 : -127;
    if (r > 127.0f) return 127;
    return (int8_t)r;
}

/* Returns the sum of the row's levels. */
static int32_t quantize_row(int8_t *q, float *scale, const float *x, size_t cols) {
    float absmax = 0.0f;
    int nan = 0;
    for (size_t c = 0; c < cols; c++) {
        float m = fabsf(x[c]);
        if (m != m) nan = 1;
        else if (m > absmax) absmax = m;
    }
    if (nan) absmax = NAN;
    if (!isfinite(absmax) || absmax == 0.0f) {
        /* Zero levels; the scale (0, inf or NaN) makes the outputs 0 or NaN, as a float path's would be. */
        memset(q, 0, cols);
        *scale = absmax;
        return 0;
    }
    float inv = 127.0f / absmax;
    int32_t sum = 0;
    for (size_t c = 0; c < cols; c++) sum += q[c] = level_of(x[c] * inv);
    *scale = absmax / 127.0f;
    return sum;
}

int cb_qact_quantize(cb_qact *a, const float *x, int n) {
    if (!a || !a->q || !x || n < 1 || n > a->capacity_n) return -1;
    const int cols = a->cols;
    a->n = n;
    for (int i = 0; i < n; i++) {
        int8_t *q = a->q + (size_t)i * cols;
        a->sums[i] = quantize_row(q, &a->scale[i], x + (size_t)i * cols, (size_t)cols);
        if (!a->q_split) continue;
        const int groups = cols / CB_Q4_GROUP;
        for (int g = 0; g < groups; g++) {
            const int8_t *src = q + (size_t)g * CB_Q4_GROUP;
            int8_t *dst = a->q_split + (size_t)i * cols + (size_t)g * CB_Q4_GROUP;
            int32_t sum = 0;
            for (int j = 0; j < CB_Q4_GROUP / 2; j++) {
                dst[j] = src[2 * j];
                dst[CB_Q4_GROUP / 2 + j] = src[2 * j + 1];
                sum += src[2 * j] + src[2 * j + 1];
            }
            a->group_sums[(size_t)i * groups + g] = sum;
        }
    }
    return 0;
}

/* ---- scalar integer dot products (the reference) ------------------------------------------------------------ */

int32_t cb_q8_dot_scalar(const int8_t *w, const int8_t *x, int cols) {
    int32_t acc = 0;
    for (int c = 0; c < cols; c++) acc += (int32_t)w[c] * (int32_t)x[c];
    return acc;
}

void cb_q4_dot_scalar(int32_t *acc, const uint8_t *w, const int8_t *x, int groups) {
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = w + (size_t)g * (CB_Q4_GROUP / 2);
        const int8_t *xg = x + (size_t)g * CB_Q4_GROUP;
        int32_t sum = 0;
        for (int j = 0; j < CB_Q4_GROUP / 2; j++) {
            int lo = (wg[j] & 0x0f) - 8, hi = (wg[j] >> 4) - 8;
            sum += lo * xg[2 * j] + hi * xg[2 * j + 1];
        }
        acc[g] = sum;
    }
}

/* ---- row drivers ------------------------------------------------------------------------------------------- */

/* The one float combination of quant.h; every path funnels its exact integer sums through here. */
static float combine_q8(int32_t acc, float w_scale, float x_scale) { return ((float)acc * w_scale) * x_scale; }

static float combine_q4(const int32_t *acc, const void *scales, size_t first_scale, int groups, float x_scale) {
    float s = 0.0f;
    for (int g = 0; g < groups; g++) s = fmaf((float)acc[g], scale_at(scales, first_scale + (size_t)g), s);
    return s * x_scale;
}

/* The scalar reference: one (row, input) pair at a time. acc: `groups` int32 of scratch. */
static void rows_range(float *Y, size_t ldy, const cb_qmatrix *W, const cb_qact *a, int first_input, int n_inputs,
                       int r0, int r1, int32_t *acc) {
    const int cols = W->cols;
    const size_t row_bytes = cb_qrow_bytes(W->scheme, cols);
    const int groups = cols / CB_Q4_GROUP;
    for (int r = r0; r < r1; r++) {
        const void *wrow = (const char *)W->q + (size_t)r * row_bytes;
        for (int j = 0; j < n_inputs; j++) {
            const int i = first_input + j;
            const int8_t *x = a->q + (size_t)i * cols;
            float y;
            if (W->scheme == CB_Q8_ROW) {
                y = combine_q8(cb_q8_dot_scalar((const int8_t *)wrow, x, cols), scale_at(W->scales, (size_t)r),
                               a->scale[i]);
            } else {
                cb_q4_dot_scalar(acc, (const uint8_t *)wrow, x, groups);
                y = combine_q4(acc, W->scales, (size_t)r * groups, groups, a->scale[i]);
            }
            Y[(size_t)j * ldy + r] = y;
        }
    }
}

static int min_int(int a, int b) { return a < b ? a : b; }

/* Weight row `row`'s int4 scales as f32 into out[groups] (exact on every ISA; copied first, since the container's
 * scales may sit at an odd address). */
/* The f32 weight scales of rows [row, row + n) into out ([n][groups]): they are contiguous F16 in the matrix, so
 * one conversion call covers the whole row block (16 calls of 32 scales each cost a decode matvec a third of its
 * time in call overhead). */
static void rows_scales_f32(float *out, const cb_qmatrix *W, int row, int n, int groups) {
    const char *src = (const char *)W->scales + (size_t)row * (size_t)groups * 2;
    const size_t count = (size_t)n * (size_t)groups;
    if ((uintptr_t)src % _Alignof(uint16_t) == 0) {
        cb_convert_to_f32(out, src, CB_F16, count);
        return;
    }
    uint16_t h[512];   /* scales at an odd address (a container may pack them so): aligned copies first */
    for (size_t i = 0; i < count; i += 512) {
        size_t k = count - i < 512 ? count - i : 512;
        memcpy(h, src + 2 * i, 2 * k);
        cb_convert_to_f32(out + i, h, CB_F16, k);
    }
}

/* The SIMD paths: rows [r0, r1) x inputs in register tiles of R rows x N inputs (R * N = lanes), each row block's
 * weights reused from L1 by every group of inputs. A tile at the edge repeats the last real row / input (clamped
 * pointers, so it only reads real data) and its extra items are dropped. w_scales: 16 * groups floats. */
static void tiles_range(float *Y, size_t ldy, const cb_qmatrix *W, const cb_qact *a, int first_input, int n_inputs,
                        int r0, int r1, const qtiles *tiles, float *w_scales) {
    const int cols = W->cols, groups = cols / CB_Q4_GROUP, q8 = W->scheme == CB_Q8_ROW;
    const size_t row_bytes = cb_qrow_bytes(W->scheme, cols);
    const int N = n_inputs >= CB_QTILE_MAX_INPUTS && tiles->lanes >= 16 ? CB_QTILE_MAX_INPUTS : n_inputs >= 2 ? 2 : 1;
    const int R = tiles->lanes / N;
    const cb_qtile_fn fn = q8 ? tiles->q8 : tiles->q4;
    cb_qtile t = {.R = R, .N = N, .cols = cols, .groups = groups, .w_scales = w_scales};
    float out[CB_QTILE_MAX_LANES];
    for (int rb = r0; rb < r1; rb += R) {
        const int nr = min_int(R, r1 - rb);
        for (int r = 0; r < R; r++) t.w[r] = (const char *)W->q + (size_t)(rb + min_int(r, nr - 1)) * row_bytes;
        if (!q8) {
            rows_scales_f32(w_scales, W, rb, nr, groups);
            for (int r = nr; r < R; r++)   /* the edge tile's clamped rows repeat the last real row */
                memcpy(w_scales + (size_t)r * groups, w_scales + (size_t)(nr - 1) * groups, (size_t)groups * 4);
        }
        for (int k = 0; q8 && k < R * N; k++) t.w_scale[k] = scale_at(W->scales, (size_t)(rb + min_int(k % R, nr - 1)));
        for (int jb = 0; jb < n_inputs; jb += N) {
            const int nj = min_int(N, n_inputs - jb);
            for (int j = 0; j < N; j++) {
                const size_t i = (size_t)(first_input + jb + min_int(j, nj - 1));
                t.x[j] = a->q + i * cols;
                t.x_split[j] = q8 ? NULL : a->q_split + i * cols;
                t.group_sums[j] = q8 ? NULL : a->group_sums + i * groups;
            }
            for (int k = 0; k < R * N; k++) {
                const int i = first_input + jb + min_int(k / R, nj - 1);
                t.x_scale[k] = a->scale[i];
                t.x_sum[k] = a->sums[i];
            }
            /* int4: the next row block (of this task, else the next task's first) streams in while this one
             * computes, once per block (its later input tiles read it from cache). int8 rows are twice as long
             * and the hardware prefetchers keep up with them: measured, prefetching them only cost time. */
            const int next = !q8 && rb + R < W->rows ? rb + R : -1;
            t.prefetch = jb == 0 && next >= 0 ? (const char *)W->q + (size_t)next * row_bytes : NULL;
            t.prefetch_bytes = t.prefetch ? (size_t)min_int(R, W->rows - next) * row_bytes : 0;
            fn(out, &t);
            for (int j = 0; j < nj; j++)
                for (int r = 0; r < nr; r++) Y[(size_t)(jb + j) * ldy + (size_t)(rb + r)] = out[j * R + r];
        }
    }
}

/* Rows per task: enough work to amortise a task, small enough to balance 2..64 threads. A decode matvec (one or
 * two inputs) gets four times as many: its 16 rows were one tile, so every tile paid a task's hand-out and started
 * without its weights prefetched (measured at 2 threads on DRAM-resident int4 experts: 23 % faster). */
#define CB_Q_ROWS_PER_TASK 16
#define CB_Q_ROWS_PER_DECODE_TASK 64

typedef struct {
    float *Y[2];
    const cb_qmatrix *W[2];
    int n_mats;
    const cb_qact *a;
    int first_input, n_inputs;
    size_t ldy;
    int tasks_per_mat, rows_per_task;
    qtiles tiles;               /* lanes 0: the scalar reference */
    int failed;                 /* set when a task could not allocate its scratch */
} qjob;

static void qjob_task(void *ctx, int t) {
    qjob *job = ctx;
    const int m = t / job->tasks_per_mat, chunk = t % job->tasks_per_mat;
    const cb_qmatrix *W = job->W[m];
    const int r0 = chunk * job->rows_per_task;
    const int r1 = r0 + job->rows_per_task < W->rows ? r0 + job->rows_per_task : W->rows;
    /* Scratch: the scalar path's per-group sums, or a tile's weight scales (16 rows x groups). */
    enum { STACK_GROUPS = 64 };
    float stack_scratch[CB_QTILE_MAX_LANES * STACK_GROUPS];
    void *scratch = stack_scratch;
    const int groups = W->cols / CB_Q4_GROUP;
    if (groups > STACK_GROUPS) {
        scratch = malloc((size_t)CB_QTILE_MAX_LANES * (size_t)groups * sizeof(float));
        if (!scratch) {
            __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    if (job->tiles.lanes)
        tiles_range(job->Y[m], job->ldy, W, job->a, job->first_input, job->n_inputs, r0, r1, &job->tiles, scratch);
    else
        rows_range(job->Y[m], job->ldy, W, job->a, job->first_input, job->n_inputs, r0, r1, scratch);
    if (scratch != stack_scratch) free(scratch);
}

static int usable(const cb_qmatrix *W, const cb_qact *a) {
    if (cb_qmatrix_check(W) != 0 || !a || !a->q || a->n < 1 || a->cols != W->cols) return 0;
    return W->scheme != CB_Q4_G64 || a->q_split != NULL;
}

static int run(float *Y0, float *Y1, const cb_qmatrix *W0, const cb_qmatrix *W1, const cb_qact *a, int first_input,
               int n_inputs, size_t ldy) {
    cb_qpath path = cb_qpath_get();
    qjob job = {.Y = {Y0, Y1}, .W = {W0, W1}, .n_mats = W1 ? 2 : 1, .a = a, .first_input = first_input,
                .n_inputs = n_inputs, .ldy = ldy, .tiles = tiles_for(path)};
    job.rows_per_task = n_inputs <= 2 ? CB_Q_ROWS_PER_DECODE_TASK : CB_Q_ROWS_PER_TASK;
    job.tasks_per_mat = (W0->rows + job.rows_per_task - 1) / job.rows_per_task;
    cb_parallel_for(job.tasks_per_mat * job.n_mats, qjob_task, &job);
    return job.failed ? -1 : 0;
}

int cb_qmatmul(float *Y, const cb_qmatrix *W, const cb_qact *a) {
    if (!Y || !usable(W, a)) return -1;
    return run(Y, NULL, W, NULL, a, 0, a->n, (size_t)W->rows);
}

int cb_qmatvec(float *y, const cb_qmatrix *W, const cb_qact *a, int i) {
    if (!y || !usable(W, a) || i < 0 || i >= a->n) return -1;
    return run(y, NULL, W, NULL, a, i, 1, (size_t)W->rows);
}

int cb_qgate_up(float *G, float *U, const cb_qmatrix *Wg, const cb_qmatrix *Wu, const cb_qact *a) {
    if (!G || !U || !usable(Wg, a) || !usable(Wu, a)) return -1;
    if (Wg->scheme != Wu->scheme || Wg->rows != Wu->rows || Wg->cols != Wu->cols) return -1;
    return run(G, U, Wg, Wu, a, 0, a->n, (size_t)Wg->rows);
}

int cb_qmatvec_f32(float *y, const cb_qmatrix *W, const float *x) {
    if (!y || !x || cb_qmatrix_check(W) != 0) return -1;
    cb_qact a;
    if (cb_qact_init(&a, 1, W->cols) != 0) return -1;
    int rc = cb_qact_quantize(&a, x, 1);
    if (rc == 0) rc = cb_qmatvec(y, W, &a, 0);
    cb_qact_free(&a);
    return rc;
}

int cb_qdequant_row(float *out, const cb_qmatrix *W, int r) {
    if (!out || cb_qmatrix_check(W) != 0 || r < 0 || r >= W->rows) return -1;
    const int cols = W->cols;
    const char *row = (const char *)W->q + (size_t)r * cb_qrow_bytes(W->scheme, cols);
    if (W->scheme == CB_Q8_ROW) {
        float s = scale_at(W->scales, (size_t)r);
        for (int c = 0; c < cols; c++) out[c] = (float)((const int8_t *)row)[c] * s;
        return 0;
    }
    const int groups = cols / CB_Q4_GROUP;
    for (int c = 0; c < cols; c++) {
        uint8_t byte = ((const uint8_t *)row)[c / 2];
        int level = (c % 2 ? byte >> 4 : byte & 0x0f) - 8;
        out[c] = (float)level * scale_at(W->scales, (size_t)r * groups + (size_t)(c / CB_Q4_GROUP));
    }
    return 0;
}
