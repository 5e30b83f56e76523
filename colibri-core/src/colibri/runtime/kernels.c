/* kernels.c: ISA selection, the parallel matvec/matmul drivers, and the small elementwise kernels.
 *
 * The drivers only decide who computes which (row, input) pairs; every pair is computed by the selected ISA's
 * cb_rows_* with the one summation order of kernels.h, so thread count, chunking and batching never change a bit. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_impl.h"

/* ---- ISA selection ------------------------------------------------------------------------------------------ */

static atomic_int g_isa = -1;       /* -1 until the first use reads COLIBRI_ISA or detects */
static char g_isa_env_error[160];

cb_isa cb_isa_detect(void) {
#if CB_HAVE_X86_KERNELS
    __builtin_cpu_init();
    /* libgcc also checks that the OS saves the YMM/ZMM state before reporting these. */
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    int f16c = __builtin_cpu_supports("f16c");
    if (avx2 && f16c && __builtin_cpu_supports("avx512f")) return CB_ISA_AVX512;
    if (avx2 && f16c) return CB_ISA_AVX2;
#endif
    return CB_ISA_SCALAR;
}

const char *cb_isa_name(cb_isa isa) {
    switch (isa) {
    case CB_ISA_SCALAR: return "scalar";
    case CB_ISA_AVX2: return "avx2";
    case CB_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

int cb_isa_from_name(const char *name, cb_isa *out) {
    for (int i = CB_ISA_SCALAR; i <= CB_ISA_AVX512; i++) {
        if (strcmp(name, cb_isa_name((cb_isa)i)) == 0) {
            *out = (cb_isa)i;
            return 0;
        }
    }
    return -1;
}

int cb_set_isa(cb_isa isa) {
    if (isa < CB_ISA_SCALAR || isa > CB_ISA_AVX512 || isa > cb_isa_detect()) return -1;
    atomic_store(&g_isa, (int)isa);
    return 0;
}

/* Every ISA gives the same bits, so an unusable COLIBRI_ISA only costs speed: fall back to the detected ISA and
 * keep the reason for the engine to report (library code never exits). */
static cb_isa isa_from_environment(void) {
    cb_isa best = cb_isa_detect();
    const char *env = getenv("COLIBRI_ISA");
    if (!env || !*env) return best;
    cb_isa wanted;
    if (cb_isa_from_name(env, &wanted) != 0) {
        strcpy(g_isa_env_error, "COLIBRI_ISA: unknown value (use scalar, avx2 or avx512); using the detected ISA");
        return best;
    }
    if (wanted > best) {
        strcpy(g_isa_env_error, "COLIBRI_ISA: this CPU lacks the requested ISA; using the best one it has");
        return best;
    }
    return wanted;
}

cb_isa cb_get_isa(void) {
    int isa = atomic_load(&g_isa);
    if (isa < 0) {
        int expected = -1;
        atomic_compare_exchange_strong(&g_isa, &expected, (int)isa_from_environment());
        isa = atomic_load(&g_isa);
    }
    return (cb_isa)isa;
}

const char *cb_isa_env_error(void) {
    cb_get_isa();
    return g_isa_env_error[0] ? g_isa_env_error : NULL;
}

cb_rows_fn cb_current_rows(void) {
    switch (cb_get_isa()) {
#if CB_HAVE_X86_KERNELS
    case CB_ISA_AVX512: return cb_rows_avx512;
    case CB_ISA_AVX2: return cb_rows_avx2;
#endif
    default: return cb_rows_scalar;
    }
}

cb_convert_fn cb_current_convert(void) {
    switch (cb_get_isa()) {
#if CB_HAVE_X86_KERNELS
    case CB_ISA_AVX512: return cb_convert_avx512;
    case CB_ISA_AVX2: return cb_convert_avx2;
#endif
    default: return cb_convert_scalar;
    }
}

cb_axpy_fn cb_current_axpy(void) {
    switch (cb_get_isa()) {
#if CB_HAVE_X86_KERNELS
    case CB_ISA_AVX512: return cb_axpy_avx512;
    case CB_ISA_AVX2: return cb_axpy_avx2;
#endif
    default: return cb_axpy_scalar;
    }
}

void cb_axpy(float *y, float a, const float *x, size_t n) { cb_current_axpy()(y, a, x, n); }

cb_axpy_rows_fn cb_current_axpy_rows(void) {
    switch (cb_get_isa()) {
#if CB_HAVE_X86_KERNELS
    case CB_ISA_AVX512: return cb_axpy_rows_avx512;
    case CB_ISA_AVX2: return cb_axpy_rows_avx2;
#endif
    default: return cb_axpy_rows_scalar;
    }
}

void cb_axpy_rows(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m, size_t n) {
    if (m > 0) cb_current_axpy_rows()(y, a, lda, X, ldx, m, n);
}

/* ---- matvec / matmul ------------------------------------------------------------------------------------------ */

/* Below this many multiply-adds, waking the pool costs more than it saves. */
#define CB_PARALLEL_MIN_WORK 32768
/* Chunks per thread: enough for the dynamic scheduler to even out uneven cores, few enough to stay cheap. */
#define CB_CHUNKS_PER_THREAD 4
/* Row chunks are multiples of this so the 4-row tiles stay whole. */
#define CB_ROW_GRAIN 4

typedef struct {
    cb_rows_fn rows_fn;
    float *Y;
    const void *W;
    cb_dtype dt;
    const float *X;
    int n, rows, cols;
    int row_chunk, row_chunks, input_chunk;
} matmul_job;

static void matmul_task(void *ctx, int i) {
    const matmul_job *job = ctx;
    int r0 = (i % job->row_chunks) * job->row_chunk;
    int r1 = r0 + job->row_chunk < job->rows ? r0 + job->row_chunk : job->rows;
    int j0 = (i / job->row_chunks) * job->input_chunk;
    int nj = j0 + job->input_chunk < job->n ? job->input_chunk : job->n - j0;
    job->rows_fn(job->Y + (size_t)j0 * job->rows, (size_t)job->rows, job->W, job->dt,
                 job->X + (size_t)j0 * job->cols, (size_t)job->cols, nj, r0, r1, job->cols);
}

static int round_up(int v, int grain) { return (v + grain - 1) / grain * grain; }
static int ceil_div(int a, int b) { return (a + b - 1) / b; }

void cb_matmul(float *Y, const void *W, cb_dtype dt, const float *X, int n, int rows, int cols) {
    if (n <= 0 || rows <= 0 || cols < 0) return;
    cb_rows_fn rows_fn = cb_current_rows();
    int threads = cb_threads_count();
    double work = (double)rows * (double)cols * (double)n;
    if (threads <= 1 || work < CB_PARALLEL_MIN_WORK) {
        rows_fn(Y, (size_t)rows, W, dt, X, (size_t)cols, n, 0, rows, cols);
        return;
    }
    int wanted_chunks = threads * CB_CHUNKS_PER_THREAD;
    matmul_job job = {rows_fn, Y, W, dt, X, n, rows, cols, 0, 0, n};
    job.row_chunk = round_up(ceil_div(rows, wanted_chunks), CB_ROW_GRAIN);
    job.row_chunks = ceil_div(rows, job.row_chunk);
    if (job.row_chunks < wanted_chunks && n > 1) {
        /* Few rows, many inputs (a router over a prefill): split the inputs too. */
        int input_splits = ceil_div(wanted_chunks, job.row_chunks);
        job.input_chunk = round_up(ceil_div(n, input_splits), CB_ROW_GRAIN);
    }
    int input_chunks = ceil_div(n, job.input_chunk);
    cb_parallel_for(job.row_chunks * input_chunks, matmul_task, &job);
}

void cb_matvec(float *y, const void *W, cb_dtype dt, const float *x, int rows, int cols) {
    cb_matmul(y, W, dt, x, 1, rows, cols);
}

float cb_dot(const void *w_row, cb_dtype dt, const float *x, int cols) {
    float y = 0.0f;
    cb_current_rows()(&y, 1, w_row, dt, x, 0, 1, 0, 1, cols < 0 ? 0 : cols);
    return y;
}

void cb_dots(float *Y, size_t ldy, const float *w, const float *X, size_t ldx, int n, int cols) {
    if (n > 0) cb_current_rows()(Y, ldy, w, CB_F32, X, ldx, n, 0, 1, cols < 0 ? 0 : cols);
}

void cb_convert_to_f32(float *out, const void *in, cb_dtype dt, size_t n) { cb_current_convert()(out, in, dt, n); }

/* ---- elementwise kernels (scalar on every ISA, so trivially identical) ---------------------------------------- */

/* As torch's float32 RMSNorm: variance = mean(x^2) in f32, x * rsqrt(variance + eps), then * w. The squares are
 * rounded to f32 like torch's pow(2) tensor, and summed in double so the mean is accurate whatever the length
 * (torch's own f32 reduction order is not reproducible anyway). */
void cb_rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    if (n <= 0) return;
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        float square = x[i] * x[i];
        sum += (double)square;
    }
    float variance = (float)(sum / (double)n);
    float inv_rms = 1.0f / sqrtf(variance + eps);
    for (int i = 0; i < n; i++) {
        float normed = x[i] * inv_rms;
        out[i] = w ? normed * w[i] : normed;
    }
}

