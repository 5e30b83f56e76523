#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image_ops.h"
#include "kernels.h"


char g_err[512];
cb_st_index g_idx;
int g_int8;      /* int8=1: the stage's matrices quantized per row at load (the VAE is always f32) */

const char *arg_str(const args_t *a, const char *key) {
    for (int i = 0; i < a->n; i++)
        if (!strcmp(a->key[i], key)) return a->val[i];
    return NULL;
}

int arg_int(const args_t *a, const char *key, int *out) {
    const char *v = arg_str(a, key);
    if (!v) { snprintf(g_err, sizeof g_err, "missing argument %s=", key); return -1; }
    *out = atoi(v);
    return 0;
}

int arg_int_or(const args_t *a, const char *key, int fallback) {
    const char *v = arg_str(a, key);
    return v ? atoi(v) : fallback;
}

int arg_float(const args_t *a, const char *key, float *out) {
    const char *v = arg_str(a, key);
    if (!v) { snprintf(g_err, sizeof g_err, "missing argument %s=", key); return -1; }
    *out = strtof(v, NULL);
    return 0;
}

/* ------------------------------------------------------------------------------------------- stdin / stdout */

int read_all(void *dst, size_t n) {
    return fread(dst, 1, n, stdin) == n ? 0 : -1;
}

int write_all(const void *src, size_t n) {
    return fwrite(src, 1, n, stdout) == n ? 0 : -1;
}

