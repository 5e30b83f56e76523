/* kernels_impl.h: private glue between the dispatcher (kernels.c) and the per-ISA kernel files.
 * Not part of the engine-facing API; engines include kernels.h only. */
#ifndef COLIBRI_KERNELS_IMPL_H
#define COLIBRI_KERNELS_IMPL_H

#include "kernels.h"

/* The SIMD files use GCC/clang target attributes, so they only exist on x86 with those compilers; elsewhere the
 * scalar path is the only one (and the same bits come out, just slower). */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define CB_HAVE_X86_KERNELS 1
#else
#define CB_HAVE_X86_KERNELS 0
#endif

/* Y[j*ldy + r] = dot(W[r,:], X[j*ldx:]) for r in [r0, r1), j in [0, n). Every ISA implements this with the same
 * per-(row, input) summation order, so how rows and inputs are grouped never changes a bit. */
typedef void (*cb_rows_fn)(float *Y, size_t ldy, const void *W, cb_dtype dt, const float *X, size_t ldx, int n,
                           int r0, int r1, int cols);
/* out[i] = (float)in[i] for n elements of dtype dt. */
typedef void (*cb_convert_fn)(float *out, const void *in, cb_dtype dt, size_t n);
/* y[i] = y[i] + a * x[i]: a rounded product, then a rounded sum, lane by lane (no fused multiply-add), so every
 * ISA gives the scalar C expression's bits. */
typedef void (*cb_axpy_fn)(float *y, float a, const float *x, size_t n);
/* m of those in order of t: y[i] += a[t * lda] * X[t * ldx + i], each step rounded as above. */
typedef void (*cb_axpy_rows_fn)(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m, size_t n);

void cb_rows_scalar(float *Y, size_t ldy, const void *W, cb_dtype dt, const float *X, size_t ldx, int n, int r0,
                    int r1, int cols);
void cb_convert_scalar(float *out, const void *in, cb_dtype dt, size_t n);
void cb_axpy_scalar(float *y, float a, const float *x, size_t n);
void cb_axpy_rows_scalar(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m, size_t n);

#if CB_HAVE_X86_KERNELS
void cb_rows_avx2(float *Y, size_t ldy, const void *W, cb_dtype dt, const float *X, size_t ldx, int n, int r0,
                  int r1, int cols);
void cb_convert_avx2(float *out, const void *in, cb_dtype dt, size_t n);
void cb_axpy_avx2(float *y, float a, const float *x, size_t n);
void cb_axpy_rows_avx2(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m, size_t n);
void cb_rows_avx512(float *Y, size_t ldy, const void *W, cb_dtype dt, const float *X, size_t ldx, int n, int r0,
                    int r1, int cols);
void cb_convert_avx512(float *out, const void *in, cb_dtype dt, size_t n);
void cb_axpy_avx512(float *y, float a, const float *x, size_t n);
void cb_axpy_rows_avx512(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m, size_t n);
#endif

/* The pairwise tree of kernels.h over 16 lanes: s8[i] = l[i] + l[i + 8], then s4, s2, s1. Every scalar reference
 * path ends its 16-lane accumulation here, so they all share one definition of the order. */
static inline float cb_lane16_reduce(const float lane[16]) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

/* The kernels of the ISA currently selected (cb_set_isa / COLIBRI_ISA / detection). */
cb_rows_fn cb_current_rows(void);
cb_convert_fn cb_current_convert(void);
cb_axpy_fn cb_current_axpy(void);
cb_axpy_rows_fn cb_current_axpy_rows(void);

#endif