void cb_softmax(float *x, int n) {
    if (n <= 0) return;
    float max = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > max) max = x[i];
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += (double)x[i];
    }
    float total = (float)sum;
    for (int i = 0; i < n; i++) x[i] /= total;
}

void cb_silu_mul(float *gate, const float *up, int n) {
    for (int i = 0; i < n; i++) {
        float g = gate[i];
        float silu = g / (1.0f + expf(-g));
        gate[i] = silu * up[i];
    }
}

/* HF computes the angle as the f32 product position * inv_freq, then cos/sin in f32; each rotated value is
 * round(round(a*cos) -/+ round(b*sin)), which -ffp-contract=off reproduces here. The two layouts differ only in
 * which two values of a head form pair i: (i, i + half) for NeoX, (2i, 2i + 1) interleaved. */
static void rope_pairs(float *x, int n_heads, int head_dim, int rot_dim, int pos, const float *inv_freq, int stride,
                       int partner) {
    int half = rot_dim / 2;
    for (int i = 0; i < half; i++) {
        float angle = (float)pos * inv_freq[i];
        float c = cosf(angle), s = sinf(angle);
        for (int h = 0; h < n_heads; h++) {
            float *a_at = x + (size_t)h * head_dim + (size_t)i * stride, *b_at = a_at + partner;
            float a = *a_at, b = *b_at;
            *a_at = a * c - b * s;
            *b_at = b * c + a * s;
        }
    }
}

void cb_rope_neox(float *x, int n_heads, int head_dim, int rot_dim, int pos, const float *inv_freq) {
    rope_pairs(x, n_heads, head_dim, rot_dim, pos, inv_freq, 1, rot_dim / 2);
}

void cb_rope_interleaved(float *x, int n_heads, int head_dim, int rot_dim, int pos, const float *inv_freq) {
    rope_pairs(x, n_heads, head_dim, rot_dim, pos, inv_freq, 2, 1);
}
