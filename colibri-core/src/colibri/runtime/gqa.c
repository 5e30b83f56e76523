/* gqa.c: see gqa.h. */
#include "gqa.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cb_gqa_init(cb_gqa *a, const cb_st_index *idx, const char *prefix, const cb_gqa_config *c, size_t *dense_bytes,
                char *err, size_t errlen) {
    memset(a, 0, sizeof *a);
    if (c->n_kv_heads < 1 || c->n_heads % c->n_kv_heads) {
        snprintf(err, errlen, "--set num_attention_heads=%d must be a multiple of num_key_value_heads=%d", c->n_heads,
                 c->n_kv_heads);
        return -1;
    }
    a->c = *c;
    int hd = c->head_dim, qw = c->n_heads * hd, kw = c->n_kv_heads * hd, qrows = c->output_gate ? 2 * qw : qw;
    char name[320];
#define NAME(leaf) (snprintf(name, sizeof name, "%s%s", prefix, leaf), name)
    if (cb_load_linear(&a->wq, idx, NAME("q_proj.weight"), qrows, c->hidden, dense_bytes, err, errlen) ||
        cb_load_linear(&a->wk, idx, NAME("k_proj.weight"), kw, c->hidden, dense_bytes, err, errlen) ||
        cb_load_linear(&a->wv, idx, NAME("v_proj.weight"), kw, c->hidden, dense_bytes, err, errlen) ||
        cb_load_linear(&a->wo, idx, NAME("o_proj.weight"), c->hidden, qw, dense_bytes, err, errlen))
        goto fail;
    if (c->qkv_bias &&
        (cb_load_vector(&a->bq, idx, NAME("q_proj.bias"), qrows, dense_bytes, err, errlen) ||
         cb_load_vector(&a->bk, idx, NAME("k_proj.bias"), kw, dense_bytes, err, errlen) ||
         cb_load_vector(&a->bv, idx, NAME("v_proj.bias"), kw, dense_bytes, err, errlen)))
        goto fail;
    if (c->o_bias && cb_load_vector(&a->bo, idx, NAME("o_proj.bias"), c->hidden, dense_bytes, err, errlen)) goto fail;
    if (c->head_norm) {
        if (cb_load_vector(&a->q_norm, idx, NAME("q_norm.weight"), hd, dense_bytes, err, errlen) ||
            cb_load_vector(&a->k_norm, idx, NAME("k_norm.weight"), hd, dense_bytes, err, errlen))
            goto fail;
        /* 1 + w in f32 is exactly what transformers multiplies by, so the offset costs no accuracy. */
        if (c->norm_offset)
            for (int i = 0; i < hd; i++) {
                a->q_norm[i] += 1.0f;
                a->k_norm[i] += 1.0f;
            }
    }
#undef NAME
    return 0;
fail:
    cb_gqa_free(a);
    return -1;
}

void cb_gqa_free(cb_gqa *a) {
    cb_linear_free(&a->wq);
    cb_linear_free(&a->wk);
    cb_linear_free(&a->wv);
    cb_linear_free(&a->wo);
    free(a->bq);
    free(a->bk);
    free(a->bv);
    free(a->bo);
    free(a->q_norm);
    free(a->k_norm);
    memset(a, 0, sizeof *a);
}

int cb_gqa_scratch_init(cb_gqa_scratch *s, const cb_gqa_config *c, int max_batch, int ctx, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    size_t B = (size_t)max_batch, qw = (size_t)c->n_heads * (size_t)c->head_dim;
    size_t kw = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    s->qg = malloc(B * qw * 2 * sizeof(float));
    s->q = malloc(B * qw * sizeof(float));
    s->gate = malloc(B * qw * sizeof(float));
    s->att = malloc(B * qw * sizeof(float));
    s->k = malloc(B * kw * sizeof(float));
    s->v = malloc(B * kw * sizeof(float));
    s->scores = cb_attn_scratch(max_batch, c->n_heads, ctx);
    if (!s->qg || !s->q || !s->gate || !s->att || !s->k || !s->v || !s->scores) {
        cb_gqa_scratch_free(s);
        snprintf(err, errlen, "out of memory for the attention scratch");
        return -1;
    }
    return 0;
}

void cb_gqa_scratch_free(cb_gqa_scratch *s) {
    free(s->qg);
    free(s->q);
    free(s->gate);
    free(s->att);
    free(s->k);
    free(s->v);
    free(s->scores);
    memset(s, 0, sizeof *s);
}

static void add_rows(float *y, const float *b, int n, int width) {
    if (!b) return;
    for (int i = 0; i < n; i++) cb_add(y + (size_t)i * (size_t)width, b, (size_t)width);
}

void cb_gqa_forward(const cb_gqa *a, cb_gqa_scratch *s, float *out, const float *h, int n, cb_kv *kv, int kv_layer,
                    int pos0, const cb_rope *rope) {
    const cb_gqa_config *c = &a->c;
    int hd = c->head_dim, qw = c->n_heads * hd, kw = c->n_kv_heads * hd;
    if (c->output_gate) {
        cb_linear_apply(&a->wq, s->qg, h, n);
        add_rows(s->qg, a->bq, n, 2 * qw);
        for (int i = 0; i < n; i++)
            for (int hh = 0; hh < c->n_heads; hh++) {
                const float *src = s->qg + (size_t)i * (size_t)(2 * qw) + (size_t)hh * (size_t)(2 * hd);
                memcpy(s->q + (size_t)i * (size_t)qw + (size_t)hh * (size_t)hd, src, (size_t)hd * sizeof(float));
                memcpy(s->gate + (size_t)i * (size_t)qw + (size_t)hh * (size_t)hd, src + hd, (size_t)hd * sizeof(float));
            }
    } else {
        cb_linear_apply(&a->wq, s->q, h, n);
        add_rows(s->q, a->bq, n, qw);
    }
    cb_linear_apply(&a->wk, s->k, h, n);
    cb_linear_apply(&a->wv, s->v, h, n);
    add_rows(s->k, a->bk, n, kw);
    add_rows(s->v, a->bv, n, kw);
    for (int i = 0; i < n; i++) {
        float *q = s->q + (size_t)i * (size_t)qw, *k = s->k + (size_t)i * (size_t)kw;
        if (c->head_norm) {
            for (int hh = 0; hh < c->n_heads; hh++) cb_rmsnorm(q + (size_t)hh * hd, q + (size_t)hh * hd, a->q_norm, hd, c->eps);
            for (int hh = 0; hh < c->n_kv_heads; hh++)
                cb_rmsnorm(k + (size_t)hh * hd, k + (size_t)hh * hd, a->k_norm, hd, c->eps);
        }
        cb_rope_apply(rope, q, c->n_heads, hd, pos0 + i);
        cb_rope_apply(rope, k, c->n_kv_heads, hd, pos0 + i);
    }
    cb_kv_store(kv, kv_layer, pos0, n, s->k, s->v);
    cb_attn_shape shape = {c->n_heads, c->n_kv_heads, hd, 1.0f / sqrtf((float)hd)};
    cb_attend(s->att, s->q, kv, kv_layer, pos0, n, &shape, s->scores);
    if (c->output_gate)
        for (size_t j = 0; j < (size_t)n * (size_t)qw; j++) s->att[j] *= 1.0f / (1.0f + expf(-s->gate[j]));
    cb_linear_apply(&a->wo, out, s->att, n);
    add_rows(out, a->bo, n, c->hidden);
}
