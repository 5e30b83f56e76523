/* fp4.c: see fp4.h. The table, the scalar reference order, the dispatch and the checkpoint loader. */
#include "fp4.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "blockscaled.h"

const float cb_e2m1_table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

int cb_fp4_scale_kind_of(const char *dtype_name, cb_fp8_scale_kind *out) {
    if (strcmp(dtype_name, "U8") == 0) {   /* raw ue8m0 exponent bytes, as transformers reads them */
        *out = CB_FP8_SCALE_E8M0;
        return 0;
    }
    return cb_fp8_scale_kind_of(dtype_name, out);
}

float cb_fp4_scale(const cb_fp4matrix *W, int r, int g) {
    return cb_scale_at(W->scales, W->scale_kind, (size_t)r * (size_t)(W->cols / CB_FP4_GROUP) + (size_t)g);
}

static inline float weight(const uint8_t *row, int c, float s) {
    uint8_t b = row[c >> 1];
    return cb_e2m1_table[c & 1 ? b >> 4 : b & 15] * s;
}

void cb_fp4_dequant_row(float *out, const cb_fp4matrix *W, int r) {
    const uint8_t *row = W->w + (size_t)r * (size_t)(W->cols / 2);
    for (int c = 0; c < W->cols; c++) out[c] = weight(row, c, cb_fp4_scale(W, r, c / CB_FP4_GROUP));
}

/* The reference order of kernels.h over the dequantized weights (cols is a multiple of 32: no tail). */
static float dot_scalar(const cb_fp4matrix *W, int r, const float *x) {
    const uint8_t *row = W->w + (size_t)r * (size_t)(W->cols / 2);
    float lane[16] = {0}, s = 0;
    for (int c = 0; c < W->cols; c += 16) {
        if (c % CB_FP4_GROUP == 0) s = cb_fp4_scale(W, r, c / CB_FP4_GROUP);
        for (int k = 0; k < 16; k++) lane[k] = fmaf(weight(row, c + k, s), x[c + k], lane[k]);
    }
    return cb_lane16_reduce(lane);
}

CB_BLOCKSCALED_DRIVERS(cb_fp4, cb_fp4matrix, cb_fp4_rows_avx2)

/* ---- checkpoints ---- */

int cb_fp4_locate(const cb_st_index *idx, const char *name, int rows, int cols, const cb_tensor **w,
                  const cb_tensor **s, char *err, size_t errlen) {
    const cb_tensor *t = cb_st_find(idx, name);
    if (!t || (strcmp(t->dtype_name, "I8") && strcmp(t->dtype_name, "U8") && strcmp(t->dtype_name, "F4")))
        return 1;
    const cb_tensor *sc = cb_fp8_companion(idx, name);
    const char *path = idx->shard_paths[t->shard];
    if (!sc) {
        snprintf(err, errlen, "%s: tensor %s has dtype %s but no scale companion (%s_scale_inv or .scale); fp4 "
                 "weights need their per-32 scales", path, name, t->dtype_name, name);
        return -1;
    }
    int packed = strcmp(t->dtype_name, "F4") != 0;   /* I8/U8 store [rows, cols / 2] bytes, F4 [rows, cols] */
    if (cols % CB_FP4_GROUP || t->ndim != 2 || t->shape[0] != rows || t->shape[1] != (packed ? cols / 2 : cols)) {
        snprintf(err, errlen, "%s: fp4 tensor %s (%s) has %d dimensions [%lld, %lld] but the config implies "
                 "[%d, %d] (%s), with the columns a multiple of %d", path, name, t->dtype_name, t->ndim,
                 (long long)(t->ndim ? t->shape[0] : 0), (long long)(t->ndim > 1 ? t->shape[1] : 0), rows,
                 packed ? cols / 2 : cols, packed ? "two values per byte" : "logical shape", CB_FP4_GROUP);
        return -1;
    }
    cb_fp8_scale_kind kind;
    if (cb_fp4_scale_kind_of(sc->dtype_name, &kind)) {
        snprintf(err, errlen, "%s: scale tensor %s has dtype %s; fp4 scales must be F8_E8M0, U8, F32 or BF16",
                 idx->shard_paths[sc->shard], sc->name, sc->dtype_name);
        return -1;
    }
    if (sc->ndim != 2 || sc->shape[0] != rows || sc->shape[1] != cols / CB_FP4_GROUP) {
        snprintf(err, errlen, "%s: scale tensor %s has shape [%lld, %lld] but %s [%d, %d] in groups of %d needs "
                 "[%d, %d]", idx->shard_paths[sc->shard], sc->name, (long long)(sc->ndim ? sc->shape[0] : 0),
                 (long long)(sc->ndim > 1 ? sc->shape[1] : 0), name, rows, cols, CB_FP4_GROUP, rows,
                 cols / CB_FP4_GROUP);
        return -1;
    }
    *w = t;
    *s = sc;
    return 0;
}

CB_BLOCKSCALED_LOAD(cb_fp4, cb_fp4matrix)
