/* qwen_image.c: the three stages of diffusers' QwenImagePipeline over the shared runtime, one stage per process.
 *
 *   colibri-qwen-image text DIR key=value...   Qwen2.5-VL language model: token ids in, last hidden states out
 *   colibri-qwen-image dit  DIR key=value...   QwenImageTransformer2DModel: (text, timestep, latents) -> velocity
 *   colibri-qwen-image vae  DIR key=value...   AutoencoderKLQwenImage decoder, one frame: latents -> pixels
 *
 * DIR is the component folder (text_encoder/, transformer/, vae/). The Python side (colibri_image.pipeline) runs the
 * scheduler, guidance and the prompt template, and starts one stage at a time, so only one component's weights are
 * ever resident. Messages on stdin/stdout are little-endian int32 headers followed by f32 arrays (pipeline.py's
 * StageProcess is the other end). Matrices stay in their stored dtype and go through cb_matmul, whose rows are
 * independent of the thread count, so the result never depends on --threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "qlinear.h"
#include "quant.h"
#include "safetensors.h"

#define MAX_ARGS 64

typedef struct {
    int n;
    const char *key[MAX_ARGS];
    const char *val[MAX_ARGS];
} args_t;

static char g_err[512];
static cb_st_index g_idx;
static int g_int8;      /* int8=1: the stage's matrices quantized per row at load (the VAE is always f32) */

static const char *arg_str(const args_t *a, const char *key) {
    for (int i = 0; i < a->n; i++)
        if (!strcmp(a->key[i], key)) return a->val[i];
    return NULL;
}

static int arg_int(const args_t *a, const char *key, int *out) {
    const char *v = arg_str(a, key);
    if (!v) { snprintf(g_err, sizeof g_err, "missing argument %s=", key); return -1; }
    *out = atoi(v);
    return 0;
}

static int arg_float(const args_t *a, const char *key, float *out) {
    const char *v = arg_str(a, key);
    if (!v) { snprintf(g_err, sizeof g_err, "missing argument %s=", key); return -1; }
    *out = strtof(v, NULL);
    return 0;
}

/* ------------------------------------------------------------------------------------------- stdin / stdout */

static int read_all(void *dst, size_t n) {
    return fread(dst, 1, n, stdin) == n ? 0 : -1;
}

static int write_all(const void *src, size_t n) {
    return fwrite(src, 1, n, stdout) == n ? 0 : -1;
}

static int read_i32(int32_t *v) { return read_all(v, 4); }

/* ------------------------------------------------------------------------------------------------ weights */

typedef struct {
    const void *w;     /* stored dtype, or (int8) the levels followed by the F16 scales */
    cb_dtype dt;
    int rows, cols;
    float *b;          /* bias (f32) or NULL */
    int quantized;
    cb_qmatrix q;
} linear_t;

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

