/* mla.c: see mla.h. */
#include "mla.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int load_lin(cb_linear *l, const cb_st_index *idx, const char *prefix, const char *what, int rows, int cols,
                    size_t *bytes, char *err, size_t errlen) {
    char name[512];
    snprintf(name, sizeof name, "%s%s.weight", prefix, what);
    return cb_load_linear(l, idx, name, rows, cols, bytes, err, errlen);
}

static int load_vec(float **v, const cb_st_index *idx, const char *prefix, const char *what, int n, size_t *bytes,
                    char *err, size_t errlen) {
    char name[512];
    snprintf(name, sizeof name, "%s%s", prefix, what);
    return cb_load_vector(v, idx, name, n, bytes, err, errlen);
}

int cb_mla_init(cb_mla *m, const cb_st_index *idx, const char *prefix, const cb_mla_shape *s, int max_batch, int ctx,
                size_t *bytes, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    m->s = *s;
    m->max_batch = max_batch;
    m->ctx = ctx;
    int H = s->n_heads, qk = s->nope + s->rope;
    if (H < 1 || s->kv_lora < 1 || s->rope < 2 || s->rope % 2 || s->nope < 0 || s->v_dim < 1 || s->q_lora < 0) {
        snprintf(err, errlen, "--set MLA geometry out of range (kv_lora_rank, qk_rope_head_dim even >= 2, "
                              "qk_nope_head_dim, v_head_dim, q_lora_rank)");
        return -1;
    }
    if (s->q_lora) {
        if (load_lin(&m->q_a, idx, prefix, "q_a_proj", s->q_lora, s->hidden, bytes, err, errlen) ||
            load_vec(&m->q_a_norm, idx, prefix, "q_a_layernorm.weight", s->q_lora, bytes, err, errlen) ||
            load_lin(&m->q_b, idx, prefix, "q_b_proj", H * qk, s->q_lora, bytes, err, errlen) ||
            (s->bias && load_vec(&m->bq_a, idx, prefix, "q_a_proj.bias", s->q_lora, bytes, err, errlen)))
            goto fail;
    } else if (load_lin(&m->q_proj, idx, prefix, "q_proj", H * qk, s->hidden, bytes, err, errlen)) {
        goto fail;
    }
    if (load_lin(&m->kv_a, idx, prefix, "kv_a_proj_with_mqa", s->kv_lora + s->rope, s->hidden, bytes, err, errlen) ||
        load_vec(&m->kv_a_norm, idx, prefix, "kv_a_layernorm.weight", s->kv_lora, bytes, err, errlen) ||
        load_lin(&m->kv_b, idx, prefix, "kv_b_proj", H * (s->nope + s->v_dim), s->kv_lora, bytes, err, errlen) ||
        load_lin(&m->o, idx, prefix, "o_proj", s->hidden, H * s->v_dim, bytes, err, errlen) ||
        (s->bias && (load_vec(&m->bkv_a, idx, prefix, "kv_a_proj_with_mqa.bias", s->kv_lora + s->rope, bytes, err,
                              errlen) ||
                     load_vec(&m->bo, idx, prefix, "o_proj.bias", s->hidden, bytes, err, errlen))))
        goto fail;
    if (cb_linear_dequantize(&m->kv_b, err, errlen)) goto fail;   /* read directly below, so float */
    size_t B = (size_t)max_batch;
    m->q_resid = malloc(B * (size_t)(s->q_lora ? s->q_lora : 1) * sizeof(float));
    m->q = malloc(B * (size_t)H * (size_t)qk * sizeof(float));
    m->ckv = malloc(B * (size_t)(s->kv_lora + s->rope) * sizeof(float));
    m->att = malloc(B * (size_t)H * (size_t)s->v_dim * sizeof(float));
    m->work = malloc(B * (size_t)H * ((size_t)ctx + 3 * (size_t)s->kv_lora) * sizeof(float));
    if (!m->q_resid || !m->q || !m->ckv || !m->att || !m->work) {
        snprintf(err, errlen, "out of memory for the MLA block of %s", prefix);
        goto fail;
    }
    return 0;
fail:
    cb_mla_free(m);
    return -1;
}

void cb_mla_free(cb_mla *m) {
    cb_linear_free(&m->q_proj);
    cb_linear_free(&m->q_a);
    cb_linear_free(&m->q_b);
    cb_linear_free(&m->kv_a);
    cb_linear_free(&m->kv_b);
    cb_linear_free(&m->o);
    free(m->q_a_norm); free(m->kv_a_norm); free(m->bq_a); free(m->bkv_a); free(m->bo);
    if (!m->borrowed) free(m->q_resid), free(m->q), free(m->ckv), free(m->att), free(m->work);
    memset(m, 0, sizeof *m);
}

void cb_mla_share_scratch(cb_mla *m, const cb_mla *owner) {
    if (m == owner || m->borrowed || memcmp(&m->s, &owner->s, sizeof m->s) || m->max_batch != owner->max_batch ||
        m->ctx != owner->ctx)
        return;
    free(m->q_resid), free(m->q), free(m->ckv), free(m->att), free(m->work);
    m->q_resid = owner->q_resid;
    m->q = owner->q;
    m->ckv = owner->ckv;
    m->att = owner->att;
    m->work = owner->work;
    m->borrowed = 1;
}

