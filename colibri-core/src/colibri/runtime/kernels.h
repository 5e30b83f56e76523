/* kernels.h: the numeric building blocks every colibri engine uses.
 *
 * Contract (tested in engines/tests): every SIMD path (AVX-512, AVX2) returns results bit-identical to the
 * scalar path, and cb_matmul row n equals cb_matvec on row n bit for bit, whatever the thread count. That is
 * what keeps "placement may change speed, never the tokens" true across machines, cache sizes and batching.
 * It is achieved by fixing the floating-point summation order: 16 virtual lanes (element c goes to lane c % 16,
 * accumulated with fmaf), a fixed pairwise reduction tree (lane i + lane i+8, then +4, +2, +1), then the tail
 * elements in order with fmaf. Build with -ffp-contract=off (the builder does) so the compiler never fuses any
 * other multiply-add differently from one build or ISA to another.
 *
 * Files: kernels.c (dispatch, drivers, elementwise kernels), kernels_scalar.c (the reference order),
 * kernels_simd.h (the SIMD body, instantiated by kernels_avx2.c and kernels_avx512.c), threads.c (the pool).
 */
#ifndef COLIBRI_KERNELS_H
#define COLIBRI_KERNELS_H

#include <stddef.h>
#include <stdint.h>

typedef enum { CB_F32 = 0, CB_BF16 = 1, CB_F16 = 2 } cb_dtype;
typedef enum { CB_ISA_SCALAR = 0, CB_ISA_AVX2 = 1, CB_ISA_AVX512 = 2 } cb_isa;

/* Best ISA this CPU supports; cb_set_isa forces one (tests; COLIBRI_ISA=scalar|avx2|avx512 at init). */
cb_isa cb_isa_detect(void);
int cb_set_isa(cb_isa isa);          /* 0 on success, -1 if the CPU lacks it */
cb_isa cb_get_isa(void);             /* first call reads COLIBRI_ISA, else detects */
const char *cb_isa_name(cb_isa isa);
int cb_isa_from_name(const char *name, cb_isa *out);   /* "scalar"|"avx2"|"avx512" -> 0, else -1 */
/* Why COLIBRI_ISA was not honoured (unknown value, or the CPU lacks it; the detected ISA is used instead, which
 * changes speed only), or NULL. Engines print it as a warning at startup. */
const char *cb_isa_env_error(void);

/* Thread pool shared by all kernels. n_threads <= 0 means physical cores (of the CPUs this process may use).
 * Returns 0 or -1. Until it is called, everything runs on the calling thread. Calling it again resizes the pool;
 * never while a kernel is running. */
int cb_threads_init(int n_threads);
int cb_threads_count(void);
void cb_threads_shutdown(void);
/* Run fn(ctx, i) for i in [0, n) across the pool; returns when all are done. Called from inside a task (or from a
 * second thread while a job runs) it runs the tasks inline on the calling thread. */
void cb_parallel_for(int n, void (*fn)(void *ctx, int i), void *ctx);
/* Run fn(ctx, r0, r1) over row ranges covering [0, rows): on the calling thread when work (multiply-adds) is under
 * 32768 or there is one thread, else in chunks of at least 4 rows, 4 per thread. Rows must be independent, so the
 * split never changes a bit. */
void cb_parallel_rows(int rows, size_t work, void (*fn)(void *ctx, int r0, int r1), void *ctx);

size_t cb_dtype_size(cb_dtype dt);
float cb_bf16_to_f32(uint16_t h);
float cb_f16_to_f32(uint16_t h);
uint16_t cb_f32_to_bf16(float f);    /* round to nearest even, as torch does; NaN -> 0x7fc0 */
/* out[i] = in[i] as f32 for n elements (embedding rows, norm weights), on the selected ISA; exact. */
void cb_convert_to_f32(float *out, const void *in, cb_dtype dt, size_t n);

/* Dot product of x (f32) with one weight row of dtype dt, in the fixed lane order above. */
float cb_dot(const void *w_row, cb_dtype dt, const float *x, int cols);
/* Y[j * ldy] = cb_dot(w, CB_F32, X + j * ldx, cols) for j < n, bit for bit, on the calling thread: one f32 row
 * (say one KV head's key at one position) against n inputs at any strides (the query rows or heads that read it),
 * loaded once for all of them. */
void cb_dots(float *Y, size_t ldy, const float *w, const float *X, size_t ldx, int n, int cols);
/* y[r] = dot(W[r,:], x) for r < rows; W row-major, `cols` elements per row. Parallel over rows once
 * rows * cols >= 32768. y must not alias W or x. */
void cb_matvec(float *y, const void *W, cb_dtype dt, const float *x, int rows, int cols);
/* Y[i*rows + r] = dot(W[r,:], X[i*cols:]) for i < n. Bit-identical to n calls of cb_matvec. */
void cb_matmul(float *Y, const void *W, cb_dtype dt, const float *X, int n, int rows, int cols);

/* out may equal x. w may be NULL (no weight). */
void cb_rmsnorm(float *out, const float *x, const float *w, int n, float eps);
void cb_softmax(float *x, int n);
void cb_axpy(float *y, float a, const float *x, size_t n);   /* y[i] += a * x[i], the scalar expression's bits */
/* y[i] += a[t * lda] * X[t * ldx + i] for t = 0 .. m-1 in order: the bits of m cb_axpy calls, with y held in
 * registers across them (attention's value sum over a chunk of positions). */
void cb_axpy_rows(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m, size_t n);
void cb_silu_mul(float *gate, const float *up, int n);    /* gate[i] = silu(gate[i]) * up[i] */
/* RoPE on n_heads heads of head_dim, rotating the first rot_dim dims of each head at position pos.
 * neox: pairs (i, i + rot_dim/2); interleaved: pairs (2i, 2i+1). inv_freq has rot_dim/2 entries. */
void cb_rope_neox(float *x, int n_heads, int head_dim, int rot_dim, int pos, const float *inv_freq);
void cb_rope_interleaved(float *x, int n_heads, int head_dim, int rot_dim, int pos, const float *inv_freq);

#endif
