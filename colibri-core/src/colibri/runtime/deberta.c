/* deberta.c: the DeBERTa-v2/v3 encoder block (see deberta.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deberta.h"
#include "encoder.h"
#include "kernels.h"

static int has_word(const char *list, const char *word) {
    size_t w = strlen(word);
    for (const char *p = list; (p = strstr(p, word)) != NULL; p += w) {
        int starts = p == list || p[-1] == '|' || p[-1] == ',' || p[-1] == ' ';
        int ends = p[w] == 0 || p[w] == '|' || p[w] == ',' || p[w] == ' ';
        if (starts && ends) return 1;
    }
    return 0;
}

int cb_deberta_config_read(cb_deberta_config *c, cb_hparams *hp, char *err, size_t errlen) {
    static const cb_hp_spec table[] = {
        CB_HP_REQ("hidden_size", cb_deberta_config, hidden),
        CB_HP_REQ("num_hidden_layers", cb_deberta_config, n_layers),
        CB_HP_REQ("num_attention_heads", cb_deberta_config, n_heads),
        CB_HP_REQ("intermediate_size", cb_deberta_config, inter),
        CB_HP_REQ("vocab_size", cb_deberta_config, vocab),
        CB_HP_REQ("max_position_embeddings", cb_deberta_config, max_positions),
        CB_HP_OPT("embedding_size", cb_deberta_config, embedding_size, 0, CB_HP_NONNEG),
        CB_HP_OPT("type_vocab_size", cb_deberta_config, type_vocab_size, 0, CB_HP_NONNEG),
        CB_HP_FLAG("position_biased_input", cb_deberta_config, position_biased_input, 1),
        CB_HP_FLAG("relative_attention", cb_deberta_config, relative, 0),
        CB_HP_OPT("position_buckets", cb_deberta_config, position_buckets, -1, CB_HP_ANY),
        CB_HP_OPT("max_relative_positions", cb_deberta_config, max_relative, -1, CB_HP_ANY),
        CB_HP_FLAG("share_att_key", cb_deberta_config, share_att_key, 0),
        CB_HP_NUM("layer_norm_eps", cb_deberta_config, eps, 1e-7, CB_HP_POSITIVE),
        CB_HP_TEXT("pos_att_type", cb_deberta_config, pos_att_type, ""),
        CB_HP_TEXT("norm_rel_ebd", cb_deberta_config, norm_rel_ebd, "none"),
        CB_HP_END,
    };
    memset(c, 0, sizeof *c);
    if (cb_hp_read(hp, table, c, err, errlen)) return -1;
    if (c->hidden % c->n_heads) {
        snprintf(err, errlen, "--set hidden_size=%d is not a multiple of num_attention_heads=%d", c->hidden,
                 c->n_heads);
        return -1;
    }
    c->head_dim = c->hidden / c->n_heads;
    if (!c->embedding_size) c->embedding_size = c->hidden;
    c->c2p = has_word(c->pos_att_type, "c2p");
    c->p2c = has_word(c->pos_att_type, "p2c");
    c->norm_rel = has_word(c->norm_rel_ebd, "layer_norm");
    if (c->max_relative < 1) c->max_relative = c->max_positions;
    return 0;
}

#define NAME(fmt, ...) (snprintf(name, sizeof name, "%s" fmt, prefix, __VA_ARGS__), name)

static int load_dense(cb_linear *w, float **b, const cb_st_index *idx, const char *base, int rows, int cols,
                      size_t *bytes, char *err, size_t errlen) {
    char name[512];
    snprintf(name, sizeof name, "%s.weight", base);
    if (cb_load_linear(w, idx, name, rows, cols, bytes, err, errlen)) return -1;
    snprintf(name, sizeof name, "%s.bias", base);
    return cb_load_vector(b, idx, name, rows, bytes, err, errlen);
}

static int load_norm(float **w, float **b, const cb_st_index *idx, const char *base, int n, size_t *bytes, char *err,
                     size_t errlen) {
    char name[512];
    snprintf(name, sizeof name, "%s.weight", base);
    if (cb_load_vector(w, idx, name, n, bytes, err, errlen)) return -1;
    snprintf(name, sizeof name, "%s.bias", base);
    return cb_load_vector(b, idx, name, n, bytes, err, errlen);
}

static int load_layer(cb_deberta_layer *L, const cb_deberta_config *c, const cb_st_index *idx, const char *prefix,
                      int l, size_t *bytes, char *err, size_t errlen) {
    char name[512];
    int H = c->hidden;
    if (load_dense(&L->q, &L->bq, idx, NAME("encoder.layer.%d.attention.self.query_proj", l), H, H, bytes, err,
                   errlen) ||
        load_dense(&L->k, &L->bk, idx, NAME("encoder.layer.%d.attention.self.key_proj", l), H, H, bytes, err,
                   errlen) ||
        load_dense(&L->v, &L->bv, idx, NAME("encoder.layer.%d.attention.self.value_proj", l), H, H, bytes, err,
                   errlen) ||
        load_dense(&L->o, &L->bo, idx, NAME("encoder.layer.%d.attention.output.dense", l), H, H, bytes, err,
                   errlen) ||
        load_norm(&L->ln_attn_w, &L->ln_attn_b, idx, NAME("encoder.layer.%d.attention.output.LayerNorm", l), H,
                  bytes, err, errlen) ||
        load_dense(&L->up, &L->b_up, idx, NAME("encoder.layer.%d.intermediate.dense", l), c->inter, H, bytes, err,
                   errlen) ||
        load_dense(&L->down, &L->b_down, idx, NAME("encoder.layer.%d.output.dense", l), H, c->inter, bytes, err,
                   errlen) ||
        load_norm(&L->ln_out_w, &L->ln_out_b, idx, NAME("encoder.layer.%d.output.LayerNorm", l), H, bytes, err,
                  errlen))
        return -1;
    if (c->relative && !c->share_att_key) {
        if (c->c2p && load_dense(&L->pos_k, &L->b_pos_k, idx, NAME("encoder.layer.%d.attention.self.pos_key_proj", l),
                                 H, H, bytes, err, errlen))
            return -1;
        if (c->p2c && load_dense(&L->pos_q, &L->b_pos_q, idx,
                                 NAME("encoder.layer.%d.attention.self.pos_query_proj", l), H, H, bytes, err, errlen))
            return -1;
    }
    return 0;
}

int cb_deberta_load(cb_deberta *m, const cb_deberta_config *c, const cb_st_index *idx, const char *prefix,
                    size_t *bytes, char *err, size_t errlen) {
    char name[512];
    memset(m, 0, sizeof *m);
    m->c = *c;
    int H = c->hidden, E = c->embedding_size;
    if (cb_load_linear(&m->word, idx, NAME("embeddings.word_embeddings.weight%s", ""), c->vocab, E, bytes, err,
                       errlen))
        return -1;
    if (c->position_biased_input &&
        cb_load_linear(&m->position, idx, NAME("embeddings.position_embeddings.weight%s", ""), c->max_positions, E,
                       bytes, err, errlen))
        return -1;
    if (c->type_vocab_size > 0 &&
        cb_load_linear(&m->token_type, idx, NAME("embeddings.token_type_embeddings.weight%s", ""),
                       c->type_vocab_size, E, bytes, err, errlen))
        return -1;
    if (E != H && cb_load_linear(&m->embed_proj, idx, NAME("embeddings.embed_proj.weight%s", ""), H, E, bytes, err,
                                 errlen))
        return -1;
    if (load_norm(&m->ln_w, &m->ln_b, idx, NAME("embeddings.LayerNorm%s", ""), H, bytes, err, errlen)) return -1;
    if (c->relative) {
        m->span = c->position_buckets > 0 ? c->position_buckets : c->max_relative;
        const cb_tensor *t = cb_st_find(idx, NAME("encoder.rel_embeddings.weight%s", ""));
        if (!t || t->ndim != 2 || t->shape[1] != H || t->shape[0] < 2 * (int64_t)m->span) {
            snprintf(err, errlen, "%s: missing, or not [>= %d, %d] (2 x position_buckets or max_relative_positions "
                                  "rows of hidden_size)", name, 2 * m->span, H);
            return -1;
        }
        float *all;
        if (cb_load_f32(&all, idx, t, (size_t)t->shape[0] * (size_t)H, bytes, err, errlen)) return -1;
        m->rel = all;   /* only the first 2 span rows are read, as transformers slices them */
        if (c->norm_rel) {
            float *w, *b;
            if (load_norm(&w, &b, idx, NAME("encoder.LayerNorm%s", ""), H, bytes, err, errlen)) return -1;
            for (int r = 0; r < 2 * m->span; r++)
                cb_layernorm(m->rel + (size_t)r * H, m->rel + (size_t)r * H, w, b, H, c->eps);
            free(w);
            free(b);
        }
    }
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int l = 0; l < c->n_layers; l++)
        if (load_layer(&m->layers[l], c, idx, prefix, l, bytes, err, errlen)) return -1;
    return 0;
}