static const cb_tensor *find(const char *name) {
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
static float *load_f32(const char *name, size_t expect) {
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
static const cb_tensor *find_matrix(const char *name, int rows, int cols) {
    const cb_tensor *t = find(name);
    if (t && (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)) {
        snprintf(g_err, sizeof g_err, "tensor %s: shape differs from [%d, %d]", name, rows, cols);
        return NULL;
    }
    return t;
}

static int load_linear(linear_t *l, const char *prefix, int rows, int cols, int bias) {
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

static void free_linear(linear_t *l) {
    free((void *)l->w);
    free(l->b);
}

/* Y[n, rows] = X[n, cols] W^T + b */
static void linear(const linear_t *l, float *Y, const float *X, int n) {
    if (l->quantized) cb_qlinear_apply(&l->q, Y, X, n);
    else cb_matmul(Y, l->w, l->dt, X, n, l->rows, l->cols);
    if (l->b)
        for (int i = 0; i < n; i++)
            for (int r = 0; r < l->rows; r++) Y[(size_t)i * l->rows + r] += l->b[r];
}

static void *xalloc(size_t n) {
    void *p = calloc(n ? n : 1, 1);
    if (!p) { fprintf(stderr, "error: out of memory (%zu bytes)\n", n); exit(3); }
    return p;
}

#define FALLOC(n) ((float *)xalloc((size_t)(n) * sizeof(float)))

/* Multi-head softmax attention, q: [nq][heads * dim] rows (stride q_stride), k/v: rows of kv heads (head h reads
 * kv head h / group), out like q. Tasks are (head, block of query rows), each independent of how they are spread
 * over threads, so the result does not depend on the thread count; dots go through cb_dot (same bits on every ISA). */
typedef struct {
    float *out;
    const float *q, *k, *v;
    int nq, nk, dim, heads, group, causal;
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
    if (!scores) { fprintf(stderr, "error: out of memory in attention\n"); exit(3); }
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

static void attention(float *out, const float *q, const float *k, const float *v, int nq, int nk, int heads,
                      int kv_heads, int dim, size_t q_stride, size_t kv_stride, int causal) {
    attn_job_t j = {out, q, k, v, nq, nk, dim, heads, heads / kv_heads, causal, q_stride, kv_stride, kv_stride,
                    q_stride};
    cb_parallel_for(heads * ((nq + ATTN_ROWS - 1) / ATTN_ROWS), attn_task, &j);
}

/* ===================================================================================== text: Qwen2.5-VL LM */

typedef struct {
    float *in_norm, *post_norm;
    linear_t q, k, v, o, gate, up, down;
} text_layer_t;

static int run_text(const args_t *a) {
    int layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    float theta, eps;
    const char *prefix = arg_str(a, "prefix");
    if (!prefix) prefix = "model.language_model.";
    if (arg_int(a, "layers", &layers) || arg_int(a, "hidden", &hidden) || arg_int(a, "heads", &heads) ||
        arg_int(a, "kv_heads", &kv_heads) || arg_int(a, "head_dim", &head_dim) || arg_int(a, "intermediate", &inter) ||
        arg_int(a, "vocab", &vocab) || arg_float(a, "rope_theta", &theta) || arg_float(a, "eps", &eps))
        return -1;
    char name[256];
    snprintf(name, sizeof name, "%sembed_tokens.weight", prefix);
    const cb_tensor *emb_t = find_matrix(name, vocab, hidden);
    if (!emb_t) return -1;
    text_layer_t *L = xalloc(sizeof(text_layer_t) * (size_t)layers);
    for (int l = 0; l < layers; l++) {
        char p[200];
#define TL(field, sub, r, c, b) \
        snprintf(p, sizeof p, "%slayers.%d.%s", prefix, l, sub); \
        if (load_linear(&L[l].field, p, r, c, b)) return -1;
        TL(q, "self_attn.q_proj", heads * head_dim, hidden, 1)
        TL(k, "self_attn.k_proj", kv_heads * head_dim, hidden, 1)
        TL(v, "self_attn.v_proj", kv_heads * head_dim, hidden, 1)
        TL(o, "self_attn.o_proj", hidden, heads * head_dim, 0)
        TL(gate, "mlp.gate_proj", inter, hidden, 0)
        TL(up, "mlp.up_proj", inter, hidden, 0)
        TL(down, "mlp.down_proj", hidden, inter, 0)
#undef TL
        snprintf(name, sizeof name, "%slayers.%d.input_layernorm.weight", prefix, l);
        if (!(L[l].in_norm = load_f32(name, (size_t)hidden))) return -1;
        snprintf(name, sizeof name, "%slayers.%d.post_attention_layernorm.weight", prefix, l);
        if (!(L[l].post_norm = load_f32(name, (size_t)hidden))) return -1;
    }
    snprintf(name, sizeof name, "%snorm.weight", prefix);
    float *final_norm = load_f32(name, (size_t)hidden);
    if (!final_norm) return -1;
    float *inv_freq = FALLOC(head_dim / 2);
    for (int i = 0; i < head_dim / 2; i++) inv_freq[i] = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);

    fputs("ready\n", stderr);
    int32_t n;
    while (read_i32(&n) == 0) {
        if (n <= 0 || n > (1 << 16)) { snprintf(g_err, sizeof g_err, "bad token count %d", n); return -1; }
        int32_t *ids = xalloc(sizeof(int32_t) * (size_t)n);
        if (read_all(ids, sizeof(int32_t) * (size_t)n)) { snprintf(g_err, sizeof g_err, "short input"); return -1; }
        size_t qd = (size_t)heads * head_dim, kvd = (size_t)kv_heads * head_dim;
        float *x = FALLOC((size_t)n * hidden), *h = FALLOC((size_t)n * hidden);
        float *q = FALLOC(n * qd), *k = FALLOC(n * kvd), *v = FALLOC(n * kvd), *att = FALLOC(n * qd);
        float *g = FALLOC((size_t)n * inter), *u = FALLOC((size_t)n * inter);
        size_t row_bytes = (size_t)hidden * cb_dtype_size(emb_t->dtype);
        void *row = xalloc(row_bytes);
        for (int i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= vocab) { snprintf(g_err, sizeof g_err, "token id %d out of range", ids[i]);
                                                 return -1; }
            if (cb_st_pread(&g_idx, emb_t->shard, row, row_bytes, emb_t->offset + (uint64_t)ids[i] * row_bytes,
                            g_err, sizeof g_err)) return -1;
            cb_convert_to_f32(x + (size_t)i * hidden, row, emb_t->dtype, (size_t)hidden);
        }
        for (int l = 0; l < layers; l++) {
            for (int i = 0; i < n; i++) cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, L[l].in_norm,
                                                   hidden, eps);
            linear(&L[l].q, q, h, n);
            linear(&L[l].k, k, h, n);
            linear(&L[l].v, v, h, n);
            for (int i = 0; i < n; i++) {
                /* text-only positions: M-RoPE's three sections all see position i, which is plain RoPE */
                cb_rope_neox(q + i * qd, heads, head_dim, head_dim, i, inv_freq);
                cb_rope_neox(k + i * kvd, kv_heads, head_dim, head_dim, i, inv_freq);
            }
            attention(att, q, k, v, n, n, heads, kv_heads, head_dim, qd, kvd, 1);
            linear(&L[l].o, h, att, n);
            for (size_t i = 0; i < (size_t)n * hidden; i++) x[i] += h[i];
            for (int i = 0; i < n; i++) cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, L[l].post_norm,
                                                   hidden, eps);
            linear(&L[l].gate, g, h, n);
            linear(&L[l].up, u, h, n);
            cb_silu_mul(g, u, n * inter);
            linear(&L[l].down, h, g, n);
            for (size_t i = 0; i < (size_t)n * hidden; i++) x[i] += h[i];
        }
        for (int i = 0; i < n; i++) cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, final_norm, hidden, eps);
        int32_t hdr[2] = {n, hidden};
        if (write_all(hdr, sizeof hdr) || write_all(h, sizeof(float) * (size_t)n * hidden)) return -1;
        fflush(stdout);
        free(ids); free(x); free(h); free(q); free(k); free(v); free(att); free(g); free(u); free(row);
    }
    for (int l = 0; l < layers; l++) {
        free_linear(&L[l].q); free_linear(&L[l].k); free_linear(&L[l].v); free_linear(&L[l].o);
        free_linear(&L[l].gate); free_linear(&L[l].up); free_linear(&L[l].down);
        free(L[l].in_norm); free(L[l].post_norm);
    }
    free(L); free(final_norm); free(inv_freq);
    return 0;
}

