/* int4_packed.c: see int4_packed.h. The scalar decode, the driver over kernels.h's float rows and the loader. */
#include "int4_packed.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_impl.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "int4_packed.c reads the packed I32 words as bytes, which needs a little-endian machine"
#endif

float cb_i4p_scale(const cb_i4pmatrix *W, int r, int g) {
    return cb_scale_at(W->scales, W->scale_kind, (size_t)r * (size_t)(W->cols / W->group) + (size_t)g);
}

void cb_i4p_dequant_row_scalar(float *out, const cb_i4pmatrix *W, int r) {
    const uint8_t *row = W->w + (size_t)r * (size_t)(W->cols / 2);
    float s = 0;
    for (int c = 0; c < W->cols; c++) {
        if (c % W->group == 0) s = cb_i4p_scale(W, r, c / W->group);
        uint8_t b = row[c >> 1];
        out[c] = (float)((int)(c & 1 ? b >> 4 : b & 15) - CB_I4P_OFFSET) * s;
    }
}

#if !CB_HAVE_X86_KERNELS
void cb_i4p_dequant_row_avx2(float *out, const cb_i4pmatrix *W, int r) { cb_i4p_dequant_row_scalar(out, W, r); }
#endif

void cb_i4p_dequant_row(float *out, const cb_i4pmatrix *W, int r) {
    if (cb_get_isa() == CB_ISA_SCALAR) cb_i4p_dequant_row_scalar(out, W, r);
    else cb_i4p_dequant_row_avx2(out, W, r);
}

/* ---- driver: rows are dequantized TILE at a time and handed to the float rows kernel of the current ISA ---- */

enum { TILE = 8 };

typedef struct {
    float *Y;
    const cb_i4pmatrix *W;
    const float *X;
    int n;
} job_t;

static void run_rows(void *ctx, int r0, int r1) {
    const job_t *j = ctx;
    const cb_i4pmatrix *W = j->W;
    size_t ldy = (size_t)W->rows, ldx = (size_t)W->cols;
    float *tile = malloc((size_t)TILE * (size_t)W->cols * sizeof(float));
    if (!tile) {   /* the failure cannot pass as a result */
        for (int i = 0; i < j->n; i++)
            for (int r = r0; r < r1; r++) j->Y[(size_t)i * ldy + r] = NAN;
        return;
    }
    cb_rows_fn rows = cb_current_rows();
    for (int r = r0; r < r1; r += TILE) {
        int m = r1 - r < TILE ? r1 - r : TILE;
        for (int k = 0; k < m; k++) cb_i4p_dequant_row(tile + (size_t)k * ldx, W, r + k);
        rows(j->Y + r, ldy, tile, CB_F32, j->X, ldx, j->n, 0, m, W->cols);
    }
    free(tile);
}

void cb_i4p_matmul(float *Y, const cb_i4pmatrix *W, const float *X, int n) {
    if (n <= 0 || W->rows <= 0) return;
    job_t j = {Y, W, X, n};
    cb_parallel_rows(W->rows, (size_t)W->rows * (size_t)W->cols * (size_t)n, run_rows, &j);
}

/* ---- checkpoints ---- */

static int read_shape(const cb_st_index *idx, const cb_tensor *t, int64_t out[2], char *err, size_t errlen) {
    int wide = strcmp(t->dtype_name, "I64") == 0;
    if ((!wide && strcmp(t->dtype_name, "I32")) || t->ndim != 1 || t->shape[0] != 2) {
        snprintf(err, errlen, "%s: shape tensor %s is %s [%lld]; it must be I32 or I64 [2]",
                 idx->shard_paths[t->shard], t->name, t->dtype_name, (long long)(t->ndim ? t->shape[0] : 0));
        return -1;
    }
    unsigned char raw[16];
    if (cb_st_pread(idx, t->shard, raw, wide ? 16 : 8, t->offset, err, errlen)) return -1;
    for (int k = 0; k < 2; k++) {
        if (wide) {
            memcpy(&out[k], raw + 8 * k, 8);
        } else {
            int32_t v;
            memcpy(&v, raw + 4 * k, 4);
            out[k] = v;
        }
    }
    return 0;
}

int cb_i4p_locate(const cb_st_index *idx, const char *name, int rows, int cols, const cb_tensor **w,
                  const cb_tensor **s, int *group, char *err, size_t errlen) {
    char packed[600], scale[600], shape[600];
    snprintf(packed, sizeof packed, "%s_packed", name);
    const cb_tensor *t = cb_st_find(idx, packed);
    if (!t) return 1;
    snprintf(scale, sizeof scale, "%s_scale", name);
    snprintf(shape, sizeof shape, "%s_shape", name);
    const char *path = idx->shard_paths[t->shard];
    const cb_tensor *sc = cb_st_find(idx, scale), *sh = cb_st_find(idx, shape);
    if (!sc || !sh) {
        snprintf(err, errlen, "%s: tensor %s has no %s; packed int4 weights need their scales and shape", path,
                 packed, sc ? shape : scale);
        return -1;
    }
    if (strcmp(t->dtype_name, "I32") || cols % 8 || t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols / 8) {
        snprintf(err, errlen, "%s: packed tensor %s is %s with %d dimensions [%lld, %lld] but the config implies "
                 "I32 [%d, %d] (eight values per word)", path, packed, t->dtype_name, t->ndim,
                 (long long)(t->ndim ? t->shape[0] : 0), (long long)(t->ndim > 1 ? t->shape[1] : 0), rows, cols / 8);
        return -1;
    }
    int64_t logical[2];
    if (read_shape(idx, sh, logical, err, errlen)) return -1;
    if (logical[0] != rows || logical[1] != cols) {
        snprintf(err, errlen, "%s: %s says [%lld, %lld] but the config implies [%d, %d]", idx->shard_paths[sh->shard],
                 shape, (long long)logical[0], (long long)logical[1], rows, cols);
        return -1;
    }
    cb_fp8_scale_kind kind;
    if (cb_fp8_scale_kind_of(sc->dtype_name, &kind) || kind == CB_FP8_SCALE_E8M0) {
        snprintf(err, errlen, "%s: scale tensor %s has dtype %s; int4 scales must be BF16 or F32",
                 idx->shard_paths[sc->shard], scale, sc->dtype_name);
        return -1;
    }
    int64_t g = sc->ndim == 2 && sc->shape[1] > 0 && cols % sc->shape[1] == 0 ? cols / sc->shape[1] : 0;
    if (sc->ndim != 2 || sc->shape[0] != rows || g == 0 || g % CB_I4P_LANES) {
        snprintf(err, errlen, "%s: scale tensor %s has shape [%lld, %lld]; %s [%d, %d] needs [%d, %d / group] with "
                 "the group a multiple of %d", idx->shard_paths[sc->shard], scale,
                 (long long)(sc->ndim ? sc->shape[0] : 0), (long long)(sc->ndim > 1 ? sc->shape[1] : 0), name, rows,
                 cols, rows, cols, CB_I4P_LANES);
        return -1;
    }
    *w = t;
    *s = sc;
    *group = (int)g;
    return 0;
}