void cb_deberta_free(cb_deberta *m) {
    if (m->layers)
        for (int l = 0; l < m->c.n_layers; l++) {
            cb_deberta_layer *L = &m->layers[l];
            cb_linear *lin[] = {&L->q, &L->k, &L->v, &L->o, &L->up, &L->down, &L->pos_k, &L->pos_q};
            for (size_t i = 0; i < sizeof lin / sizeof *lin; i++) cb_linear_free(lin[i]);
            float *vec[] = {L->bq, L->bk, L->bv, L->bo, L->b_up, L->b_down, L->b_pos_k, L->b_pos_q,
                            L->ln_attn_w, L->ln_attn_b, L->ln_out_w, L->ln_out_b};
            for (size_t i = 0; i < sizeof vec / sizeof *vec; i++) free(vec[i]);
        }
    free(m->layers);
    cb_linear_free(&m->word);
    cb_linear_free(&m->position);
    cb_linear_free(&m->token_type);
    cb_linear_free(&m->embed_proj);
    free(m->ln_w);
    free(m->ln_b);
    free(m->rel);
    memset(m, 0, sizeof *m);
}

/* transformers' make_log_bucket_position, in float32 as torch computes it (the ceil must land where torch's does). */
static int log_bucket(int rel, int buckets, int max_position) {
    int mid = buckets / 2;
    int abs_pos = (rel < mid && rel > -mid) ? mid - 1 : abs(rel);
    if (abs_pos <= mid) return rel;
    float ratio = (float)abs_pos / (float)mid;
    float denom = logf((float)((double)(max_position - 1) / mid));
    float log_pos = ceilf(logf(ratio) / denom * (float)(mid - 1)) + (float)mid;
    return rel < 0 ? -(int)log_pos : (int)log_pos;
}

