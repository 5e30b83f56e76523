#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image_ops.h"
#include "kernels.h"

/* ------------------------------------------------------------------------------------ context and errors */

int img_fail(img_ctx *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return -1;
}

void *img_alloc(img_ctx *c, size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    if (!p) img_fail(c, "out of memory allocating %zu bytes", bytes);
    return p;
}

float *img_floats(img_ctx *c, size_t n) { return img_alloc(c, n * sizeof(float)); }

void *img_keep(img_ctx *c, img_bufs *b, size_t bytes) {
    if (b->n == IMG_MAX_BUFS) { img_fail(c, "more than %d session buffers", IMG_MAX_BUFS); return NULL; }
    void *p = img_alloc(c, bytes);
    if (p) b->p[b->n++] = p;
    return p;
}

float *img_buf(img_ctx *c, img_bufs *b, size_t floats) { return img_keep(c, b, floats * sizeof(float)); }

void img_bufs_free(img_bufs *b) {
    while (b->n) free(b->p[--b->n]);
}

int img_hparams(img_ctx *c, const cb_hp_spec *table, void *dst) {
    return cb_hp_read(&c->hp, table, dst, c->err, sizeof c->err);
}

/* ------------------------------------------------------------------------------------------- stdin / stdout */

int read_all(void *dst, size_t n) {
    return fread(dst, 1, n, stdin) == n ? 0 : -1;
}

int img_reply(img_ctx *c, const int32_t *hdr, int hdr_ints, const float *data, size_t floats) {
    size_t n = (size_t)hdr_ints;
    if ((n && fwrite(hdr, sizeof *hdr, n, stdout) != n) || fwrite(data, sizeof *data, floats, stdout) != floats ||
        fflush(stdout))
        return img_fail(c, "writing the answer to stdout failed");
    return 0;
}

int read_i32(int32_t *v) { return read_all(v, 4); }

int read_step(img_ctx *c, int ntext, size_t floats, float *lat, int32_t *which, float *timestep) {
    int32_t cmd;
    if (read_i32(&cmd) || cmd != 1) return 0;
    if (read_i32(which) || *which < 0 || *which >= ntext || read_all(timestep, 4) ||
        read_all(lat, sizeof(float) * floats))
        return img_fail(c, "short step request");
    return 1;
}

/* ------------------------------------------------------------------------------------------------ weights */