int read_i32(int32_t *v) { return read_all(v, 4); }

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
static int quantize_linear(linear_t *l) {
    size_t rows = (size_t)l->rows, cols = (size_t)l->cols;
    uint8_t *buf = malloc(rows * cols + rows * 2);
    float *row = malloc(cols * sizeof(float));
    if (!buf || !row) { free(buf); free(row); snprintf(g_err, sizeof g_err, "out of memory quantizing"); return -1; }
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

const cb_tensor *find(const char *name) {
    const cb_tensor *t = cb_st_find(&g_idx, name);
    if (!t) snprintf(g_err, sizeof g_err, "tensor %s not found", name);
    else if (!t->supported) { snprintf(g_err, sizeof g_err, "tensor %s: dtype %s not supported", name,
                                       t->dtype_name); t = NULL; }
    return t;
}

static size_t numel(const cb_tensor *t) {
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

/* The tensor as f32, checked to hold `expect` elements (0: any). */
float *load_f32(const char *name, size_t expect) {
    const cb_tensor *t = find(name);
    if (!t) return NULL;
    size_t n = numel(t);
    if (expect && n != expect) {
        snprintf(g_err, sizeof g_err, "tensor %s: %zu elements, expected %zu", name, n, expect);
        return NULL;
    }
    void *raw = cb_st_load(&g_idx, t, g_err, sizeof g_err);
    if (!raw) return NULL;
    if (t->dtype == CB_F32) return raw;
    float *out = malloc(n * sizeof(float));
    if (out) cb_convert_to_f32(out, raw, t->dtype, n);
    else snprintf(g_err, sizeof g_err, "out of memory loading %s", name);
    free(raw);
    return out;
}

/* A [rows, cols] matrix by name, NULL with a message naming it when missing or of another shape. */
const cb_tensor *find_matrix(const char *name, int rows, int cols) {
    const cb_tensor *t = find(name);
    if (t && (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)) {
        snprintf(g_err, sizeof g_err, "tensor %s: shape differs from [%d, %d]", name, rows, cols);
        return NULL;
    }
    return t;
}

int load_linear(linear_t *l, const char *prefix, int rows, int cols, int bias) {
    char name[256];
    snprintf(name, sizeof name, "%s.weight", prefix);
    const cb_tensor *t = find_matrix(name, rows, cols);
    if (!t) return -1;
    l->w = cb_st_load(&g_idx, t, g_err, sizeof g_err);
    if (!l->w) return -1;
    l->dt = t->dtype;
    l->rows = rows;
    l->cols = cols;
    l->b = NULL;
    l->quantized = 0;
    if (g_int8 && quantize_linear(l)) return -1;
    if (bias) {
        snprintf(name, sizeof name, "%s.bias", prefix);
        if (!(l->b = load_f32(name, (size_t)rows))) return -1;
    }
    return 0;
}

void free_linear(linear_t *l) {
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

jmp_buf g_oom;

void oom(size_t bytes) {
    snprintf(g_err, sizeof g_err, "out of memory allocating %zu bytes", bytes);
    longjmp(g_oom, 1);
}

void *xalloc(size_t n) {
    void *p = calloc(n ? n : 1, 1);
    if (!p) oom(n);
    return p;
}


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

void attention(float *out, const float *q, const float *k, const float *v, int nq, int nk, int heads,
                      int kv_heads, int dim, size_t q_stride, size_t kv_stride, int causal) {
    attn_job_t j = {out, q, k, v, nq, nk, dim, heads, heads / kv_heads, causal, 0, q_stride, kv_stride, kv_stride,
                    q_stride};
    cb_parallel_for(heads * ((nq + ATTN_ROWS - 1) / ATTN_ROWS), attn_task, &j);
    if (j.failed) oom(sizeof(float) * (size_t)nk);
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
void rope_section(float *out, int pos, int dim) {
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

/* One step request of a transformer session (cmd 1, which text, timestep, the latents): 1 read, 0 the end of the
 * session (end of input or another command), -1 a short or bad request. */
int read_step(int ntext, size_t floats, float *lat, int32_t *which, float *timestep) {
    int32_t cmd;
    if (read_i32(&cmd) || cmd != 1) return 0;
    if (read_i32(which) || *which < 0 || *which >= ntext || read_all(timestep, 4) ||
        read_all(lat, sizeof(float) * floats)) {
        snprintf(g_err, sizeof g_err, "short step request");
        return -1;
    }
    return 1;
}

/* A causal conv3d on the first frame: the past frames are zero padding, so only the kernel's last time slice
 * meets the frame: a 2-D conv. Weights [out, in, kt, kh, kw] -> the slice [out, in, kh, kw]; three_d=0 reads
 * plain [out, in, kh, kw] weights (2.1 stores its convolutions 2-D). */

int load_conv(conv_t *c, const char *prefix, int cin, int cout, int three_d) {
    char name[256];
    snprintf(name, sizeof name, "%s.weight", prefix);
    const cb_tensor *t = find(name);
    if (!t) return -1;
    int k = (int)t->shape[t->ndim - 1];
    int kt = three_d ? (int)t->shape[2] : 1;
    if (t->ndim != (three_d ? 5 : 4) || t->shape[0] != cout || t->shape[1] != cin) {
        snprintf(g_err, sizeof g_err, "tensor %s: shape differs from [%d, %d, ...]", name, cout, cin);
        return -1;
    }
    float *all = load_f32(name, 0);
    if (!all) return -1;
    c->cin = cin; c->cout = cout; c->k = k;
    c->w = FALLOC((size_t)cout * cin * k * k);
    for (size_t oc = 0; oc < (size_t)cout * cin; oc++)
        memcpy(c->w + oc * k * k, all + (oc * kt + (kt - 1)) * k * k, sizeof(float) * k * k);
    free(all);
    snprintf(name, sizeof name, "%s.bias", prefix);
    return (c->b = load_f32(name, (size_t)cout)) ? 0 : -1;
}

void free_conv(conv_t *c) {
    free(c->w);
    free(c->b);
}

/* y[cout, h, w] = conv(x[cin, h, w]), zero padding k/2: im2col over a chunk of pixels at a time (bounded scratch
 * whatever the image size), then one cb_matmul of the weights [cout, cin*k*k] with the chunk's columns. */
void conv(const conv_t *c, float *y, const float *x, int h, int w) {
    int k = c->k, pad = k / 2, K = c->cin * k * k, hw = h * w;
    int chunk = (1 << 22) / K > 0 ? (1 << 22) / K : 1;
    if (chunk > hw) chunk = hw;
    float *col = FALLOC((size_t)chunk * K), *out = FALLOC((size_t)chunk * c->cout);
    for (int p0 = 0; p0 < hw; p0 += chunk) {
        int n = hw - p0 < chunk ? hw - p0 : chunk;
        for (int i = 0; i < n; i++) {
            int yy = (p0 + i) / w, xx = (p0 + i) % w;
            float *row = col + (size_t)i * K;
            for (int ci = 0; ci < c->cin; ci++)
                for (int dy = 0; dy < k; dy++)
                    for (int dx = 0; dx < k; dx++) {
                        int sy = yy + dy - pad, sx = xx + dx - pad;
                        row[(ci * k + dy) * k + dx] = sy < 0 || sy >= h || sx < 0 || sx >= w ? 0.0f
                                                      : x[((size_t)ci * h + sy) * w + sx];
                    }
        }
        cb_matmul(out, c->w, CB_F32, col, n, c->cout, K);
        for (int i = 0; i < n; i++)
            for (int o = 0; o < c->cout; o++) y[(size_t)o * hw + p0 + i] = out[(size_t)i * c->cout + o] + c->b[o];
    }
    free(col);
    free(out);
}

/* QwenImageRMS_norm over channels: x / max(||x||, 1e-12) * sqrt(C) * gamma, optionally then SiLU. */
void rms_channels(float *x, int C, int hw, const float *gamma, int silu) {
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


int load_res(resblock_t *r, const char *p, int cin, int cout, int three_d) {
    char name[256];
    r->cin = cin; r->cout = cout;
    snprintf(name, sizeof name, "%s.norm1.gamma", p);
    if (!(r->g1 = load_f32(name, (size_t)cin))) return -1;
    snprintf(name, sizeof name, "%s.norm2.gamma", p);
    if (!(r->g2 = load_f32(name, (size_t)cout))) return -1;
    snprintf(name, sizeof name, "%s.conv1", p);
    if (load_conv(&r->c1, name, cin, cout, three_d)) return -1;
    snprintf(name, sizeof name, "%s.conv2", p);
    if (load_conv(&r->c2, name, cout, cout, three_d)) return -1;
    r->has_sc = cin != cout;
    snprintf(name, sizeof name, "%s.conv_shortcut", p);
    return r->has_sc ? load_conv(&r->sc, name, cin, cout, three_d) : 0;
}

void free_res(resblock_t *r) {
    free(r->g1); free(r->g2);
    free_conv(&r->c1); free_conv(&r->c2);
    if (r->has_sc) free_conv(&r->sc);
}

/* x[cin, hw] -> returns new buffer [cout, hw] */
float *res_forward(const resblock_t *r, float *x, int h, int w) {
    size_t hw = (size_t)h * w;
    float *hbuf = FALLOC(r->cout * hw);
    if (r->has_sc) conv(&r->sc, hbuf, x, h, w);
    else memcpy(hbuf, x, sizeof(float) * r->cin * hw);
    rms_channels(x, r->cin, (int)hw, r->g1, 1);
    float *t = FALLOC(r->cout * hw), *u = FALLOC(r->cout * hw);
    conv(&r->c1, t, x, h, w);
    rms_channels(t, r->cout, (int)hw, r->g2, 1);
    conv(&r->c2, u, t, h, w);
    for (size_t i = 0; i < r->cout * hw; i++) u[i] += hbuf[i];
    free(hbuf); free(t); free(x);
    return u;
}


float *vattn_forward(const vattn_t *a, float *x, int h, int w) {
    int C = a->C, n = h * w;
    float *t = FALLOC((size_t)C * n), *qkv = FALLOC((size_t)3 * C * n), *o = FALLOC((size_t)C * n);
    memcpy(t, x, sizeof(float) * (size_t)C * n);
    rms_channels(t, C, n, a->gamma, 0);
    conv(&a->qkv, qkv, t, h, w);
    /* channel-major [3C, n] to token-major q, k, v [n, C] */
    float *tq = FALLOC((size_t)3 * C * n), *to = FALLOC((size_t)C * n);
    for (int c = 0; c < 3 * C; c++)
        for (int p = 0; p < n; p++) tq[(size_t)(c / C) * C * n + (size_t)p * C + (c % C)] = qkv[(size_t)c * n + p];
    attention(to, tq, tq + (size_t)C * n, tq + (size_t)2 * C * n, n, n, 1, 1, C, C, C, 0);
    for (int p = 0; p < n; p++)
        for (int c = 0; c < C; c++) t[(size_t)c * n + p] = to[(size_t)p * C + c];
    conv(&a->proj, o, t, h, w);
    for (size_t i = 0; i < (size_t)C * n; i++) o[i] += x[i];
    free(t); free(qkv); free(tq); free(to); free(x);
    return o;
}

/* nearest-exact x2 of y [C, h, w] (freed) */
float *upsample2x(float *y, int C, int h, int w) {
    int H2 = 2 * h, W2 = 2 * w;
    float *big = FALLOC((size_t)C * H2 * W2);
    for (int c = 0; c < C; c++)
        for (int yy = 0; yy < H2; yy++)
            for (int xx = 0; xx < W2; xx++)
                big[((size_t)c * H2 + yy) * W2 + xx] = y[((size_t)c * h + yy / 2) * w + xx / 2];
    free(y);
    return big;
}

int vae_frame_load(vae_frame_t *v, const args_t *a, int three_d, int out_rows) {
    int base, mult[8];
    if (arg_int(a, "base_dim", &base) || arg_int(a, "z_dim", &v->z) || arg_int(a, "num_res_blocks", &v->nres) ||
        arg_int(a, "levels", &v->levels))
        return -1;
    if (v->levels < 1 || v->levels > 8) { snprintf(g_err, sizeof g_err, "levels=%d out of range", v->levels);
                                          return -1; }
    for (int i = 0; i < v->levels; i++) {
        char key[32];
        snprintf(key, sizeof key, "mult%d", i);
        if (arg_int(a, key, &mult[i])) return -1;
    }
    int *dims = v->dims, z = v->z, top = v->levels;
    dims[0] = base * mult[top - 1];
    for (int i = 0; i < top; i++) dims[i + 1] = base * mult[top - 1 - i];
    if (load_conv(&v->pq, "post_quant_conv", z, z, three_d) ||
        load_conv(&v->cin, "decoder.conv_in", z, dims[0], three_d) ||
        load_res(&v->mid0, "decoder.mid_block.resnets.0", dims[0], dims[0], three_d) ||
        load_res(&v->mid1, "decoder.mid_block.resnets.1", dims[0], dims[0], three_d))
        return -1;
    v->attn.C = dims[0];
    if (!(v->attn.gamma = load_f32("decoder.mid_block.attentions.0.norm.gamma", (size_t)dims[0])) ||
        load_conv(&v->attn.qkv, "decoder.mid_block.attentions.0.to_qkv", dims[0], 3 * dims[0], 0) ||
        load_conv(&v->attn.proj, "decoder.mid_block.attentions.0.proj", dims[0], dims[0], 0))
        return -1;
    if (!(v->gout = load_f32("decoder.norm_out.gamma", (size_t)dims[top]))) return -1;
    return load_conv(&v->cout, "decoder.conv_out", dims[top], out_rows, three_d);
}

/* The next request (latent h, w, then z x h x w floats) through the front: 1 with y [dims[0], h, w], 0 at the end
 * of input, -1 on a bad request. */
int vae_frame_next(const vae_frame_t *v, int32_t *h, int32_t *w, float **y) {
    if (read_i32(h) || read_i32(w)) return 0;
    if (*h <= 0 || *w <= 0 || *h > 1024 || *w > 1024) { snprintf(g_err, sizeof g_err, "bad latent size"); return -1; }
    size_t hw = (size_t)*h * *w;
    float *zin = FALLOC((size_t)v->z * hw), *x = FALLOC((size_t)v->z * hw);
    if (read_all(zin, sizeof(float) * (size_t)v->z * hw)) {
        snprintf(g_err, sizeof g_err, "short latents");
        free(zin); free(x);
        return -1;
    }
    conv(&v->pq, x, zin, *h, *w);
    float *out = FALLOC((size_t)v->dims[0] * hw);
    conv(&v->cin, out, x, *h, *w);
    free(x); free(zin);
    out = res_forward(&v->mid0, out, *h, *w);
    out = vattn_forward(&v->attn, out, *h, *w);
    *y = res_forward(&v->mid1, out, *h, *w);
    return 1;
}

/* norm_out, SiLU, conv_out, clamped to [-1, 1]: a new [cout rows, h, w] buffer (y is freed). */
float *vae_frame_tail(const vae_frame_t *v, float *y, int h, int w) {
    size_t n = (size_t)v->cout.cout * h * w;
    rms_channels(y, v->dims[v->levels], h * w, v->gout, 1);
    float *img = FALLOC(n);
    conv(&v->cout, img, y, h, w);
    free(y);
    for (size_t i = 0; i < n; i++) img[i] = img[i] < -1.0f ? -1.0f : img[i] > 1.0f ? 1.0f : img[i];
    return img;
}

void vae_frame_free(vae_frame_t *v) {
    conv_t *convs[] = {&v->pq, &v->cin, &v->cout, &v->attn.qkv, &v->attn.proj};
    for (size_t i = 0; i < sizeof convs / sizeof *convs; i++) free_conv(convs[i]);
    free_res(&v->mid0);
    free_res(&v->mid1);
    free(v->gout);
    free(v->attn.gamma);
}

/* The stage's own high-water RSS (VmHWM, which starts afresh at exec, unlike getrusage's maxrss that inherits the
 * launching process's peak), for the pipeline's peak-RSS report. */
void report_peak_rss(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) fprintf(stderr, "peak_rss_kib=%ld\n", strtol(line + 6, NULL, 10));
    fclose(f);
}
