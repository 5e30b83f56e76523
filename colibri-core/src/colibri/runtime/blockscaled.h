/* blockscaled.h: the row drivers every block-scaled weight format shares (fp8.c, fp4.c and their AVX2 bodies).
 * Private to the runtime; engines include fp8.h / fp4.h.
 *
 * A format supplies only how one weight is decoded: `static float dot_scalar(const MTYPE *W, int r, const float *x)`
 * in its scalar file and two tiles in each SIMD file (CB_BLOCKSCALED_ROWS below).
 * The macros below write the rest once: which rows and inputs each call computes, the threading, the scalar
 * stand-in where there are no x86 kernels, and the loader over the format's own locate (its dtype and shape
 * checks). They decide who computes which (row, input), never how, so threads and batching never change a bit. */
#ifndef COLIBRI_BLOCKSCALED_H
#define COLIBRI_BLOCKSCALED_H

#include "kernels_impl.h"

/* PREFIX_rows_scalar over dot_scalar, and PREFIX_matmul / PREFIX_matvec dispatching to the selected ISA's body and
 * parallel over rows once rows * cols * n is large enough (cb_parallel_rows). AVX512_ROWS is the body an AVX-512
 * CPU runs: the format's own (PREFIX_rows_avx512) or its AVX2 one. */
#define CB_BLOCKSCALED_DRIVERS(PREFIX, MTYPE, AVX512_ROWS)                                                         \
    void PREFIX##_rows_scalar(float *Y, size_t ldy, const MTYPE *W, const float *X, size_t ldx, int n, int r0,     \
                              int r1) {                                                                          \
        for (int r = r0; r < r1; r++)                                                                              \
            for (int j = 0; j < n; j++) Y[(size_t)j * ldy + r] = dot_scalar(W, r, X + (size_t)j * ldx);           \
    }                                                                                                              \
    CB_BLOCKSCALED_AVX2_STANDIN(PREFIX, MTYPE)                                                                     \
    typedef struct {                                                                                               \
        float *Y;                                                                                                  \
        const MTYPE *W;                                                                                            \
        const float *X;                                                                                            \
        int n;                                                                                                     \
        void (*rows)(float *, size_t, const MTYPE *, const float *, size_t, int, int, int);                        \
    } PREFIX##_job;                                                                                                \
    static void PREFIX##_run_rows(void *ctx, int r0, int r1) {                                                     \
        const PREFIX##_job *j = ctx;                                                                               \
        j->rows(j->Y, (size_t)j->W->rows, j->W, j->X, (size_t)j->W->cols, j->n, r0, r1);                           \
    }                                                                                                              \
    void PREFIX##_matmul(float *Y, const MTYPE *W, const float *X, int n) {                                        \
        if (n <= 0 || W->rows <= 0) return;                                                                        \
        cb_isa isa = cb_get_isa();                                                                                 \
        PREFIX##_job j = {Y, W, X, n, isa == CB_ISA_SCALAR ? PREFIX##_rows_scalar                                  \
                                      : isa == CB_ISA_AVX2 ? PREFIX##_rows_avx2 : AVX512_ROWS};                    \
        cb_parallel_rows(W->rows, (size_t)W->rows * (size_t)W->cols * (size_t)n, PREFIX##_run_rows, &j);           \
    }                                                                                                              \
    void PREFIX##_matvec(float *y, const MTYPE *W, const float *x) { PREFIX##_matmul(y, W, x, 1); }

#if CB_HAVE_X86_KERNELS
#define CB_BLOCKSCALED_AVX2_STANDIN(PREFIX, MTYPE)
#else
/* No AVX2 file is compiled: the AVX2 entry point is the scalar body (the same bits, as everywhere). */
#define CB_BLOCKSCALED_AVX2_STANDIN(PREFIX, MTYPE)                                                                 \
    void PREFIX##_rows_avx2(float *Y, size_t ldy, const MTYPE *W, const float *X, size_t ldx, int n, int r0,       \
                            int r1) {                                                                            \
        PREFIX##_rows_scalar(Y, ldy, W, X, ldx, n, r0, r1);                                                        \
    }
#endif

/* PREFIX_rows##SUFFIX (SUFFIX _avx2 or _avx512) over the file's two tiles: `row_tile(Y, ldy, W, r, X, ldx, nx)`
 * (one row against nx <= 4 inputs) and `rows4_tile(y, W, r, x)` (rows r .. r+3 against one input). Inputs go in
 * tiles of four, one row at a time (each row's weights decoded once per tile); the inputs left over, decode's single
 * one above all, four rows at a time: a row's sum is one chain of dependent fmas (the summation order is fixed), so
 * one row alone waits on the fma latency, four independent ones keep the units busy. Which tile computes an output
 * never changes its bits. Expanded where CB_TARGET is defined. */
#define CB_BLOCKSCALED_ROWS_(PREFIX, MTYPE, SUFFIX)                                                                    \
    CB_TARGET void PREFIX##_rows##SUFFIX(float *Y, size_t ldy, const MTYPE *W, const float *X, size_t ldx, int n,      \
                                      int r0, int r1) {                                                                \
        int j = 0;                                                                                                     \
        for (; j + 4 <= n; j += 4)                                                                                     \
            for (int r = r0; r < r1; r++) row_tile(Y + (size_t)j * ldy, ldy, W, r, X + (size_t)j * ldx, ldx, 4);       \
        for (; j < n; j++) {                                                                                           \
            float *y = Y + (size_t)j * ldy;                                                                            \
            const float *x = X + (size_t)j * ldx;                                                                      \
            int r = r0;                                                                                                \
            for (; r + 4 <= r1; r += 4) rows4_tile(y, W, r, x);                                                        \
            for (; r < r1; r++) row_tile(y, ldy, W, r, x, ldx, 1);                                                     \
        }                                                                                                              \
    }
#define CB_BLOCKSCALED_ROWS(PREFIX, MTYPE, SUFFIX) CB_BLOCKSCALED_ROWS_(PREFIX, MTYPE, SUFFIX)

/* PREFIX_load over the format's PREFIX_locate and PREFIX_scale_kind_of: 1 when the tensor is not of the format, 0
 * with *buf owning weights then scales (cb_scaled_read) and *W pointing into it, -1 with a message. Expanded in the
 * format's file (it needs fp8.h and string.h). */
#define CB_BLOCKSCALED_LOAD(PREFIX, MTYPE)                                                                         \
    int PREFIX##_load(void **buf, MTYPE *W, const cb_st_index *idx, const char *name, int rows, int cols,          \
                      size_t *bytes, char *err, size_t errlen) {                                                 \
        const cb_tensor *t, *sc;                                                                                   \
        int rc = PREFIX##_locate(idx, name, rows, cols, &t, &sc, err, errlen);                                     \
        if (rc) return rc;                                                                                         \
        memset(W, 0, sizeof *W);                                                                                   \
        if (cb_scaled_read(buf, &W->scales, idx, t, sc, name, bytes, err, errlen)) return -1;                      \
        W->rows = rows;                                                                                            \
        W->cols = cols;                                                                                            \
        W->w = *buf;                                                                                               \
        PREFIX##_scale_kind_of(sc->dtype_name, &W->scale_kind);                                                    \
        return 0;                                                                                                  \
    }

#endif