static float dot(const float *a, const float *b, int n) {
    float s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef struct {
    const cb_deberta *m;
    int n;
    const float *q, *k, *v, *pq, *pk;   /* pq / pk: [2 span, hidden] position queries / keys (NULL when unused) */
    const int *rel;                     /* [n x n]: the (bucketed) relative position i - j */
    float *scratch;                     /* per head: n scores + n x 2 span c2p + n x 2 span p2c */
    size_t per_head;
    float *out;
} attend_job;

static int clamp_index(int r, int span) { return r < 0 ? 0 : r > 2 * span - 1 ? 2 * span - 1 : r; }

static void attend_head(void *ctx, int h) {
    const attend_job *J = ctx;
    const cb_deberta_config *c = &J->m->c;
    int n = J->n, H = c->hidden, d = c->head_dim, span = J->m->span, S2 = 2 * span;
    float *scores = J->scratch + (size_t)h * J->per_head;
    float *c2p = scores + n, *p2c = c2p + (size_t)n * S2;
    float scale = sqrtf((float)d * (float)(1 + (J->pk ? 1 : 0) + (J->pq ? 1 : 0)));
    const float *col = J->q + (size_t)h * d;
    /* the position terms: every query against every position key (c2p), every key against every position query */
    for (int i = 0; i < n; i++)
        for (int r = 0; J->pk && r < S2; r++)
            c2p[(size_t)i * S2 + r] = dot(J->q + (size_t)i * H + h * d, J->pk + (size_t)r * H + h * d, d);
    for (int j = 0; j < n; j++)
        for (int r = 0; J->pq && r < S2; r++)
            p2c[(size_t)j * S2 + r] = dot(J->k + (size_t)j * H + h * d, J->pq + (size_t)r * H + h * d, d);
    for (int i = 0; i < n; i++) {
        const float *qi = col + (size_t)i * H;
        for (int j = 0; j < n; j++) {
            float s = dot(qi, J->k + (size_t)j * H + h * d, d) / scale, pos = 0;
            if (J->pk) pos += c2p[(size_t)i * S2 + clamp_index(J->rel[(size_t)i * n + j] + span, span)] / scale;
            if (J->pq) pos += p2c[(size_t)j * S2 + clamp_index(-J->rel[(size_t)j * n + i] + span, span)] / scale;
            scores[j] = s + pos;
        }
        cb_softmax(scores, n);
        float *o = J->out + (size_t)i * H + h * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int j = 0; j < n; j++) {
            const float *vj = J->v + (size_t)j * H + h * d;
            for (int e = 0; e < d; e++) o[e] += scores[j] * vj[e];
        }
    }
}