void cb_mla_project(cb_mla *m, const float *h, int n, int pos0, cb_kv *kv, int layer, const cb_rope *rope) {
    const cb_mla_shape *s = &m->s;
    int H = s->n_heads, qk = s->nope + s->rope, kvw = s->kv_lora + s->rope;
    if (s->q_lora) {
        cb_linear_apply(&m->q_a, m->q_resid, h, n);
        cb_add_bias(m->q_resid, m->bq_a, n, s->q_lora);
        for (int i = 0; i < n; i++) {
            float *r = m->q_resid + (size_t)i * (size_t)s->q_lora;
            cb_rmsnorm(r, r, m->q_a_norm, s->q_lora, s->lora_eps);
        }
        cb_linear_apply(&m->q_b, m->q, m->q_resid, n);
    } else {
        cb_linear_apply(&m->q_proj, m->q, h, n);
    }
    cb_linear_apply(&m->kv_a, m->ckv, h, n);
    cb_add_bias(m->ckv, m->bkv_a, n, kvw);
    for (int i = 0; i < n; i++) {
        int pos = pos0 + i;
        float *q = m->q + (size_t)i * (size_t)H * (size_t)qk, *c = m->ckv + (size_t)i * (size_t)kvw;
        if (rope)
            for (int hd = 0; hd < H; hd++) cb_rope_apply(rope, q + (size_t)hd * (size_t)qk + s->nope, 1, s->rope, pos);
        cb_rmsnorm(c, c, m->kv_a_norm, s->kv_lora, s->lora_eps);
        if (rope) cb_rope_apply(rope, c + s->kv_lora, 1, s->rope, pos);
        memcpy(cb_kv_k(kv, layer, pos), c, (size_t)kvw * sizeof(float));
    }
}

typedef struct {
    cb_mla *m;
    const cb_kv *kv;
    int layer, pos0, sel_stride;
    const int *sel, *n_sel;
} attend_job;

/* One (row, head): independent of every other, so neither threads nor batching can change a bit. */
static void attend_one(void *ctx, int task) {
    const attend_job *j = ctx;
    cb_mla *m = j->m;
    const cb_mla_shape *s = &m->s;
    int H = s->n_heads, qk = s->nope + s->rope, L = s->kv_lora;
    int row = task / H, h = task % H, pos = j->pos0 + row;
    size_t es = cb_dtype_size(m->kv_b.m.f.dt);
    const float *q = m->q + ((size_t)row * (size_t)H + (size_t)h) * (size_t)qk;
    float *sc = m->work + (size_t)task * ((size_t)m->ctx + 3 * (size_t)L);
    float *q_lat = sc + m->ctx, *ctx_lat = q_lat + L, *w_row = ctx_lat + L;
    /* q_lat = W_UK_h^T q_nope, accumulated over W_UK_h's rows (row d scaled by q_nope[d]) so kv_b_proj is read
     * in its stored layout: no transposed copy of the weights. */
    memset(q_lat, 0, (size_t)L * sizeof(float));
    const char *wk = (const char *)m->kv_b.m.f.w + (size_t)h * (size_t)(s->nope + s->v_dim) * (size_t)L * es;
    for (int d = 0; d < s->nope; d++) {
        const float *w = w_row;
        if (m->kv_b.m.f.dt == CB_F32) w = (const float *)(const void *)(wk + (size_t)d * (size_t)L * es);
        else cb_convert_to_f32(w_row, wk + (size_t)d * (size_t)L * es, m->kv_b.m.f.dt, (size_t)L);
        float qd = q[d];
        for (int c = 0; c < L; c++) q_lat[c] += qd * w[c];
    }
    const int *sel = j->sel ? j->sel + (size_t)row * (size_t)j->sel_stride : NULL;
    int n_keys = sel ? j->n_sel[row] : pos + 1;
    for (int i = 0; i < n_keys; i++) {
        const float *r = cb_kv_k(j->kv, j->layer, sel ? sel[i] : i);
        sc[i] = (cb_dot(r, CB_F32, q_lat, L) + cb_dot(r + L, CB_F32, q + s->nope, s->rope)) * s->scale;
    }
    cb_softmax(sc, n_keys);
    memset(ctx_lat, 0, (size_t)L * sizeof(float));
    for (int i = 0; i < n_keys; i++) {
        const float *r = cb_kv_k(j->kv, j->layer, sel ? sel[i] : i);
        float p = sc[i];
        for (int c = 0; c < L; c++) ctx_lat[c] += p * r[c];
    }
    float *out = m->att + ((size_t)row * (size_t)H + (size_t)h) * (size_t)s->v_dim;
    size_t v_row = (size_t)h * (size_t)(s->nope + s->v_dim) + (size_t)s->nope;
    const char *wv = (const char *)m->kv_b.m.f.w + v_row * (size_t)L * es;
    for (int d = 0; d < s->v_dim; d++) out[d] = cb_dot(wv + (size_t)d * (size_t)L * es, m->kv_b.m.f.dt, ctx_lat, L);
}

void cb_mla_attend(cb_mla *m, float *out, int n, int pos0, const cb_kv *kv, int layer, const int *sel,
                   const int *n_sel, int sel_stride) {
    attend_job j = {m, kv, layer, pos0, sel_stride, sel, n_sel};
    cb_parallel_for(n * m->s.n_heads, attend_one, &j);
    cb_linear_apply(&m->o, out, m->att, n);
    cb_add_bias(out, m->bo, n, m->s.hidden);
}
