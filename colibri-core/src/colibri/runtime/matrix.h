/* matrix.h: one weight matrix in whatever form the checkpoint stores it, behind one tag.
 *
 * A matrix [rows, cols] (row-major) is float (F32/BF16/F16), colibri-quant integer levels + scales (quant.h),
 * block-quantized fp8 (fp8.h), fp4 with per-32 scales (fp4.h) or packed int4 with per-group scales (int4_packed.h). Linear layers (blocks.h's cb_linear) and routed
 * experts (experts.h's cb_expert_view) hold a cb_matrix, and every consumer goes through cb_matrix_apply /
 * cb_matrix_row instead of asking which form it is: the kind is decided once, where the checkpoint is read.
 * Each kind keeps its own numerics contract (the fp8/fp4 kernels give the float path's bits on the dequantized
 * weights; the integer kernels are bit-identical across ISAs), and each is bit-identical scalar vs SIMD.
 */
#ifndef COLIBRI_MATRIX_H
#define COLIBRI_MATRIX_H

#include <stddef.h>

#include "fp4.h"
#include "fp8.h"
#include "int4_packed.h"
#include "kernels.h"
#include "quant.h"

typedef enum { CB_MAT_FLOAT = 0, CB_MAT_INT = 1, CB_MAT_FP8 = 2, CB_MAT_FP4 = 3, CB_MAT_I4P = 4 } cb_mat_kind;

typedef struct {
    cb_mat_kind kind;
    int rows, cols;
    union {
        struct {
            const void *w;     /* CB_MAT_FLOAT: the elements, of dtype dt */
            cb_dtype dt;
        } f;
        cb_qmatrix q;          /* CB_MAT_INT: int8-row / int4-g64 levels + F16 scales */
        cb_fp8matrix f8;       /* CB_MAT_FP8: e4m3 + 128x128 block scales */
        cb_fp4matrix f4;       /* CB_MAT_FP4: packed e2m1 + per-32 scales */
        cb_i4pmatrix i4;       /* CB_MAT_I4P: compressed-tensors packed int4 + per-group scales (int4_packed.h) */
    };
} cb_matrix;

/* A float matrix over w (not owned). */
cb_matrix cb_matrix_float(const void *w, cb_dtype dt, int rows, int cols);

/* Y[i] = W X[i] for n rows (X: n x cols, Y: n x rows); row i is what n = 1 gives it. An integer matrix whose
 * scratch cannot be allocated fills Y with NaN (cb_qlinear_apply), so the failure cannot pass as a result. */
void cb_matrix_apply(const cb_matrix *W, float *Y, const float *X, int n);
/* out[c] = the dequantized element (r, c) as f32: exact for every kind (embedding lookups, dequantization). */
void cb_matrix_row(float *out, const cb_matrix *W, int r);

#endif