/* IEEE half from float, round to nearest even (the scales' storage, as colibri-quant containers keep them). */
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag >= 0x47800000u) return (uint16_t)(sign | (mag > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (mag < 0x38800000u) {   /* subnormal half */
        float a = fabsf(f) * 16777216.0f;   /* 2^24: units of the smallest subnormal */
        return (uint16_t)(sign | (uint16_t)nearbyintf(a));
    }
    uint32_t rounded = mag + 0x0fffu + ((mag >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

/* Replace a float matrix by int8 levels per row with one F16 scale (absmax / 127), as int8-row containers. */
static int quantize_linear(img_ctx *c, linear_t *l) {
    size_t rows = (size_t)l->rows, cols = (size_t)l->cols;
    uint8_t *buf = malloc(rows * cols + rows * 2);
    float *row = malloc(cols * sizeof(float));
    if (!buf || !row) { free(buf); free(row); return img_fail(c, "out of memory quantizing"); }
    int8_t *levels = (int8_t *)buf;
    uint16_t *scales = (uint16_t *)(buf + rows * cols);
    size_t esz = cb_dtype_size(l->dt);
    for (size_t r = 0; r < rows; r++) {
        cb_convert_to_f32(row, (const char *)l->w + r * cols * esz, l->dt, cols);
        float amax = 0.0f;
        for (size_t c = 0; c < cols; c++) amax = fabsf(row[c]) > amax ? fabsf(row[c]) : amax;
        uint16_t h = f32_to_f16(amax / 127.0f);
        float s = cb_f16_to_f32(h);
        memcpy(&scales[r], &h, 2);
        for (size_t c = 0; c < cols; c++) {
            float v = s > 0.0f ? nearbyintf(row[c] / s) : 0.0f;
            levels[r * cols + c] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
    }
    free(row);
    free((void *)l->w);
    l->w = buf;
    l->quantized = 1;
    l->q.scheme = CB_Q8_ROW;
    l->q.rows = l->rows;
    l->q.cols = l->cols;
    l->q.q = levels;
    l->q.scales = scales;
    return 0;
}

#define NAME_LEN 320

/* out = prefix + leaf (".weight", ".bias"): 0, or -1 when it does not fit. */
static int leaf(img_ctx *c, char out[NAME_LEN], const char *prefix, const char *leaf_name) {
    return snprintf(out, NAME_LEN, "%s%s", prefix, leaf_name) < NAME_LEN ? 0 : img_fail(c, "tensor %s: name too long",
                                                                                        prefix);
}

static const cb_tensor *find(img_ctx *c, const char *name) {
    const cb_tensor *t = cb_st_find(&c->idx, name);
    if (!t) img_fail(c, "tensor %s not found", name);
    else if (!t->supported) { img_fail(c, "tensor %s: dtype %s not supported", name, t->dtype_name); t = NULL; }
    return t;
}

static size_t numel(const cb_tensor *t) {
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

/* The tensor as f32, checked to hold `expect` elements (0: any). */
static float *load_f32(img_ctx *c, const char *name, size_t expect) {
    const cb_tensor *t = find(c, name);
    if (!t) return NULL;
    size_t n = numel(t);
    if (expect && n != expect) { img_fail(c, "tensor %s: %zu elements, expected %zu", name, n, expect); return NULL; }
    void *raw = cb_st_load(&c->idx, t, c->err, sizeof c->err);
    if (!raw) return NULL;
    if (t->dtype == CB_F32) return raw;
    float *out = malloc(n * sizeof(float));
    if (out) cb_convert_to_f32(out, raw, t->dtype, n);
    else img_fail(c, "out of memory loading %s", name);
    free(raw);
    return out;
}

/* A [rows, cols] matrix by name, NULL with a message naming it when missing or of another shape. */
static const cb_tensor *find_matrix(img_ctx *c, const char *name, int rows, int cols) {
    const cb_tensor *t = find(c, name);
    if (t && (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)) {
        img_fail(c, "tensor %s: shape differs from [%d, %d]", name, rows, cols);
        return NULL;
    }
    return t;
}

static int load_linear(img_ctx *c, linear_t *l, const char *prefix, int rows, int cols, int bias) {
    char name[NAME_LEN];
    const cb_tensor *t = leaf(c, name, prefix, ".weight") ? NULL : find_matrix(c, name, rows, cols);
    if (!t) return -1;
    l->w = cb_st_load(&c->idx, t, c->err, sizeof c->err);
    if (!l->w) return -1;
    l->dt = t->dtype;
    l->rows = rows;
    l->cols = cols;
    l->b = NULL;
    l->quantized = 0;
    if (c->int8 && quantize_linear(c, l)) return -1;
    if (bias && (leaf(c, name, prefix, ".bias") || !(l->b = load_f32(c, name, (size_t)rows)))) return -1;
    return 0;
}

static void free_linear(linear_t *l) {
    free((void *)l->w);
    free(l->b);
}

/* Y[n, rows] = X[n, cols] W^T + b */
void linear(const linear_t *l, float *Y, const float *X, int n) {
    if (l->quantized) cb_qlinear_apply(&l->q, Y, X, n);
    else cb_matmul(Y, l->w, l->dt, X, n, l->rows, l->cols);
    if (l->b)
        for (int i = 0; i < n; i++)
            for (int r = 0; r < l->rows; r++) Y[(size_t)i * l->rows + r] += l->b[r];
}

/* A causal conv3d on the first frame: the past frames are zero padding, so only the kernel's last time slice
 * meets the frame: a 2-D conv. Weights [out, in, kt, kh, kw] -> the slice [out, in, kh, kw]; causal=0 reads
 * plain [out, in, kh, kw] weights (2.1 stores its convolutions 2-D). */
static int load_conv(img_ctx *c, conv_t *cv, const char *prefix, int cin, int cout, int causal) {
    char name[NAME_LEN];
    const cb_tensor *t = leaf(c, name, prefix, ".weight") ? NULL : find(c, name);
    if (!t) return -1;
    int k = (int)t->shape[t->ndim - 1];
    int kt = causal ? (int)t->shape[2] : 1;
    if (t->ndim != (causal ? 5 : 4) || t->shape[0] != cout || t->shape[1] != cin)
        return img_fail(c, "tensor %s: shape differs from [%d, %d, ...]", name, cout, cin);
    float *all = load_f32(c, name, 0);
    if (!all) return -1;
    cv->cin = cin; cv->cout = cout; cv->k = k;
    cv->w = img_floats(c, (size_t)cout * cin * k * k);
    if (!cv->w) { free(all); return -1; }
    for (size_t oc = 0; oc < (size_t)cout * cin; oc++)
        memcpy(cv->w + oc * k * k, all + (oc * kt + (kt - 1)) * k * k, sizeof(float) * k * k);
    free(all);
    return leaf(c, name, prefix, ".bias") || !(cv->b = load_f32(c, name, (size_t)cout)) ? -1 : 0;
}

static void free_conv(conv_t *cv) {
    free(cv->w);
    free(cv->b);
}

/* ------------------------------------------------------------------------------------------- tensor tables */

static const img_tensor_spec res_tensors[] = {
    IMG_VEC("norm1.gamma", resblock_t, g1, resblock_t, cin),
    IMG_VEC("norm2.gamma", resblock_t, g2, resblock_t, cout),
    IMG_CONV_OF("conv1", resblock_t, c1, resblock_t, cout, cin, offsetof(resblock_t, causal)),
    IMG_CONV_OF("conv2", resblock_t, c2, resblock_t, cout, cout, offsetof(resblock_t, causal)),
    IMG_CONV_IF("conv_shortcut", resblock_t, sc, resblock_t, cout, cin, offsetof(resblock_t, causal),
                offsetof(resblock_t, has_sc)),
    IMG_TENSORS_END,
};

static int field(const void *shape, size_t at) {
    return at == IMG_ALWAYS ? 1 : at == IMG_NEVER ? 0 : *(const int *)((const char *)shape + at);
}

static int load_res(img_ctx *c, resblock_t *r, const char *name, int cin, int cout, int causal) {
    char prefix[NAME_LEN];
    r->cin = cin; r->cout = cout; r->causal = causal; r->has_sc = cin != cout;
    return leaf(c, prefix, name, ".") || img_load(c, r, r, res_tensors, prefix, 0, 0) ? -1 : 0;
}

int img_load(img_ctx *c, void *dst, const void *shape, const img_tensor_spec *table, const char *prefix, int i,
             int j) {
    char name[NAME_LEN];
    size_t len = strlen(prefix);
    if (len >= NAME_LEN) return img_fail(c, "tensor prefix %.40s...: too long", prefix);
    memcpy(name, prefix, len);
    for (const img_tensor_spec *t = table; t->name; t++) {
        if (!field(shape, t->when)) continue;
        if (snprintf(name + len, NAME_LEN - len, t->name, i, j) >= (int)(NAME_LEN - len))
            return img_fail(c, "tensor %s: name too long", name);
        void *at = (char *)dst + t->at;
        int rows = field(shape, t->rows), cols = t->kind == IMG_VECTOR ? 0 : field(shape, t->cols);
        int flag = field(shape, t->flag), rc = 0;
        switch (t->kind) {
        case IMG_LINEAR: rc = load_linear(c, at, name, rows, cols, flag); break;
        case IMG_VECTOR: rc = (*(float **)at = load_f32(c, name, (size_t)rows)) ? 0 : -1; break;
        case IMG_MATRIX: rc = (*(const cb_tensor **)at = find_matrix(c, name, rows, cols)) ? 0 : -1; break;
        case IMG_CONV: rc = load_conv(c, at, name, cols, rows, flag); break;
        case IMG_RES: rc = load_res(c, at, name, cols, rows, flag); break;
        case IMG_RES_LIST: {
            int n = field(shape, t->count);
            resblock_t *list = img_alloc(c, sizeof(resblock_t) * (size_t)n);
            if (!(*(resblock_t **)at = list)) return -1;
            for (int k = 0; k < n && !rc; k++)
                rc = snprintf(name + len, NAME_LEN - len, t->name, i, k) >= (int)(NAME_LEN - len)
                         ? img_fail(c, "tensor %s: name too long", name)
                         : load_res(c, &list[k], name, k == 0 ? cols : rows, rows, flag);
            break;
        }
        }
        if (rc) return -1;
    }
    return 0;
}

static void free_res(resblock_t *r) { img_free(r, r, res_tensors); }

int img_load_layers(img_ctx *c, void *layers, const void *shape, const img_tensor_spec *table, const char *prefix,
                    int n, size_t size) {
    if (!layers) return -1;
    for (int l = 0; l < n; l++)
        if (img_load(c, (char *)layers + size * (size_t)l, shape, table, prefix, l, 0)) return -1;
    return 0;
}

void img_free_layers(void *layers, const void *shape, const img_tensor_spec *table, int n, size_t size) {
    for (int l = 0; layers && l < n; l++) img_free((char *)layers + size * (size_t)l, shape, table);
    free(layers);
}

void img_free(void *dst, const void *shape, const img_tensor_spec *table) {
    for (const img_tensor_spec *t = table; t->name; t++) {
        void *at = (char *)dst + t->at;
        switch (t->kind) {
        case IMG_LINEAR: free_linear(at); break;
        case IMG_VECTOR: free(*(float **)at); break;
        case IMG_MATRIX: break;
        case IMG_CONV: free_conv(at); break;
        case IMG_RES: free_res(at); break;
        case IMG_RES_LIST: {
            resblock_t *list = *(resblock_t **)at;
            for (int k = 0; list && k < field(shape, t->count); k++) free_res(&list[k]);
            free(list);
            break;
        }
        }
    }
}

/* ------------------------------------------------------------------------------------ transformer pieces */

/* Multi-head softmax attention, q: [nq][heads * dim] rows (stride q_stride), k/v: rows of kv heads (head h reads
 * kv head h / group), out like q. Tasks are (head, block of query rows), each independent of how they are spread
 * over threads, so the result does not depend on the thread count; dots go through cb_dot (same bits on every ISA). */
typedef struct {
    float *out;
    const float *q, *k, *v;
    int nq, nk, dim, heads, group, causal;
    int failed;        /* a task could not allocate its scores (read after the parallel region) */
    size_t q_stride, k_stride, v_stride, o_stride;
} attn_job_t;

#define ATTN_ROWS 16

static void attn_task(void *ctx, int task) {
    const attn_job_t *j = ctx;
    int blocks = (j->nq + ATTN_ROWS - 1) / ATTN_ROWS;
    int h = task / blocks, r0 = (task % blocks) * ATTN_ROWS, r1 = r0 + ATTN_ROWS < j->nq ? r0 + ATTN_ROWS : j->nq;
    int kh = h / j->group, dim = j->dim;
    float scale = 1.0f / sqrtf((float)dim);
    float *scores = malloc(sizeof(float) * (size_t)j->nk);
    if (!scores) { ((attn_job_t *)ctx)->failed = 1; return; }
    for (int i = r0; i < r1; i++) {
        int upto = j->causal ? i + 1 : j->nk;
        const float *qi = j->q + (size_t)i * j->q_stride + (size_t)h * dim;
        for (int t = 0; t < upto; t++)
            scores[t] = cb_dot(j->k + (size_t)t * j->k_stride + (size_t)kh * dim, CB_F32, qi, dim) * scale;
        cb_softmax(scores, upto);
        float *oi = j->out + (size_t)i * j->o_stride + (size_t)h * dim;
        for (int d = 0; d < dim; d++) oi[d] = 0.0f;
        for (int t = 0; t < upto; t++) {
            const float *vt = j->v + (size_t)t * j->v_stride + (size_t)kh * dim;
            for (int d = 0; d < dim; d++) oi[d] += scores[t] * vt[d];
        }
    }
    free(scores);
}

int attention(img_ctx *c, float *out, const float *q, const float *k, const float *v, int nq, int nk, int heads,
              int kv_heads, int dim, size_t q_stride, size_t kv_stride, int causal) {
    attn_job_t j = {out, q, k, v, nq, nk, dim, heads, heads / kv_heads, causal, 0, q_stride, kv_stride, kv_stride,
                    q_stride};
    cb_parallel_for(heads * ((nq + ATTN_ROWS - 1) / ATTN_ROWS), attn_task, &j);
    return j.failed ? img_fail(c, "out of memory allocating %zu bytes", sizeof(float) * (size_t)nk) : 0;
}

/* LayerNorm without affine, then x * (1 + scale) + shift. */
void norm_modulate(float *out, const float *x, int n, int D, const float *shift, const float *scale, float eps) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * D;
        float *oi = out + (size_t)i * D;
        float mean = 0.0f, var = 0.0f;
        for (int d = 0; d < D; d++) mean += xi[d];
        mean /= (float)D;
        for (int d = 0; d < D; d++) var += (xi[d] - mean) * (xi[d] - mean);
        var /= (float)D;
        float r = 1.0f / sqrtf(var + eps);
        for (int d = 0; d < D; d++) oi[d] = (xi[d] - mean) * r * (1.0f + scale[d]) + shift[d];
    }
}

float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* RMSNorm per head then complex rotation of pairs (2i, 2i+1) by cs[pos] (cos, sin interleaved). */
void qk_norm_rope(float *x, int n, int heads, int hd, const float *w, const float *cs, float eps) {
    for (int i = 0; i < n; i++)
        for (int h = 0; h < heads; h++) {
            float *v = x + ((size_t)i * heads + h) * hd;
            float ss = 0.0f;
            for (int d = 0; d < hd; d++) ss += v[d] * v[d];
            float r = 1.0f / sqrtf(ss / (float)hd + eps);
            for (int d = 0; d < hd; d++) v[d] = v[d] * r * w[d];
            const float *c = cs + (size_t)i * hd;
            for (int p = 0; p < hd / 2; p++) {
                float re = v[2 * p], im = v[2 * p + 1], co = c[2 * p], si = c[2 * p + 1];
                v[2 * p] = re * co - im * si;
                v[2 * p + 1] = re * si + im * co;
            }
        }
}

/* The rotation of one position for one axis section: angles pos / theta^(2j/dim), as QwenEmbedRope's tables. */
static void rope_section(float *out, int pos, int dim) {
    for (int j = 0; j < dim / 2; j++) {
        float inv = 1.0f / powf(10000.0f, (float)(2 * j) / (float)dim);
        float ang = (float)pos * inv;
        out[2 * j] = cosf(ang);
        out[2 * j + 1] = sinf(ang);
    }
}

/* Rotations [n][sum(axes)] for text tokens at positions start, start + 1, ... on all three axes. */
void rope_text(float *cs, int n, int start, const int axes[3]) {
    int hd = axes[0] + axes[1] + axes[2];
    for (int i = 0; i < n; i++) {
        float *c = cs + (size_t)i * hd;
        rope_section(c, start + i, axes[0]);
        rope_section(c + axes[0], start + i, axes[1]);
        rope_section(c + axes[0] + axes[1], start + i, axes[2]);
    }
}

/* Rotations [gh * gw][sum(axes)] for an image grid: the frame axis fixed, height and width centred on zero. */
void rope_image(float *cs, int gh, int gw, int frame, const int axes[3]) {
    int hd = axes[0] + axes[1] + axes[2];
    for (int y = 0; y < gh; y++)
        for (int x = 0; x < gw; x++) {
            float *c = cs + ((size_t)y * gw + x) * hd;
            rope_section(c, frame, axes[0]);
            rope_section(c + axes[0], y - (gh - gh / 2), axes[1]);
            rope_section(c + axes[0] + axes[1], x - (gw - gw / 2), axes[2]);
        }
}

/* ------------------------------------------------------------------------------------------------ VAE pieces */

/* y[cout, h, w] = conv(x[cin, h, w]), zero padding k/2: im2col over a chunk of pixels at a time (bounded scratch
 * whatever the image size), then one cb_matmul of the weights [cout, cin*k*k] with the chunk's columns. */
int conv(img_ctx *c, const conv_t *cv, float *y, const float *x, int h, int w) {
    int k = cv->k, pad = k / 2, K = cv->cin * k * k, hw = h * w;
    int chunk = (1 << 22) / K > 0 ? (1 << 22) / K : 1;
    if (chunk > hw) chunk = hw;
    float *col = img_floats(c, (size_t)chunk * K), *out = col ? img_floats(c, (size_t)chunk * cv->cout) : NULL;
    if (!out) { free(col); return -1; }
    for (int p0 = 0; p0 < hw; p0 += chunk) {
        int n = hw - p0 < chunk ? hw - p0 : chunk;
        for (int i = 0; i < n; i++) {
            int yy = (p0 + i) / w, xx = (p0 + i) % w;
            float *row = col + (size_t)i * K;
            for (int ci = 0; ci < cv->cin; ci++)
                for (int dy = 0; dy < k; dy++)
                    for (int dx = 0; dx < k; dx++) {
                        int sy = yy + dy - pad, sx = xx + dx - pad;
                        row[(ci * k + dy) * k + dx] = sy < 0 || sy >= h || sx < 0 || sx >= w ? 0.0f
                                                      : x[((size_t)ci * h + sy) * w + sx];
                    }
        }
        cb_matmul(out, cv->w, CB_F32, col, n, cv->cout, K);
        for (int i = 0; i < n; i++)
            for (int o = 0; o < cv->cout; o++) y[(size_t)o * hw + p0 + i] = out[(size_t)i * cv->cout + o] + cv->b[o];
    }
    free(col);
    free(out);
    return 0;
}

/* QwenImageRMS_norm over channels: x / max(||x||, 1e-12) * sqrt(C) * gamma, optionally then SiLU. */
static void rms_channels(float *x, int C, int hw, const float *gamma, int silu) {
    float s = sqrtf((float)C);
    for (int p = 0; p < hw; p++) {
        float ss = 0.0f;
        for (int c = 0; c < C; c++) ss += x[(size_t)c * hw + p] * x[(size_t)c * hw + p];
        float nrm = sqrtf(ss);
        if (nrm < 1e-12f) nrm = 1e-12f;
        for (int c = 0; c < C; c++) {
            float v = x[(size_t)c * hw + p] / nrm * s * gamma[c];
            x[(size_t)c * hw + p] = silu ? v / (1.0f + expf(-v)) : v;
        }
    }
}

/* x[cin, hw] -> returns new buffer [cout, hw] */
float *res_forward(img_ctx *c, const resblock_t *r, float *x, int h, int w) {
    size_t hw = (size_t)h * w;
    img_bufs b = {0};
    float *hbuf = img_buf(c, &b, r->cout * hw), *t = hbuf ? img_buf(c, &b, r->cout * hw) : NULL;
    float *u = t ? img_floats(c, r->cout * hw) : NULL;
    int rc = !u;
    if (!rc && r->has_sc) rc = conv(c, &r->sc, hbuf, x, h, w);
    else if (!rc) memcpy(hbuf, x, sizeof(float) * r->cin * hw);
    if (!rc) {
        rms_channels(x, r->cin, (int)hw, r->g1, 1);
        rc = conv(c, &r->c1, t, x, h, w);
    }
    if (!rc) {
        rms_channels(t, r->cout, (int)hw, r->g2, 1);
        rc = conv(c, &r->c2, u, t, h, w);
    }
    if (!rc)
        for (size_t i = 0; i < r->cout * hw; i++) u[i] += hbuf[i];
    img_bufs_free(&b);
    free(x);
    if (rc) { free(u); return NULL; }
    return u;
}

static float *vattn_forward(img_ctx *c, const vattn_t *a, float *x, int h, int w) {
    int C = a->C, n = h * w;
    img_bufs b = {0};
    float *t = img_buf(c, &b, (size_t)C * n), *qkv = t ? img_buf(c, &b, (size_t)3 * C * n) : NULL;
    float *tq = qkv ? img_buf(c, &b, (size_t)3 * C * n) : NULL, *to = tq ? img_buf(c, &b, (size_t)C * n) : NULL;
    float *o = to ? img_floats(c, (size_t)C * n) : NULL;
    int rc = !o;
    if (!rc) {
        memcpy(t, x, sizeof(float) * (size_t)C * n);
        rms_channels(t, C, n, a->gamma, 0);
        rc = conv(c, &a->qkv, qkv, t, h, w);
    }
    if (!rc) {
        /* channel-major [3C, n] to token-major q, k, v [n, C] */
        for (int ch = 0; ch < 3 * C; ch++)
            for (int p = 0; p < n; p++)
                tq[(size_t)(ch / C) * C * n + (size_t)p * C + (ch % C)] = qkv[(size_t)ch * n + p];
        rc = attention(c, to, tq, tq + (size_t)C * n, tq + (size_t)2 * C * n, n, n, 1, 1, C, C, C, 0);
    }
    if (!rc) {
        for (int p = 0; p < n; p++)
            for (int ch = 0; ch < C; ch++) t[(size_t)ch * n + p] = to[(size_t)p * C + ch];
        rc = conv(c, &a->proj, o, t, h, w);
    }
    if (!rc)
        for (size_t i = 0; i < (size_t)C * n; i++) o[i] += x[i];
    img_bufs_free(&b);
    free(x);
    if (rc) { free(o); return NULL; }
    return o;
}

/* nearest-exact x2 of y [C, h, w] (freed) */
float *upsample2x(img_ctx *c, float *y, int C, int h, int w) {
    int H2 = 2 * h, W2 = 2 * w;
    float *big = img_floats(c, (size_t)C * H2 * W2);
    for (int ch = 0; big && ch < C; ch++)
        for (int yy = 0; yy < H2; yy++)
            for (int xx = 0; xx < W2; xx++)
                big[((size_t)ch * H2 + yy) * W2 + xx] = y[((size_t)ch * h + yy / 2) * w + xx / 2];
    free(y);
    return big;
}

const cb_hp_spec vae_frame_hparams[] = {
    CB_HP_REQ("base_dim", vae_frame_t, base),
    CB_HP_REQ("z_dim", vae_frame_t, z),
    {"num_res_blocks", CB_HP_INT, offsetof(vae_frame_t, nres), 0, CB_HP_NONNEG, NULL, 0},
    CB_HP_REQ("levels", vae_frame_t, levels),
    CB_HP_OPT("mult0", vae_frame_t, mult[0], 0, CB_HP_NONNEG),
    CB_HP_OPT("mult1", vae_frame_t, mult[1], 0, CB_HP_NONNEG),
    CB_HP_OPT("mult2", vae_frame_t, mult[2], 0, CB_HP_NONNEG),
    CB_HP_OPT("mult3", vae_frame_t, mult[3], 0, CB_HP_NONNEG),
    CB_HP_OPT("mult4", vae_frame_t, mult[4], 0, CB_HP_NONNEG),
    CB_HP_OPT("mult5", vae_frame_t, mult[5], 0, CB_HP_NONNEG),
    CB_HP_OPT("mult6", vae_frame_t, mult[6], 0, CB_HP_NONNEG),
    CB_HP_OPT("mult7", vae_frame_t, mult[7], 0, CB_HP_NONNEG),
    CB_HP_END,
};

static const img_tensor_spec vae_frame_tensors[] = {
    IMG_CONV_OF("post_quant_conv", vae_frame_t, pq, vae_frame_t, z, z, offsetof(vae_frame_t, causal)),
    IMG_CONV_OF("decoder.conv_in", vae_frame_t, cin, vae_frame_t, dims[0], z, offsetof(vae_frame_t, causal)),
    IMG_RES_OF("decoder.mid_block.resnets.0", vae_frame_t, mid0, vae_frame_t, dims[0], dims[0],
               offsetof(vae_frame_t, causal)),
    IMG_RES_OF("decoder.mid_block.resnets.1", vae_frame_t, mid1, vae_frame_t, dims[0], dims[0],
               offsetof(vae_frame_t, causal)),
    IMG_VEC("decoder.mid_block.attentions.0.norm.gamma", vae_frame_t, attn.gamma, vae_frame_t, dims[0]),
    IMG_CONV_OF("decoder.mid_block.attentions.0.to_qkv", vae_frame_t, attn.qkv, vae_frame_t, d0x3, dims[0],
                IMG_NEVER),
    IMG_CONV_OF("decoder.mid_block.attentions.0.proj", vae_frame_t, attn.proj, vae_frame_t, dims[0], dims[0],
                IMG_NEVER),
    IMG_VEC("decoder.norm_out.gamma", vae_frame_t, gout, vae_frame_t, top),
    IMG_CONV_OF("decoder.conv_out", vae_frame_t, cout, vae_frame_t, out_rows, top, offsetof(vae_frame_t, causal)),
    IMG_TENSORS_END,
};

int vae_frame_load(img_ctx *c, vae_frame_t *v, int causal, int out_rows, const img_tensor_spec *up_tensors, int halve,
                   const int *tup) {
    if (v->levels > 8) return img_fail(c, "levels=%d out of range", v->levels);
    int *dims = v->dims, top = v->levels;
    for (int i = 0; i < top; i++)
        if (v->mult[i] < 1) return img_fail(c, "missing argument mult%d= (levels=%d)", i, top);
    dims[0] = v->base * v->mult[top - 1];
    for (int i = 0; i < top; i++) dims[i + 1] = v->base * v->mult[top - 1 - i];
    v->d0x3 = 3 * dims[0];
    v->top = dims[top];
    v->out_rows = out_rows;
    v->causal = causal;
    v->attn.C = dims[0];
    v->up_tensors = up_tensors;
    if (img_load(c, v, v, vae_frame_tensors, "", 0, 0)) return -1;
    for (int i = 0; i < top; i++) {
        upblock_t *u = &v->U[i];
        u->in = i > 0 ? v->U[i - 1].up_out : dims[0];
        u->out = dims[i + 1];
        u->up = i != top - 1;
        u->up_out = halve ? u->out / 2 : u->out;
        u->ft = u->up && tup && tup[i] ? 2 : 1;
        u->nres1 = v->nres + 1;
        if (img_load(c, u, u, up_tensors, "", i, 0)) return -1;
    }
    return 0;
}

/* The next request (latent h, w, then z x h x w floats) through the front: 1 with y [dims[0], h, w], 0 at the end
 * of input, -1 on a bad request. */
int vae_frame_next(img_ctx *c, const vae_frame_t *v, int32_t *h, int32_t *w, float **y) {
    if (read_i32(h) || read_i32(w)) return 0;
    if (*h <= 0 || *w <= 0 || *h > 1024 || *w > 1024) return img_fail(c, "bad latent size");
    size_t hw = (size_t)*h * *w;
    img_bufs b = {0};
    float *zin = img_buf(c, &b, (size_t)v->z * hw), *x = zin ? img_buf(c, &b, (size_t)v->z * hw) : NULL;
    float *out = x ? img_floats(c, (size_t)v->dims[0] * hw) : NULL;
    int rc = !out ? -1 : read_all(zin, sizeof(float) * (size_t)v->z * hw) ? img_fail(c, "short latents") : 0;
    if (!rc) rc = conv(c, &v->pq, x, zin, *h, *w);
    if (!rc) rc = conv(c, &v->cin, out, x, *h, *w);
    img_bufs_free(&b);
    if (rc) { free(out); return -1; }
    if (!(out = res_forward(c, &v->mid0, out, *h, *w)) || !(out = vattn_forward(c, &v->attn, out, *h, *w)) ||
        !(*y = res_forward(c, &v->mid1, out, *h, *w)))
        return -1;
    return 1;
}

/* norm_out, SiLU, conv_out, clamped to [-1, 1]: a new [cout rows, h, w] buffer (y is freed). */
float *vae_frame_tail(img_ctx *c, const vae_frame_t *v, float *y, int h, int w) {
    size_t n = (size_t)v->cout.cout * h * w;
    rms_channels(y, v->dims[v->levels], h * w, v->gout, 1);
    float *img = img_floats(c, n);
    if (img && conv(c, &v->cout, img, y, h, w)) { free(img); img = NULL; }
    free(y);
    for (size_t i = 0; img && i < n; i++) img[i] = img[i] < -1.0f ? -1.0f : img[i] > 1.0f ? 1.0f : img[i];
    return img;
}

void vae_frame_free(vae_frame_t *v) {
    for (int i = 0; v->up_tensors && i < v->levels && i < 8; i++) img_free(&v->U[i], &v->U[i], v->up_tensors);
    img_free(v, v, vae_frame_tensors);
}

/* ------------------------------------------------------------------------------------------------------ main */

/* The stage's own high-water RSS (VmHWM, which starts afresh at exec, unlike getrusage's maxrss that inherits the
 * launching process's peak), for the pipeline's peak-RSS report. */
static void report_peak_rss(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) fprintf(stderr, "peak_rss_kib=%ld\n", strtol(line + 6, NULL, 10));
    fclose(f);
}

typedef struct {
    int threads, int8;
} img_opts;

static const cb_hp_spec opts_hparams[] = {
    CB_HP_OPT("threads", img_opts, threads, 0, CB_HP_NONNEG),
    CB_HP_FLAG("int8", img_opts, int8, 0),
    CB_HP_END,
};

/* Load and run the stage: 0, or -1 with c->err. */
static int run_stage(img_ctx *c, const img_stage *s, const char *dir) {
    img_opts o;
    if (img_hparams(c, opts_hparams, &o) || cb_st_open(&c->idx, dir, c->err, sizeof c->err)) return -1;
    c->int8 = o.int8 && !s->f32_only;
    cb_threads_init(o.threads);
    void *model = img_alloc(c, s->model_size);
    int rc = !model || img_hparams(c, s->hparams, model) || s->load_model(c, model) ? -1 : 0;
    if (!rc) {
        fputs("ready\n", stderr);
        rc = s->forward(c, model);
    }
    img_bufs_free(&c->session);
    if (model) s->free_model(model);
    free(model);
    cb_st_close(&c->idx);
    return rc;
}

int img_main(int argc, char **argv, const img_stage *const *stages) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s", argv[0]);
        for (int i = 0; stages[i]; i++) fprintf(stderr, "%s%s", i ? "|" : " ", stages[i]->name);
        fprintf(stderr, " COMPONENT_DIR [key=value...]\n");
        return 2;
    }
    img_ctx *c = calloc(1, sizeof *c);
    if (!c) { fputs("error: out of memory\n", stderr); return 1; }
    int status = 0;
    for (int i = 3; i < argc && !status; i++)
        if (!strchr(argv[i], '=')) {
            fprintf(stderr, "error: argument %s is not key=value\n", argv[i]);
            status = 2;
        } else if (cb_hp_add(&c->hp, argv[i], c->err, sizeof c->err)) {
            status = 1;
        }
    const img_stage *s = NULL;
    for (int i = 0; !status && stages[i] && !s; i++)
        if (!strcmp(stages[i]->name, argv[1])) s = stages[i];
    if (!status && !s) {
        img_fail(c, "unknown stage %s", argv[1]);
        status = 1;
    }
    if (!status && run_stage(c, s, argv[2])) status = 1;
    if (status == 1) fprintf(stderr, "error: %s\n", c->err);
    else if (!status) report_peak_rss();
    cb_hp_free(&c->hp);
    free(c);
    return status;
}
