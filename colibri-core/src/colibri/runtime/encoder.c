/* encoder.c: bidirectional self-attention and the elementwise pieces of encoders (encoder.h). */
#include "encoder.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Attention tasks per head, each a block of rows with its own row of scores: enough tasks to share among threads,
 * and scratch linear in the sequence length. */
#define BLOCKS_PER_HEAD 8

void cb_layernorm(float *out, const float *x, const float *w, const float *b, int n, float eps) {
    if (n <= 0) return;
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (double)x[i];
    float mean = (float)(sum / (double)n);
    double squares = 0.0;
    for (int i = 0; i < n; i++) {
        float d = x[i] - mean;
        squares += (double)(d * d);
    }
    float inv = 1.0f / sqrtf((float)(squares / (double)n) + eps);
    for (int i = 0; i < n; i++) {
        float v = (x[i] - mean) * inv;
        if (w) v *= w[i];
        if (b) v += b[i];
        out[i] = v;
    }
}

void cb_gelu(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = 0.5f * x[i] * (1.0f + erff(x[i] * (float)M_SQRT1_2));
}

void cb_relu(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

int cb_enc_attn_shape(cb_enc_attn *a, int hidden, int n_heads, char *err, size_t errlen) {
    if (n_heads < 1 || hidden % n_heads || hidden / n_heads < 2) {
        snprintf(err, errlen, "hidden size %d does not split into %d attention heads of at least 2", hidden, n_heads);
        return -1;
    }
    a->hidden = hidden;
    a->n_heads = n_heads;
    a->head_dim = hidden / n_heads;
    return 0;
}

int cb_enc_scratch_init(cb_enc_scratch *s, int max_n, int hidden, int n_heads, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    size_t n = (size_t)max_n;
    s->max_n = max_n;
    s->n_heads = n_heads;
    s->qkv = malloc(n * 3 * (size_t)hidden * sizeof(float));
    s->att = malloc(n * (size_t)hidden * sizeof(float));
    s->scores = malloc((size_t)BLOCKS_PER_HEAD * (size_t)n_heads * n * sizeof(float));   /* a row per task */
    if (!s->qkv || !s->att || !s->scores) {
        cb_enc_scratch_free(s);
        snprintf(err, errlen, "out of memory for the encoder's attention scratch (%d tokens)", max_n);
        return -1;
    }
    return 0;
}

void cb_enc_scratch_free(cb_enc_scratch *s) {
    free(s->qkv);
    free(s->att);
    free(s->scores);
    memset(s, 0, sizeof *s);
}

typedef struct {
    const cb_enc_attn *a;
    cb_enc_scratch *s;
    int n, window;
} enc_job;

/* One (row, head): the keys within the window of the row, softmax, the weighted sum of their values. */
static void attend_row(const enc_job *j, int row, int h, float *sc) {
    const cb_enc_attn *a = j->a;
    int hd = a->head_dim;
    size_t stride = 3 * (size_t)a->hidden, off = (size_t)h * (size_t)hd;
    int lo = 0, hi = j->n - 1;
    if (j->window >= 0) {
        lo = row - j->window > 0 ? row - j->window : 0;
        hi = row + j->window < hi ? row + j->window : hi;
    }
    const float *q = j->s->qkv + (size_t)row * stride + off;
    float scale = 1.0f / sqrtf((float)hd);
    for (int t = lo; t <= hi; t++)
        sc[t - lo] = cb_dot(j->s->qkv + (size_t)t * stride + (size_t)a->hidden + off, CB_F32, q, hd) * scale;
    cb_softmax(sc, hi - lo + 1);
    float *out = j->s->att + (size_t)row * (size_t)a->hidden + off;
    memset(out, 0, (size_t)hd * sizeof(float));
    for (int t = lo; t <= hi; t++) {
        const float *v = j->s->qkv + (size_t)t * stride + 2 * (size_t)a->hidden + off;
        float p = sc[t - lo];
        for (int d = 0; d < hd; d++) out[d] += p * v[d];
    }
}

/* One task: a block of rows of one head, with its own row of scores. */
static void attend_block(void *ctx, int task) {
    const enc_job *j = ctx;
    int rows = (j->n + BLOCKS_PER_HEAD - 1) / BLOCKS_PER_HEAD, h = task / BLOCKS_PER_HEAD;
    int first = task % BLOCKS_PER_HEAD * rows;
    float *sc = j->s->scores + (size_t)task * (size_t)j->s->max_n;
    for (int row = first; row < first + rows && row < j->n; row++) attend_row(j, row, h, sc);
}

void cb_enc_attention(const cb_enc_attn *a, cb_enc_scratch *s, float *out, const float *h, int n, int window,
                      const cb_rope *rope) {
    size_t stride = 3 * (size_t)a->hidden;
    cb_linear_apply(&a->qkv, s->qkv, h, n);
    cb_add_bias(s->qkv, a->qkv_bias, n, 3 * a->hidden);
    if (rope)
        for (int i = 0; i < n; i++) {
            cb_rope_apply(rope, s->qkv + (size_t)i * stride, a->n_heads, a->head_dim, i);
            cb_rope_apply(rope, s->qkv + (size_t)i * stride + (size_t)a->hidden, a->n_heads, a->head_dim, i);
        }
    enc_job j = {a, s, n, window};
    double t0 = cb_now_s();
    cb_parallel_for(BLOCKS_PER_HEAD * a->n_heads, attend_block, &j);
    cb_prof.attention_s += cb_now_s() - t0;
    cb_linear_apply(&a->out, out, s->att, n);
    cb_add_bias(out, a->out_bias, n, a->hidden);
}