/* ============================================================================ dit: QwenImageTransformer2DModel */

typedef struct {
    linear_t img_mod, txt_mod, to_q, to_k, to_v, add_q, add_k, add_v, to_out, to_add_out;
    linear_t img_fc1, img_fc2, txt_fc1, txt_fc2;
    float *norm_q, *norm_k, *norm_added_q, *norm_added_k;
} dit_block_t;

typedef struct {
    int layers, dim, heads, head_dim, in_ch, out_ch, joint, axes[3];
    linear_t t1, t2, img_in, txt_in, norm_out, proj_out;
    float *txt_norm;
    dit_block_t *B;
} dit_t;

static int load_dit(dit_t *m, const args_t *a) {
    if (arg_int(a, "layers", &m->layers) || arg_int(a, "heads", &m->heads) || arg_int(a, "head_dim", &m->head_dim) ||
        arg_int(a, "in_channels", &m->in_ch) || arg_int(a, "out_channels", &m->out_ch) ||
        arg_int(a, "joint_dim", &m->joint) || arg_int(a, "axes0", &m->axes[0]) || arg_int(a, "axes1", &m->axes[1]) ||
        arg_int(a, "axes2", &m->axes[2]))
        return -1;
    int D = m->dim = m->heads * m->head_dim, F = 4 * D;
    if (m->axes[0] + m->axes[1] + m->axes[2] != m->head_dim) {
        snprintf(g_err, sizeof g_err, "axes_dims_rope must sum to attention_head_dim %d", m->head_dim);
        return -1;
    }
    if (load_linear(&m->t1, "time_text_embed.timestep_embedder.linear_1", D, 256, 1) ||
        load_linear(&m->t2, "time_text_embed.timestep_embedder.linear_2", D, D, 1) ||
        load_linear(&m->img_in, "img_in", D, m->in_ch, 1) || load_linear(&m->txt_in, "txt_in", D, m->joint, 1) ||
        load_linear(&m->norm_out, "norm_out.linear", 2 * D, D, 1) ||
        load_linear(&m->proj_out, "proj_out", 4 * m->out_ch, D, 1))
        return -1;
    if (!(m->txt_norm = load_f32("txt_norm.weight", (size_t)m->joint))) return -1;
    m->B = xalloc(sizeof(dit_block_t) * (size_t)m->layers);
    for (int l = 0; l < m->layers; l++) {
        dit_block_t *b = &m->B[l];
        char p[200];
#define BL(field, sub, r, c) \
        snprintf(p, sizeof p, "transformer_blocks.%d.%s", l, sub); \
        if (load_linear(&b->field, p, r, c, 1)) return -1;
        BL(img_mod, "img_mod.1", 6 * D, D) BL(txt_mod, "txt_mod.1", 6 * D, D)
        BL(to_q, "attn.to_q", D, D) BL(to_k, "attn.to_k", D, D) BL(to_v, "attn.to_v", D, D)
        BL(add_q, "attn.add_q_proj", D, D) BL(add_k, "attn.add_k_proj", D, D) BL(add_v, "attn.add_v_proj", D, D)
        BL(to_out, "attn.to_out.0", D, D) BL(to_add_out, "attn.to_add_out", D, D)
        BL(img_fc1, "img_mlp.net.0.proj", F, D) BL(img_fc2, "img_mlp.net.2", D, F)
        BL(txt_fc1, "txt_mlp.net.0.proj", F, D) BL(txt_fc2, "txt_mlp.net.2", D, F)
#undef BL
#define BN(field, sub) \
        snprintf(p, sizeof p, "transformer_blocks.%d.attn.%s.weight", l, sub); \
        if (!(b->field = load_f32(p, (size_t)m->head_dim))) return -1;
        BN(norm_q, "norm_q") BN(norm_k, "norm_k") BN(norm_added_q, "norm_added_q") BN(norm_added_k, "norm_added_k")
#undef BN
    }
    return 0;
}

