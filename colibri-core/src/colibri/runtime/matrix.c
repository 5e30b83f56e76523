/* matrix.c: see matrix.h. The one place that dispatches on a matrix's stored form. */
#include "matrix.h"

#include "qlinear.h"

cb_matrix cb_matrix_float(const void *w, cb_dtype dt, int rows, int cols) {
    cb_matrix m = {.kind = CB_MAT_FLOAT, .rows = rows, .cols = cols};
    m.f.w = w;
    m.f.dt = dt;
    return m;
}

void cb_matrix_apply(const cb_matrix *W, float *Y, const float *X, int n) {
    switch (W->kind) {
    case CB_MAT_INT: (void)cb_qlinear_apply(&W->q, Y, X, n); return;
    case CB_MAT_FP8: cb_fp8_matmul(Y, &W->f8, X, n); return;
    case CB_MAT_FP4: cb_fp4_matmul(Y, &W->f4, X, n); return;
    case CB_MAT_I4P: cb_i4p_matmul(Y, &W->i4, X, n); return;
    case CB_MAT_FLOAT: break;
    }
    if (n == 1) cb_matvec(Y, W->f.w, W->f.dt, X, W->rows, W->cols);
    else cb_matmul(Y, W->f.w, W->f.dt, X, n, W->rows, W->cols);
}

void cb_matrix_row(float *out, const cb_matrix *W, int r) {
    switch (W->kind) {
    case CB_MAT_INT: (void)cb_qdequant_row(out, &W->q, r); return;
    case CB_MAT_FP8: cb_fp8_dequant_row(out, &W->f8, r); return;
    case CB_MAT_FP4: cb_fp4_dequant_row(out, &W->f4, r); return;
    case CB_MAT_I4P: cb_i4p_dequant_row(out, &W->i4, r); return;
    case CB_MAT_FLOAT: break;
    }
    size_t at = (size_t)r * (size_t)W->cols * cb_dtype_size(W->f.dt);
    cb_convert_to_f32(out, (const char *)W->f.w + at, W->f.dt, (size_t)W->cols);
}
