/* fp8.c: see fp8.h. The table, the scalar reference order, the dispatch and the checkpoint loader. */
#include "fp8.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blockscaled.h"

/* e4m3fn byte -> f32, exactly: subnormals m * 2^-9, normals (8 + m) * 2^(e - 10), 0x7f / 0xff NaN. */
const float cb_e4m3_table[256] = {
    0.0f, 0x8p-12f, 0x8p-11f, 0xcp-11f, 0x8p-10f, 0xap-10f, 0xcp-10f, 0xep-10f,
    0x8p-9f, 0x9p-9f, 0xap-9f, 0xbp-9f, 0xcp-9f, 0xdp-9f, 0xep-9f, 0xfp-9f,
    0x8p-8f, 0x9p-8f, 0xap-8f, 0xbp-8f, 0xcp-8f, 0xdp-8f, 0xep-8f, 0xfp-8f,
    0x8p-7f, 0x9p-7f, 0xap-7f, 0xbp-7f, 0xcp-7f, 0xdp-7f, 0xep-7f, 0xfp-7f,
    0x8p-6f, 0x9p-6f, 0xap-6f, 0xbp-6f, 0xcp-6f, 0xdp-6f, 0xep-6f, 0xfp-6f,
    0x8p-5f, 0x9p-5f, 0xap-5f, 0xbp-5f, 0xcp-5f, 0xdp-5f, 0xep-5f, 0xfp-5f,
    0x8p-4f, 0x9p-4f, 0xap-4f, 0xbp-4f, 0xcp-4f, 0xdp-4f, 0xep-4f, 0xfp-4f,
    0x8p-3f, 0x9p-3f, 0xap-3f, 0xbp-3f, 0xcp-3f, 0xdp-3f, 0xep-3f, 0xfp-3f,
    0x8p-2f, 0x9p-2f, 0xap-2f, 0xbp-2f, 0xcp-2f, 0xdp-2f, 0xep-2f, 0xfp-2f,
    0x8p-1f, 0x9p-1f, 0xap-1f, 0xbp-1f, 0xcp-1f, 0xdp-1f, 0xep-1f, 0xfp-1f,
    0x8p+0f, 0x9p+0f, 0xap+0f, 0xbp+0f, 0xcp+0f, 0xdp+0f, 0xep+0f, 0xfp+0f,
    0x8p+1f, 0x9p+1f, 0xap+1f, 0xbp+1f, 0xcp+1f, 0xdp+1f, 0xep+1f, 0xfp+1f,
    0x8p+2f, 0x9p+2f, 0xap+2f, 0xbp+2f, 0xcp+2f, 0xdp+2f, 0xep+2f, 0xfp+2f,
    0x8p+3f, 0x9p+3f, 0xap+3f, 0xbp+3f, 0xcp+3f, 0xdp+3f, 0xep+3f, 0xfp+3f,
    0x8p+4f, 0x9p+4f, 0xap+4f, 0xbp+4f, 0xcp+4f, 0xdp+4f, 0xep+4f, 0xfp+4f,
    0x8p+5f, 0x9p+5f, 0xap+5f, 0xbp+5f, 0xcp+5f, 0xdp+5f, 0xep+5f, NAN,
    -0.0f, -0x8p-12f, -0x8p-11f, -0xcp-11f, -0x8p-10f, -0xap-10f, -0xcp-10f, -0xep-10f,
    -0x8p-9f, -0x9p-9f, -0xap-9f, -0xbp-9f, -0xcp-9f, -0xdp-9f, -0xep-9f, -0xfp-9f,
    -0x8p-8f, -0x9p-8f, -0xap-8f, -0xbp-8f, -0xcp-8f, -0xdp-8f, -0xep-8f, -0xfp-8f,
    -0x8p-7f, -0x9p-7f, -0xap-7f, -0xbp-7f, -0xcp-7f, -0xdp-7f, -0xep-7f, -0xfp-7f,
    -0x8p-6f, -0x9p-6f, -0xap-6f, -0xbp-6f, -0xcp-6f, -0xdp-6f, -0xep-6f, -0xfp-6f,
    -0x8p-5f, -0x9p-5f, -0xap-5f, -0xbp-5f, -0xcp-5f, -0xdp-5f, -0xep-5f, -0xfp-5f,
    -0x8p-4f, -0x9p-4f, -0xap-4f, -0xbp-4f, -0xcp-4f, -0xdp-4f, -0xep-4f, -0xfp-4f,
    -0x8p-3f, -0x9p-3f, -0xap-3f, -0xbp-3f, -0xcp-3f, -0xdp-3f, -0xep-3f, -0xfp-3f,
    -0x8p-2f, -0x9p-2f, -0xap-2f, -0xbp-2f, -0xcp-2f, -0xdp-2f, -0xep-2f, -0xfp-2f,
    -0x8p-1f, -0x9p-1f, -0xap-1f, -0xbp-1f, -0xcp-1f, -0xdp-1f, -0xep-1f, -0xfp-1f,
    -0x8p+0f, -0x9p+0f, -0xap+0f, -0xbp+0f, -0xcp+0f, -0xdp+0f, -0xep+0f, -0xfp+0f,
    -0x8p+1f, -0x9p+1f, -0xap+1f, -0xbp+1f, -0xcp+1f, -0xdp+1f, -0xep+1f, -0xfp+1f,
    -0x8p+2f, -0x9p+2f, -0xap+2f, -0xbp+2f, -0xcp+2f, -0xdp+2f, -0xep+2f, -0xfp+2f,
    -0x8p+3f, -0x9p+3f, -0xap+3f, -0xbp+3f, -0xcp+3f, -0xdp+3f, -0xep+3f, -0xfp+3f,
    -0x8p+4f, -0x9p+4f, -0xap+4f, -0xbp+4f, -0xcp+4f, -0xdp+4f, -0xep+4f, -0xfp+4f,
    -0x8p+5f, -0x9p+5f, -0xap+5f, -0xbp+5f, -0xcp+5f, -0xdp+5f, -0xep+5f, -NAN,
};