static void free_dit(dit_t *m) {
    linear_t *top[] = {&m->t1, &m->t2, &m->img_in, &m->txt_in, &m->norm_out, &m->proj_out};
    for (size_t i = 0; i < sizeof top / sizeof *top; i++) free_linear(top[i]);
    for (int l = 0; l < m->layers; l++) {
        dit_block_t *b = &m->B[l];
        linear_t *ls[] = {&b->img_mod, &b->txt_mod, &b->to_q, &b->to_k, &b->to_v, &b->add_q, &b->add_k, &b->add_v,
                          &b->to_out, &b->to_add_out, &b->img_fc1, &b->img_fc2, &b->txt_fc1, &b->txt_fc2};
        for (size_t i = 0; i < sizeof ls / sizeof *ls; i++) free_linear(ls[i]);
        free(b->norm_q); free(b->norm_k); free(b->norm_added_q); free(b->norm_added_k);
    }
    free(m->B);
    free(m->txt_norm);
}

/* LayerNorm without affine (eps 1e-6), then x * (1 + scale) + shift. */
static void norm_modulate(float *out, const float *x, int n, int D, const float *shift, const float *scale) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * D;
        float *oi = out + (size_t)i * D;
        float mean = 0.0f, var = 0.0f;
        for (int d = 0; d < D; d++) mean += xi[d];
        mean /= (float)D;
        for (int d = 0; d < D; d++) var += (xi[d] - mean) * (xi[d] - mean);
        var /= (float)D;
        float r = 1.0f / sqrtf(var + 1e-6f);
        for (int d = 0; d < D; d++) oi[d] = (xi[d] - mean) * r * (1.0f + scale[d]) + shift[d];
    }
}

static float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* x[i] += gate * y[i] for n rows of D (the blocks' gated residuals). */
static void gated_add(float *x, const float *gate, const float *y, int n, int D) {
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d++) x[(size_t)i * D + d] += gate[d] * y[(size_t)i * D + d];
}

/* One stream's feed-forward: x += gate * fc2(gelu_tanh(fc1(norm(x) * (1 + scale) + shift))), with mod pointing
 * at that stream's (shift, scale, gate) for the second half of the block. */
static void feed_forward(float *x, int n, int D, int F, const float *mod, const linear_t *fc1, const linear_t *fc2,
                         float *nrm, float *ff, float *tmp) {
    norm_modulate(nrm, x, n, D, mod, mod + D);
    linear(fc1, ff, nrm, n);
    for (size_t i = 0; i < (size_t)n * F; i++) ff[i] = gelu_tanh(ff[i]);
    linear(fc2, tmp, ff, n);
    gated_add(x, mod + 2 * D, tmp, n, D);
}

