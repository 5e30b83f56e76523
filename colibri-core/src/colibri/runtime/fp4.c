/* fp4.c: see fp4.h. The table, the scalar reference order, the dispatch and the checkpoint loader. */
#include "fp4.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_impl.h"

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
    size_t i = (size_t)r * (size_t)(W->cols / CB_FP4_GROUP) + (size_t)g;
    const unsigned char *p = W->scales;
    switch (W->scale_kind) {
    case CB_FP8_SCALE_BF16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return cb_bf16_to_f32(h);
    }
    case CB_FP8_SCALE_E8M0: {   /* 2^(b - 127); 0xff is NaN */
        uint8_t b = p[i];
        if (b == 0xff) return NAN;
        uint32_t bits = b ? (uint32_t)b << 23 : 0x00400000u;   /* 2^-127 is an f32 subnormal */
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    case CB_FP8_SCALE_F32: break;
    }
    float f;
    memcpy(&f, p + 4 * i, 4);
    return f;
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
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

void cb_fp4_rows_scalar(float *Y, size_t ldy, const cb_fp4matrix *W, const float *X, size_t ldx, int n, int r0,
                        int r1) {
    for (int r = r0; r < r1; r++)
        for (int j = 0; j < n; j++) Y[(size_t)j * ldy + r] = dot_scalar(W, r, X + (size_t)j * ldx);
}

#if !CB_HAVE_X86_KERNELS
void cb_fp4_rows_avx2(float *Y, size_t ldy, const cb_fp4matrix *W, const float *X, size_t ldx, int n, int r0,
                      int r1) {
    cb_fp4_rows_scalar(Y, ldy, W, X, ldx, n, r0, r1);
}
#endif

/* ---- drivers: who computes which rows; never how (so threads and batching never change a bit) ---- */

typedef struct {
    float *Y;
    const cb_fp4matrix *W;
    const float *X;
    int n;
    void (*rows)(float *, size_t, const cb_fp4matrix *, const float *, size_t, int, int, int);
} job_t;

static void run_rows(void *ctx, int r0, int r1) {
    const job_t *j = ctx;
    j->rows(j->Y, (size_t)j->W->rows, j->W, j->X, (size_t)j->W->cols, j->n, r0, r1);
}

void cb_fp4_matmul(float *Y, const cb_fp4matrix *W, const float *X, int n) {
    if (n <= 0 || W->rows <= 0) return;
    job_t j = {Y, W, X, n, cb_get_isa() == CB_ISA_SCALAR ? cb_fp4_rows_scalar : cb_fp4_rows_avx2};
    cb_parallel_rows(W->rows, (size_t)W->rows * (size_t)W->cols * (size_t)n, run_rows, &j);
}

void cb_fp4_matvec(float *y, const cb_fp4matrix *W, const float *x) { cb_fp4_matmul(y, W, x, 1); }

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

int cb_fp4_load(void **buf, cb_fp4matrix *W, const cb_st_index *idx, const char *name, int rows, int cols,
                size_t *bytes, char *err, size_t errlen) {
    const cb_tensor *t, *sc;
    int rc = cb_fp4_locate(idx, name, rows, cols, &t, &sc, err, errlen);
    if (rc) return rc;
    size_t wbytes = (size_t)t->nbytes, at = (wbytes + 63) / 64 * 64;
    char *b = aligned_alloc(64, (at + (size_t)sc->nbytes + 63) / 64 * 64 + 64);
    if (!b) {
        snprintf(err, errlen, "out of memory loading %s (%zu bytes)", name, wbytes);
        return -1;
    }
    if (cb_st_pread(idx, t->shard, b, t->nbytes, t->offset, err, errlen) ||
        cb_st_pread(idx, sc->shard, b + at, sc->nbytes, sc->offset, err, errlen)) {
        free(b);
        return -1;
    }
    memset(W, 0, sizeof *W);
    W->rows = rows;
    W->cols = cols;
    W->w = (const uint8_t *)b;
    W->scales = b + at;
    cb_fp4_scale_kind_of(sc->dtype_name, &W->scale_kind);
    *buf = b;
    if (bytes) *bytes += (size_t)t->nbytes + (size_t)sc->nbytes;
    return 0;
}