static void project(float *y, const cb_linear *w, const float *b, const float *x, int n) {
    cb_linear_apply(w, y, x, n);
    cb_add_bias(y, b, n, w->m.rows);
}

int cb_deberta_forward(const cb_deberta *m, const int *tokens, int n, float *out, char *err, size_t errlen) {
    const cb_deberta_config *c = &m->c;
    int H = c->hidden, E = c->embedding_size, S2 = 2 * m->span;
    size_t nh = (size_t)n * H, per_head = (size_t)n + (m->span ? 2 * (size_t)n * S2 : 0);
    float *q = malloc(nh * sizeof(float)), *k = malloc(nh * sizeof(float)), *v = malloc(nh * sizeof(float));
    float *ctx = malloc(nh * sizeof(float)), *a = malloc(nh * sizeof(float));
    float *up = malloc((size_t)n * c->inter * sizeof(float)), *emb = malloc((size_t)n * E * sizeof(float));
    float *pq = m->span ? malloc((size_t)S2 * H * sizeof(float)) : NULL;
    float *pk = m->span ? malloc((size_t)S2 * H * sizeof(float)) : NULL;
    int *rel = m->span ? malloc((size_t)n * n * sizeof(int)) : NULL;
    float *scratch = malloc(per_head * c->n_heads * sizeof(float));
    int rc = -1;
    if (!q || !k || !v || !ctx || !a || !up || !emb || !scratch || (m->span && (!pq || !pk || !rel))) {
        snprintf(err, errlen, "out of memory encoding %d tokens", n);
        goto out;
    }
    float *row = malloc((size_t)E * sizeof(float));
    if (!row) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        float *e = emb + (size_t)i * E;
        cb_embed(e, &m->word, tokens[i]);
        if (c->position_biased_input) {
            cb_embed(row, &m->position, i < c->max_positions ? i : c->max_positions - 1);
            cb_add(e, row, (size_t)E);
        }
        if (c->type_vocab_size > 0) {
            cb_embed(row, &m->token_type, 0);
            cb_add(e, row, (size_t)E);
        }
    }
    free(row);
    if (E != H) cb_linear_apply(&m->embed_proj, out, emb, n);
    else memcpy(out, emb, nh * sizeof(float));
    for (int i = 0; i < n; i++) cb_layernorm(out + (size_t)i * H, out + (size_t)i * H, m->ln_w, m->ln_b, H, c->eps);
    for (int i = 0; m->span && i < n; i++)
        for (int j = 0; j < n; j++)
            rel[(size_t)i * n + j] = c->position_buckets > 0 ? log_bucket(i - j, c->position_buckets, c->max_relative)
                                                             : i - j;
    for (int l = 0; l < c->n_layers; l++) {
        const cb_deberta_layer *L = &m->layers[l];
        project(q, &L->q, L->bq, out, n);
        project(k, &L->k, L->bk, out, n);
        project(v, &L->v, L->bv, out, n);
        attend_job J = {m, n, q, k, v, NULL, NULL, rel, scratch, per_head, ctx};
        if (m->span && c->c2p) {
            project(pk, c->share_att_key ? &L->k : &L->pos_k, c->share_att_key ? L->bk : L->b_pos_k, m->rel, S2);
            J.pk = pk;
        }
        if (m->span && c->p2c) {
            project(pq, c->share_att_key ? &L->q : &L->pos_q, c->share_att_key ? L->bq : L->b_pos_q, m->rel, S2);
            J.pq = pq;
        }
        cb_parallel_for(c->n_heads, attend_head, &J);
        project(a, &L->o, L->bo, ctx, n);
        cb_add(a, out, nh);
        for (int i = 0; i < n; i++)
            cb_layernorm(a + (size_t)i * H, a + (size_t)i * H, L->ln_attn_w, L->ln_attn_b, H, c->eps);
        project(up, &L->up, L->b_up, a, n);
        cb_gelu(up, (size_t)n * c->inter);
        project(out, &L->down, L->b_down, up, n);
        cb_add(out, a, nh);
        for (int i = 0; i < n; i++)
            cb_layernorm(out + (size_t)i * H, out + (size_t)i * H, L->ln_out_w, L->ln_out_b, H, c->eps);
    }
    rc = 0;
out:
    free(q);
    free(k);
    free(v);
    free(ctx);
    free(a);
    free(up);
    free(emb);
    free(pq);
    free(pk);
    free(rel);
    free(scratch);
    return rc;
}