float cb_e4m3_to_f32(uint8_t b) { return cb_e4m3_table[b]; }

size_t cb_fp8_scale_count(int rows, int cols) {
    return (size_t)((rows + CB_FP8_BLOCK - 1) / CB_FP8_BLOCK) * (size_t)((cols + CB_FP8_BLOCK - 1) / CB_FP8_BLOCK);
}

size_t cb_fp8_scale_size(cb_fp8_scale_kind kind) {
    return kind == CB_FP8_SCALE_F32 ? 4 : kind == CB_FP8_SCALE_BF16 ? 2 : 1;
}

int cb_fp8_scale_kind_of(const char *dtype_name, cb_fp8_scale_kind *out) {
    if (strcmp(dtype_name, "F32") == 0) *out = CB_FP8_SCALE_F32;
    else if (strcmp(dtype_name, "BF16") == 0) *out = CB_FP8_SCALE_BF16;
    else if (strcmp(dtype_name, "F8_E8M0") == 0) *out = CB_FP8_SCALE_E8M0;
    else return -1;
    return 0;
}

float cb_scale_at(const void *scales, cb_fp8_scale_kind kind, size_t i) {
    const unsigned char *p = scales;
    switch (kind) {
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

float cb_fp8_scale(const cb_fp8matrix *W, int block_row, int block_col) {
    size_t i = (size_t)block_row * (size_t)((W->cols + CB_FP8_BLOCK - 1) / CB_FP8_BLOCK) + (size_t)block_col;
    return cb_scale_at(W->scales, W->scale_kind, i);
}

void cb_fp8_dequant_row(float *out, const cb_fp8matrix *W, int r) {
    const uint8_t *row = W->w + (size_t)r * (size_t)W->cols;
    for (int c0 = 0; c0 < W->cols; c0 += CB_FP8_BLOCK) {
        float s = cb_fp8_scale(W, r / CB_FP8_BLOCK, c0 / CB_FP8_BLOCK);
        int c1 = c0 + CB_FP8_BLOCK < W->cols ? c0 + CB_FP8_BLOCK : W->cols;
        for (int c = c0; c < c1; c++) out[c] = cb_e4m3_table[row[c]] * s;
    }
}

/* The reference order of kernels.h over the dequantized weights (see fp8.h). */
static float dot_scalar(const cb_fp8matrix *W, int r, const float *x) {
    const uint8_t *row = W->w + (size_t)r * (size_t)W->cols;
    int cols = W->cols, main_cols = cols - cols % 16, br = r / CB_FP8_BLOCK;
    float lane[16] = {0}, s = 0;
    for (int c = 0; c < main_cols; c += 16) {
        if (c % CB_FP8_BLOCK == 0) s = cb_fp8_scale(W, br, c / CB_FP8_BLOCK);
        for (int k = 0; k < 16; k++) {
            float w = cb_e4m3_table[row[c + k]] * s;
            lane[k] = fmaf(w, x[c + k], lane[k]);
        }
    }
    float sum = cb_lane16_reduce(lane);
    if (main_cols < cols) s = cb_fp8_scale(W, br, main_cols / CB_FP8_BLOCK);
    for (int c = main_cols; c < cols; c++) {
        float w = cb_e4m3_table[row[c]] * s;
        sum = fmaf(w, x[c], sum);
    }
    return sum;
}

#if !CB_HAVE_X86_KERNELS
void cb_fp8_rows_avx512(float *Y, size_t ldy, const cb_fp8matrix *W, const float *X, size_t ldx, int n, int r0,
                        int r1) {
    cb_fp8_rows_scalar(Y, ldy, W, X, ldx, n, r0, r1);
}
#endif

CB_BLOCKSCALED_DRIVERS(cb_fp8, cb_fp8matrix, cb_fp8_rows_avx512)

/* ---- checkpoints ---- */

const cb_tensor *cb_fp8_companion(const cb_st_index *idx, const char *name) {
    char buf[600];
    if (snprintf(buf, sizeof buf, "%s_scale_inv", name) >= (int)sizeof buf) return NULL;
    const cb_tensor *s = cb_st_find(idx, buf);
    if (s) return s;
    size_t n = strlen(name);
    if (n > 7 && strcmp(name + n - 7, ".weight") == 0 && n < sizeof buf - 8) {
        snprintf(buf, sizeof buf, "%.*s.scale", (int)(n - 7), name);
        return cb_st_find(idx, buf);
    }
    return NULL;
}

int cb_fp8_locate(const cb_st_index *idx, const char *name, int rows, int cols, const cb_tensor **w,
                  const cb_tensor **s, char *err, size_t errlen) {
    const cb_tensor *sc = cb_fp8_companion(idx, name);
    if (!sc) return 1;
    const cb_tensor *t = cb_st_find(idx, name);
    if (!t) {
        snprintf(err, errlen, "tensor %s not found in the checkpoint (its scale %s is)", name, sc->name);
        return -1;
    }
    const char *path = idx->shard_paths[t->shard];
    if (strcmp(t->dtype_name, "F8_E4M3") != 0) {
        snprintf(err, errlen, "%s: tensor %s has a block scale %s but dtype %s; block-quantized weights must be "
                 "F8_E4M3", path, name, sc->name, t->dtype_name);
        return -1;
    }
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        snprintf(err, errlen, "%s: tensor %s has %d dimensions [%lld, ...] but the config implies [%d, %d]", path,
                 name, t->ndim, (long long)(t->ndim ? t->shape[0] : 0), rows, cols);
        if (t->ndim == 2)
            snprintf(err, errlen, "%s: tensor %s has shape [%lld, %lld] but the config implies [%d, %d]", path, name,
                     (long long)t->shape[0], (long long)t->shape[1], rows, cols);
        return -1;
    }
    cb_fp8_scale_kind kind;
    int64_t br = (rows + CB_FP8_BLOCK - 1) / CB_FP8_BLOCK, bc = (cols + CB_FP8_BLOCK - 1) / CB_FP8_BLOCK;
    if (cb_fp8_scale_kind_of(sc->dtype_name, &kind)) {
        snprintf(err, errlen, "%s: scale tensor %s has dtype %s; fp8 block scales must be F32, BF16 or F8_E8M0",
                 idx->shard_paths[sc->shard], sc->name, sc->dtype_name);
        return -1;
    }
    if (sc->ndim != 2 || sc->shape[0] != br || sc->shape[1] != bc) {
        snprintf(err, errlen, "%s: scale tensor %s has shape [%lld, %lld] but %s [%d, %d] in 128x128 blocks needs "
                 "[%lld, %lld] (check quantization_config.weight_block_size in config.json)",
                 idx->shard_paths[sc->shard], sc->name, (long long)sc->shape[0],
                 (long long)(sc->ndim > 1 ? sc->shape[1] : 0), name, rows, cols, (long long)br, (long long)bc);
        return -1;
    }
    *w = t;
    *s = sc;
    return 0;
}

CB_BLOCKSCALED_LOAD(cb_fp8, cb_fp8matrix)