/* RMSNorm per head (eps 1e-6) then complex rotation of pairs (2i, 2i+1) by cs[pos] (cos, sin interleaved). */
static void qk_norm_rope(float *x, int n, int heads, int hd, const float *w, const float *cs) {
    for (int i = 0; i < n; i++)
        for (int h = 0; h < heads; h++) {
            float *v = x + ((size_t)i * heads + h) * hd;
            float ss = 0.0f;
            for (int d = 0; d < hd; d++) ss += v[d] * v[d];
            float r = 1.0f / sqrtf(ss / (float)hd + 1e-6f);
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

static int run_dit(const args_t *a) {
    dit_t m;
    memset(&m, 0, sizeof m);
    if (load_dit(&m, a)) return -1;
    int D = m.dim, F = 4 * D, H = m.heads, hd = m.head_dim;
    fputs("ready\n", stderr);
    /* session header: grid h, w (in 2x2 patches), number of texts, then each text (len, joint floats) */
    int32_t gh, gw, ntext;
    if (read_i32(&gh) || read_i32(&gw) || read_i32(&ntext) || gh <= 0 || gw <= 0 || gh > 4096 || gw > 4096 ||
        ntext <= 0 || ntext > 2) {
        snprintf(g_err, sizeof g_err, "bad session header");
        return -1;
    }
    int N = gh * gw;
    int32_t tlen[2];
    float *txt[2] = {NULL, NULL}, *txt_cs[2] = {NULL, NULL};
    tlen[1] = 0;
    int max_vid = gh / 2 > gw / 2 ? gh / 2 : gw / 2;
    for (int t = 0; t < ntext; t++) {
        if (read_i32(&tlen[t]) || tlen[t] <= 0 || tlen[t] > 4096) { snprintf(g_err, sizeof g_err, "bad text");
                                                                    return -1; }
        float *raw = FALLOC((size_t)tlen[t] * m.joint);
        if (read_all(raw, sizeof(float) * (size_t)tlen[t] * m.joint)) { snprintf(g_err, sizeof g_err, "short text");
                                                                         return -1; }
        for (int i = 0; i < tlen[t]; i++) cb_rmsnorm(raw + (size_t)i * m.joint, raw + (size_t)i * m.joint,
                                                     m.txt_norm, m.joint, 1e-6f);
        txt[t] = FALLOC((size_t)tlen[t] * D);
        linear(&m.txt_in, txt[t], raw, tlen[t]);
        free(raw);
        txt_cs[t] = FALLOC((size_t)tlen[t] * hd);
        for (int i = 0; i < tlen[t]; i++) {
            float *c = txt_cs[t] + (size_t)i * hd;
            rope_section(c, max_vid + i, m.axes[0]);
            rope_section(c + m.axes[0], max_vid + i, m.axes[1]);
            rope_section(c + m.axes[0] + m.axes[1], max_vid + i, m.axes[2]);
        }
    }
    float *img_cs = FALLOC((size_t)N * hd);
    for (int y = 0; y < gh; y++)
        for (int x = 0; x < gw; x++) {
            float *c = img_cs + ((size_t)y * gw + x) * hd;
            rope_section(c, 0, m.axes[0]);
            rope_section(c + m.axes[0], y - (gh - gh / 2), m.axes[1]);
            rope_section(c + m.axes[0] + m.axes[1], x - (gw - gw / 2), m.axes[2]);
        }
    int maxT = tlen[0] > tlen[1] ? tlen[0] : tlen[1];
    int S = maxT + N;
    float *lat = FALLOC((size_t)N * m.in_ch), *img = FALLOC((size_t)N * D), *tx = FALLOC((size_t)maxT * D);
    float *nrm = FALLOC((size_t)S * D), *q = FALLOC((size_t)S * D), *k = FALLOC((size_t)S * D),
          *v = FALLOC((size_t)S * D), *att = FALLOC((size_t)S * D), *tmp = FALLOC((size_t)S * D),
          *ff = FALLOC((size_t)S * F);
    float *tproj = FALLOC(256), *temb = FALLOC(D), *stemb = FALLOC(D), *imod = FALLOC(6 * D),
          *tmod = FALLOC(6 * D), *omod = FALLOC(2 * D), *out = FALLOC((size_t)N * 4 * m.out_ch);
    int32_t cmd;
    while (read_i32(&cmd) == 0 && cmd == 1) {
        int32_t which;
        float timestep;
        if (read_i32(&which) || which < 0 || which >= ntext || read_all(&timestep, 4) ||
            read_all(lat, sizeof(float) * (size_t)N * m.in_ch)) {
            snprintf(g_err, sizeof g_err, "short step request");
            return -1;
        }
        int T = tlen[which];
        memcpy(tx, txt[which], sizeof(float) * (size_t)T * D);
        /* Timesteps(256, flip_sin_to_cos, shift 0, scale 1000) of the t/1000 the pipeline passes */
        for (int j = 0; j < 128; j++) {
            float freq = expf(-logf(10000.0f) * (float)j / 128.0f);
            float arg = 1000.0f * (timestep * freq);
            tproj[j] = cosf(arg);
            tproj[128 + j] = sinf(arg);
        }
        linear(&m.t1, temb, tproj, 1);
        for (int d = 0; d < D; d++) temb[d] = temb[d] / (1.0f + expf(-temb[d]));
        linear(&m.t2, stemb, temb, 1);
        for (int d = 0; d < D; d++) temb[d] = stemb[d] / (1.0f + expf(-stemb[d]));   /* silu(temb) feeds mods */
        linear(&m.img_in, img, lat, N);
        for (int l = 0; l < m.layers; l++) {
            dit_block_t *b = &m.B[l];
            linear(&b->img_mod, imod, temb, 1);
            linear(&b->txt_mod, tmod, temb, 1);
            /* chunks: [shift1, scale1, gate1, shift2, scale2, gate2] */
            norm_modulate(nrm, tx, T, D, tmod, tmod + D);
            norm_modulate(nrm + (size_t)T * D, img, N, D, imod, imod + D);
            linear(&b->add_q, q, nrm, T); linear(&b->add_k, k, nrm, T); linear(&b->add_v, v, nrm, T);
            linear(&b->to_q, q + (size_t)T * D, nrm + (size_t)T * D, N);
            linear(&b->to_k, k + (size_t)T * D, nrm + (size_t)T * D, N);
            linear(&b->to_v, v + (size_t)T * D, nrm + (size_t)T * D, N);
            qk_norm_rope(q, T, H, hd, b->norm_added_q, txt_cs[which]);
            qk_norm_rope(k, T, H, hd, b->norm_added_k, txt_cs[which]);
            qk_norm_rope(q + (size_t)T * D, N, H, hd, b->norm_q, img_cs);
            qk_norm_rope(k + (size_t)T * D, N, H, hd, b->norm_k, img_cs);
            attention(att, q, k, v, T + N, T + N, H, H, hd, D, D, 0);
            linear(&b->to_add_out, tmp, att, T);
            gated_add(tx, tmod + 2 * D, tmp, T, D);
            linear(&b->to_out, tmp, att + (size_t)T * D, N);
            gated_add(img, imod + 2 * D, tmp, N, D);
            feed_forward(img, N, D, F, imod + 3 * D, &b->img_fc1, &b->img_fc2, nrm, ff, tmp);
            feed_forward(tx, T, D, F, tmod + 3 * D, &b->txt_fc1, &b->txt_fc2, nrm, ff, tmp);
        }
        /* AdaLayerNormContinuous: chunks (scale, shift) */
        linear(&m.norm_out, omod, temb, 1);
        norm_modulate(nrm, img, N, D, omod + D, omod);
        linear(&m.proj_out, out, nrm, N);
        if (write_all(out, sizeof(float) * (size_t)N * 4 * m.out_ch)) return -1;
        fflush(stdout);
    }
    float *scratch[] = {img_cs, lat, img, tx, nrm, q, k, v, att, tmp, ff, tproj, temb, stemb, imod, tmod,
                        omod, out, txt[0], txt[1], txt_cs[0], txt_cs[1]};
    for (size_t i = 0; i < sizeof scratch / sizeof *scratch; i++) free(scratch[i]);
    free_dit(&m);
    return 0;
}

/* ================================================================== vae: AutoencoderKLQwenImage decoder, 1 frame */

/* A causal conv3d on the first frame: the past frames are zero padding, so only the kernel's last time slice
 * meets the frame: a 2-D conv. Weights [out, in, kt, kh, kw] -> the slice [out, in, kh, kw]. */
typedef struct {
    int cin, cout, k;
    float *w, *b;
} conv_t;

static int load_conv(conv_t *c, const char *prefix, int cin, int cout, int three_d) {
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

static void free_conv(conv_t *c) {
    free(c->w);
    free(c->b);
}

/* y[cout, h, w] = conv(x[cin, h, w]), zero padding k/2: im2col over a chunk of pixels at a time (bounded scratch
 * whatever the image size), then one cb_matmul of the weights [cout, cin*k*k] with the chunk's columns. */
static void conv(const conv_t *c, float *y, const float *x, int h, int w) {
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

typedef struct {
    int cin, cout;
    float *g1, *g2;
    conv_t c1, c2, sc;
    int has_sc;
} resblock_t;

static int load_res(resblock_t *r, const char *p, int cin, int cout) {
    char name[256];
    r->cin = cin; r->cout = cout;
    snprintf(name, sizeof name, "%s.norm1.gamma", p);
    if (!(r->g1 = load_f32(name, (size_t)cin))) return -1;
    snprintf(name, sizeof name, "%s.norm2.gamma", p);
    if (!(r->g2 = load_f32(name, (size_t)cout))) return -1;
    snprintf(name, sizeof name, "%s.conv1", p);
    if (load_conv(&r->c1, name, cin, cout, 1)) return -1;
    snprintf(name, sizeof name, "%s.conv2", p);
    if (load_conv(&r->c2, name, cout, cout, 1)) return -1;
    r->has_sc = cin != cout;
    snprintf(name, sizeof name, "%s.conv_shortcut", p);
    return r->has_sc ? load_conv(&r->sc, name, cin, cout, 1) : 0;
}

static void free_res(resblock_t *r) {
    free(r->g1); free(r->g2);
    free_conv(&r->c1); free_conv(&r->c2);
    if (r->has_sc) free_conv(&r->sc);
}

/* x[cin, hw] -> returns new buffer [cout, hw] */
static float *res_forward(const resblock_t *r, float *x, int h, int w) {
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

typedef struct {
    int C;
    float *gamma;
    conv_t qkv, proj;
} vattn_t;

static float *vattn_forward(const vattn_t *a, float *x, int h, int w) {
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

static int run_vae(const args_t *a) {
    int base, z, nres, nmult, mult[8], up3d[8];
    if (arg_int(a, "base_dim", &base) || arg_int(a, "z_dim", &z) || arg_int(a, "num_res_blocks", &nres) ||
        arg_int(a, "levels", &nmult))
        return -1;
    if (nmult < 1 || nmult > 8) { snprintf(g_err, sizeof g_err, "levels=%d out of range", nmult); return -1; }
    for (int i = 0; i < nmult; i++) {
        char key[32];
        snprintf(key, sizeof key, "mult%d", i);
        if (arg_int(a, key, &mult[i])) return -1;
    }
    conv_t pq, cin, cout;
    resblock_t mid0, mid1;
    vattn_t mattn;
    int dims[9];
    dims[0] = base * mult[nmult - 1];
    for (int i = 0; i < nmult; i++) dims[i + 1] = base * mult[nmult - 1 - i];
    (void)up3d;
    if (load_conv(&pq, "post_quant_conv", z, z, 1) || load_conv(&cin, "decoder.conv_in", z, dims[0], 1) ||
        load_res(&mid0, "decoder.mid_block.resnets.0", dims[0], dims[0]) ||
        load_res(&mid1, "decoder.mid_block.resnets.1", dims[0], dims[0]))
        return -1;
    mattn.C = dims[0];
    if (!(mattn.gamma = load_f32("decoder.mid_block.attentions.0.norm.gamma", (size_t)dims[0])) ||
        load_conv(&mattn.qkv, "decoder.mid_block.attentions.0.to_qkv", dims[0], 3 * dims[0], 0) ||
        load_conv(&mattn.proj, "decoder.mid_block.attentions.0.proj", dims[0], dims[0], 0))
        return -1;
    resblock_t *res = xalloc(sizeof(resblock_t) * (size_t)nmult * (nres + 1));
    conv_t *ups = xalloc(sizeof(conv_t) * (size_t)nmult);
    for (int i = 0; i < nmult; i++) {
        int in = dims[i], out = dims[i + 1];
        if (i > 0) in /= 2;
        for (int r = 0; r <= nres; r++) {
            char p[128];
            snprintf(p, sizeof p, "decoder.up_blocks.%d.resnets.%d", i, r);
            if (load_res(&res[i * (nres + 1) + r], p, r == 0 ? in : out, out)) return -1;
        }
        if (i != nmult - 1) {
            char p[128];
            snprintf(p, sizeof p, "decoder.up_blocks.%d.upsamplers.0.resample.1", i);
            if (load_conv(&ups[i], p, out, out / 2, 0)) return -1;
        }
    }
    float *gout = load_f32("decoder.norm_out.gamma", (size_t)dims[nmult]);
    if (!gout || load_conv(&cout, "decoder.conv_out", dims[nmult], 3, 1)) return -1;
    fputs("ready\n", stderr);
    int32_t h, w;
    while (read_i32(&h) == 0 && read_i32(&w) == 0) {
        if (h <= 0 || w <= 0 || h > 1024 || w > 1024) { snprintf(g_err, sizeof g_err, "bad latent size"); return -1; }
        float *zin = FALLOC((size_t)z * h * w), *x = FALLOC((size_t)z * h * w);
        if (read_all(zin, sizeof(float) * (size_t)z * h * w)) { snprintf(g_err, sizeof g_err, "short latents");
                                                               return -1; }
        conv(&pq, x, zin, h, w);
        float *y = FALLOC((size_t)dims[0] * h * w);
        conv(&cin, y, x, h, w);
        free(x); free(zin);
        y = res_forward(&mid0, y, h, w);
        y = vattn_forward(&mattn, y, h, w);
        y = res_forward(&mid1, y, h, w);
        int C = dims[0];
        for (int i = 0; i < nmult; i++) {
            for (int r = 0; r <= nres; r++) {
                y = res_forward(&res[i * (nres + 1) + r], y, h, w);
                C = dims[i + 1];
            }
            if (i != nmult - 1) {   /* nearest-exact x2, then the 2-D conv (the time conv skips the first frame) */
                int H2 = 2 * h, W2 = 2 * w;
                float *big = FALLOC((size_t)C * H2 * W2);
                for (int c = 0; c < C; c++)
                    for (int yy = 0; yy < H2; yy++)
                        for (int xx = 0; xx < W2; xx++)
                            big[((size_t)c * H2 + yy) * W2 + xx] = y[((size_t)c * h + yy / 2) * w + xx / 2];
                free(y);
                y = FALLOC((size_t)(C / 2) * H2 * W2);
                conv(&ups[i], y, big, H2, W2);
                free(big);
                h = H2; w = W2; C /= 2;
            }
        }
        rms_channels(y, C, h * w, gout, 1);
        float *img = FALLOC((size_t)3 * h * w);
        conv(&cout, img, y, h, w);
        free(y);
        for (size_t i = 0; i < (size_t)3 * h * w; i++) img[i] = img[i] < -1.0f ? -1.0f : img[i] > 1.0f ? 1.0f : img[i];
        int32_t hdr[2] = {h, w};
        if (write_all(hdr, sizeof hdr) || write_all(img, sizeof(float) * (size_t)3 * h * w)) return -1;
        fflush(stdout);
        free(img);
    }
    conv_t *convs[] = {&pq, &cin, &cout, &mattn.qkv, &mattn.proj};
    for (size_t i = 0; i < sizeof convs / sizeof *convs; i++) free_conv(convs[i]);
    free_res(&mid0);
    free_res(&mid1);
    for (int i = 0; i < nmult; i++) {
        for (int r = 0; r <= nres; r++) free_res(&res[i * (nres + 1) + r]);
        if (i != nmult - 1) free_conv(&ups[i]);
    }
    free(res); free(ups); free(gout); free(mattn.gamma);
    return 0;
}

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

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s text|dit|vae COMPONENT_DIR [key=value...]\n", argv[0]);
        return 2;
    }
    args_t a = {0};
    int threads = 0;
    for (int i = 3; i < argc && a.n < MAX_ARGS; i++) {
        char *eq = strchr(argv[i], '=');
        if (!eq) { fprintf(stderr, "error: argument %s is not key=value\n", argv[i]); return 2; }
        *eq = 0;
        a.key[a.n] = argv[i];
        a.val[a.n++] = eq + 1;
        if (!strcmp(argv[i], "threads")) threads = atoi(eq + 1);
        if (!strcmp(argv[i], "int8")) g_int8 = atoi(eq + 1) != 0;
    }
    if (cb_st_open(&g_idx, argv[2], g_err, sizeof g_err)) { fprintf(stderr, "error: %s\n", g_err); return 1; }
    cb_threads_init(threads);
    int rc;
    if (!strcmp(argv[1], "text")) rc = run_text(&a);
    else if (!strcmp(argv[1], "dit")) rc = run_dit(&a);
    else if (!strcmp(argv[1], "vae")) { g_int8 = 0; rc = run_vae(&a); }
    else { snprintf(g_err, sizeof g_err, "unknown stage %s", argv[1]); rc = -1; }
    cb_st_close(&g_idx);
    if (rc) { fprintf(stderr, "error: %s\n", g_err); return 1; }
    report_peak_rss();
    return 0;
}
