/* glm.c: the GLM MoE engines, composed from the shared runtime's blocks.
 *
 *   glm4_moe       (GLM-4.5/4.6/4.7)  attention = GQA, qkv bias, optional per-head q/k RMSNorm, partial half-split RoPE
 *   glm4_moe_lite  (GLM-4.7-Flash)    attention = MLA over the compressed cache (mla.h)
 *   glm_moe_dsa    (GLM-5)            attention = MLA restricted to the DSA indexer's top-k positions (dsa.h)
 *
 * Every layer:  x += attention(rmsnorm(x));  x += mlp(rmsnorm(x))
 * where mlp is a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE with shared experts
 * (grouped_moe.h). Multi-token-prediction layers stored after the last decoder layer are never loaded.
 *
 * The plugin resolves config.json into --set values; per-layer kinds arrive as strings with one letter per layer:
 * mlp_layers (D dense, M MoE) and, for DSA, indexer_layers (F runs its own indexer, S reuses the previous one's).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "dsa.h"
#include "engine.h"
#include "grouped_moe.h"
#include "mla.h"
#include "swiglu.h"

typedef enum { ATTN_GQA = 0, ATTN_MLA = 1, ATTN_DSA = 2 } attn_kind;

typedef struct {
    float *attn_norm, *ffn_norm;
    /* GQA */
    cb_linear wq, wk, wv, wo;
    float *bq, *bk, *bv, *q_norm, *k_norm;
    /* MLA / DSA */
    cb_mla mla;
    int has_indexer;
    cb_dsa dsa;
    /* MLP */
    int is_moe;
    cb_swiglu dense;
    cb_grouped_moe moe;
} glm_layer;

typedef struct {
    attn_kind attn;
    int hidden, n_layers, vocab, tied, max_batch, ctx;
    float eps;
    /* GQA */
    int n_heads, n_kv_heads, head_dim, attention_bias, qk_norm;
    /* MLA */
    cb_mla_shape mla;
    cb_dsa_shape dsa;
    int kv_width, index_col;
    /* MLP */
    int inter;
    cb_grouped_moe_shape moe;
    cb_st_index idx;
    cb_linear embed, lm_head;
    float *final_norm;
    glm_layer *layers;
    cb_expert_layer **expert_layers;
    int n_expert_layers;
    cb_rope rope;
    cb_attn_shape gqa;
    /* activations for max_batch rows */
    float *x, *h, *q, *k, *v, *att, *proj, *scores;
    int *sel, *n_sel;          /* DSA: the current selection, carried across "shared" layers */
} glm;

static void glm_free(void *ptr) {
    glm *m = ptr;
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->n_layers; l++) {
            glm_layer *L = &m->layers[l];
            free(L->attn_norm); free(L->ffn_norm);
            cb_linear_free(&L->wq); cb_linear_free(&L->wk); cb_linear_free(&L->wv); cb_linear_free(&L->wo);
            free(L->bq); free(L->bk); free(L->bv); free(L->q_norm); free(L->k_norm);
            if (m->attn != ATTN_GQA) cb_mla_free(&L->mla);
            if (L->has_indexer) cb_dsa_free(&L->dsa);
            if (L->is_moe) cb_grouped_moe_free(&L->moe);
            else cb_swiglu_free(&L->dense);
        }
    free(m->layers);
    free(m->expert_layers);
    cb_linear_free(&m->embed);
    if (!m->tied) cb_linear_free(&m->lm_head);
    free(m->final_norm);
    cb_rope_free(&m->rope);
    free(m->x); free(m->h); free(m->q); free(m->k); free(m->v); free(m->att); free(m->proj); free(m->scores);
    free(m->sel); free(m->n_sel);
    cb_st_close(&m->idx);
    free(m);
}

/* A per-layer kind string: exactly n_layers letters from `allowed`. */
static const char *layer_letters(cb_hparams *hp, const char *key, int n_layers, const char *allowed, char *err,
                                 size_t errlen) {
    const char *s = cb_hp_str_opt(hp, key, NULL);
    if (!s) {
        snprintf(err, errlen, "missing --set %s=<one of %s per layer>", key, allowed);
        return NULL;
    }
    if ((int)strlen(s) != n_layers || strspn(s, allowed) != strlen(s)) {
        snprintf(err, errlen, "--set %s=%s: needs exactly %d letters from %s", key, s, n_layers, allowed);
        return NULL;
    }
    return s;
}

static int read_hparams(glm *m, cb_hparams *hp, const char **mlp_layers, const char **indexer_layers, char *err,
                        size_t errlen) {
    const char *attn = cb_hp_str_opt(hp, "attention", "gqa");
    if (!strcmp(attn, "gqa")) m->attn = ATTN_GQA;
    else if (!strcmp(attn, "mla")) m->attn = ATTN_MLA;
    else if (!strcmp(attn, "dsa")) m->attn = ATTN_DSA;
    else {
        snprintf(err, errlen, "--set attention=%s: expected gqa, mla or dsa", attn);
        return -1;
    }
    m->eps = 1e-5f;
    m->moe.norm_topk_prob = 1;
    m->moe.n_group = m->moe.topk_group = 1;
    m->moe.routed_scaling_factor = 1.0f;
    if (cb_hp_int(hp, "hidden_size", &m->hidden, err, errlen) ||
        cb_hp_int(hp, "num_hidden_layers", &m->n_layers, err, errlen) ||
        cb_hp_int(hp, "num_attention_heads", &m->n_heads, err, errlen) ||
        cb_hp_int(hp, "vocab_size", &m->vocab, err, errlen) ||
        cb_hp_int(hp, "intermediate_size", &m->inter, err, errlen) ||
        cb_hp_int(hp, "moe_intermediate_size", &m->moe.inter, err, errlen) ||
        cb_hp_int(hp, "n_routed_experts", &m->moe.n_experts, err, errlen) ||
        cb_hp_int(hp, "num_experts_per_tok", &m->moe.top_k, err, errlen) ||
        cb_hp_int_opt(hp, "n_shared_experts", &m->moe.n_shared, err, errlen) ||
        cb_hp_int_opt(hp, "n_group", &m->moe.n_group, err, errlen) ||
        cb_hp_int_opt(hp, "topk_group", &m->moe.topk_group, err, errlen) ||
        cb_hp_bool_opt(hp, "norm_topk_prob", &m->moe.norm_topk_prob, err, errlen) ||
        cb_hp_float_opt(hp, "routed_scaling_factor", &m->moe.routed_scaling_factor, err, errlen) ||
        cb_hp_float_opt(hp, "rms_norm_eps", &m->eps, err, errlen) ||
        cb_hp_bool_opt(hp, "tie_word_embeddings", &m->tied, err, errlen) ||
        cb_hp_bool_opt(hp, "attention_bias", &m->attention_bias, err, errlen))
        return -1;
    if (m->hidden < 1 || m->n_layers < 1 || m->n_heads < 1 || m->vocab < 1 || m->inter < 1 || m->moe.inter < 1 ||
        m->moe.n_shared < 0 || m->eps <= 0) {
        snprintf(err, errlen, "--set hyperparameters out of range (sizes must be positive)");
        return -1;
    }
    m->moe.hidden = m->hidden;
    if (!(*mlp_layers = layer_letters(hp, "mlp_layers", m->n_layers, "DM", err, errlen))) return -1;
    if (m->attn == ATTN_GQA) {
        m->n_kv_heads = m->n_heads;
        m->head_dim = 0;
        if (cb_hp_int_opt(hp, "num_key_value_heads", &m->n_kv_heads, err, errlen) ||
            cb_hp_int_opt(hp, "head_dim", &m->head_dim, err, errlen) ||
            cb_hp_bool_opt(hp, "use_qk_norm", &m->qk_norm, err, errlen))
            return -1;
        if (!m->head_dim) m->head_dim = m->hidden / m->n_heads;
        if (m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads || m->head_dim < 2) {
            snprintf(err, errlen, "--set num_key_value_heads must divide num_attention_heads; head_dim >= 2");
            return -1;
        }
        m->kv_width = m->n_kv_heads * m->head_dim;
        return 0;
    }
    cb_mla_shape *s = &m->mla;
    s->hidden = m->hidden;
    s->n_heads = m->n_heads;
    s->bias = m->attention_bias;
    s->lora_eps = 1e-6f;
    if (cb_hp_int_opt(hp, "q_lora_rank", &s->q_lora, err, errlen) ||
        cb_hp_int(hp, "kv_lora_rank", &s->kv_lora, err, errlen) ||
        cb_hp_int(hp, "qk_nope_head_dim", &s->nope, err, errlen) ||
        cb_hp_int(hp, "qk_rope_head_dim", &s->rope, err, errlen) ||
        cb_hp_int(hp, "v_head_dim", &s->v_dim, err, errlen))
        return -1;
    s->scale = 1.0f / sqrtf((float)(s->nope + s->rope));
    if (cb_hp_float_opt(hp, "attention_scale", &s->scale, err, errlen)) return -1;
    m->kv_width = s->kv_lora + s->rope;
    if (m->attn == ATTN_MLA) return 0;
    cb_dsa_shape *d = &m->dsa;
    d->hidden = m->hidden;
    d->q_lora = s->q_lora;
    d->rope_dim = s->rope;
    if (cb_hp_int(hp, "index_n_heads", &d->n_heads, err, errlen) ||
        cb_hp_int(hp, "index_head_dim", &d->head_dim, err, errlen) ||
        cb_hp_int(hp, "index_topk", &d->topk, err, errlen))
        return -1;
    if (!(*indexer_layers = layer_letters(hp, "indexer_layers", m->n_layers, "FS", err, errlen))) return -1;
    if ((*indexer_layers)[0] != 'F') {
        snprintf(err, errlen, "--set indexer_layers=%s: the first layer must run its own indexer (F)",
                 *indexer_layers);
        return -1;
    }
    m->index_col = m->kv_width;
    m->kv_width += d->head_dim;
    return 0;
}

static int load_gqa(glm *m, glm_layer *L, int l, size_t *dense, char *err, size_t errlen) {
    const cb_st_index *idx = &m->idx;
    int qw = m->n_heads * m->head_dim, kw = m->kv_width;
    char name[256];
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", l, suffix), name)
    if (cb_load_linear(&L->wq, idx, NAME("q_proj.weight"), qw, m->hidden, dense, err, errlen) ||
        cb_load_linear(&L->wk, idx, NAME("k_proj.weight"), kw, m->hidden, dense, err, errlen) ||
        cb_load_linear(&L->wv, idx, NAME("v_proj.weight"), kw, m->hidden, dense, err, errlen) ||
        cb_load_linear(&L->wo, idx, NAME("o_proj.weight"), m->hidden, qw, dense, err, errlen))
        return -1;
    if (m->attention_bias &&
        (cb_load_vector(&L->bq, idx, NAME("q_proj.bias"), qw, dense, err, errlen) ||
         cb_load_vector(&L->bk, idx, NAME("k_proj.bias"), kw, dense, err, errlen) ||
         cb_load_vector(&L->bv, idx, NAME("v_proj.bias"), kw, dense, err, errlen)))
        return -1;
    if (m->qk_norm &&
        (cb_load_vector(&L->q_norm, idx, NAME("q_norm.weight"), m->head_dim, dense, err, errlen) ||
         cb_load_vector(&L->k_norm, idx, NAME("k_norm.weight"), m->head_dim, dense, err, errlen)))
        return -1;
#undef NAME
    return 0;
}

static int load_layer(glm *m, int l, char mlp, char indexer, int cap, size_t *dense, char *err, size_t errlen) {
    glm_layer *L = &m->layers[l];
    char name[256];
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    if (cb_load_vector(&L->attn_norm, &m->idx, name, m->hidden, dense, err, errlen)) return -1;
    snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
    if (cb_load_vector(&L->ffn_norm, &m->idx, name, m->hidden, dense, err, errlen)) return -1;
    if (m->attn == ATTN_GQA) {
        if (load_gqa(m, L, l, dense, err, errlen)) return -1;
    } else {
        snprintf(name, sizeof name, "model.layers.%d.self_attn.", l);
        if (cb_mla_init(&L->mla, &m->idx, name, &m->mla, m->max_batch, m->ctx, dense, err, errlen)) return -1;
        if (m->attn == ATTN_DSA && indexer == 'F') {
            snprintf(name, sizeof name, "model.layers.%d.self_attn.indexer.", l);
            if (cb_dsa_init(&L->dsa, &m->idx, name, &m->dsa, m->max_batch, m->ctx, dense, err, errlen)) return -1;
            L->has_indexer = 1;
        }
    }
    if (mlp == 'M') {
        if (cb_grouped_moe_init(&L->moe, &m->idx, l, "model.layers.%d.mlp.", &m->moe, 1, cap, m->max_batch, dense,
                                err, errlen))
            return -1;
        L->is_moe = 1;
        m->expert_layers[m->n_expert_layers++] = &L->moe.moe.store;
    } else {
        snprintf(name, sizeof name, "model.layers.%d.mlp.", l);
        if (cb_swiglu_init(&L->dense, &m->idx, name, m->hidden, m->inter, m->max_batch, dense, err, errlen))
            return -1;
    }
    return 0;
}

static int glm_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    glm *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m->max_batch = a->max_batch;
    m->ctx = a->ctx;
    const char *mlp_layers = NULL, *indexer_layers = NULL;
    if (read_hparams(m, a->hp, &mlp_layers, &indexer_layers, err, errlen)) goto fail;
    /* GLM-4.5 rotates half-split pairs; the MLA models rotate interleaved pairs unless rope_interleave=0. */
    int interleave = m->attn != ATTN_GQA;
    if (m->attn == ATTN_MLA && cb_hp_bool_opt(a->hp, "rope_interleave", &interleave, err, errlen)) goto fail;
    if (cb_rope_init(&m->rope, a->hp, m->attn == ATTN_GQA ? m->head_dim : m->mla.rope, !interleave, err, errlen))
        goto fail;
    if (cb_st_open(&m->idx, a->model_dir, err, errlen)) goto fail;
    size_t dense = 0;
    if (cb_load_linear(&m->embed, &m->idx, "model.embed_tokens.weight", m->vocab, m->hidden, &dense, err, errlen) ||
        cb_load_vector(&m->final_norm, &m->idx, "model.norm.weight", m->hidden, &dense, err, errlen))
        goto fail;
    if (m->tied) m->lm_head = m->embed;
    else if (cb_load_linear(&m->lm_head, &m->idx, "lm_head.weight", m->vocab, m->hidden, &dense, err, errlen))
        goto fail;
    m->layers = calloc((size_t)m->n_layers, sizeof *m->layers);
    m->expert_layers = calloc((size_t)m->n_layers, sizeof *m->expert_layers);
    if (!m->layers || !m->expert_layers) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    size_t cache = 0;
    for (int l = 0; l < m->n_layers; l++) {
        if (load_layer(m, l, mlp_layers[l], indexer_layers ? indexer_layers[l] : 0, a->cap, &dense, err, errlen))
            goto fail;
        if (m->layers[l].is_moe) cache += cb_experts_cache_bytes(&m->layers[l].moe.moe.store);
    }
    size_t B = (size_t)m->max_batch, H = (size_t)m->hidden;
    m->x = malloc(B * H * sizeof(float));
    m->h = malloc(B * H * sizeof(float));
    m->proj = malloc(B * H * sizeof(float));
    if (!m->x || !m->h || !m->proj) goto oom;
    if (m->attn == ATTN_GQA) {
        size_t qw = (size_t)(m->n_heads * m->head_dim), kw = (size_t)m->kv_width;
        m->q = malloc(B * qw * sizeof(float));
        m->att = malloc(B * qw * sizeof(float));
        m->k = malloc(B * kw * sizeof(float));
        m->v = malloc(B * kw * sizeof(float));
        m->scores = cb_attn_scratch(m->max_batch, m->n_heads, a->ctx);
        if (!m->q || !m->att || !m->k || !m->v || !m->scores) goto oom;
        m->gqa = (cb_attn_shape){m->n_heads, m->n_kv_heads, m->head_dim, 1.0f / sqrtf((float)m->head_dim)};
    } else if (m->attn == ATTN_DSA) {
        m->sel = malloc(B * (size_t)m->dsa.topk * sizeof(int));
        m->n_sel = malloc(B * sizeof(int));
        if (!m->sel || !m->n_sel) goto oom;
    }
    info->vocab = m->vocab;
    info->n_layers = m->n_layers;
    info->kv_dim = m->kv_width;
    info->kv_k_only = m->attn != ATTN_GQA;
    info->dense_bytes = dense;
    info->expert_cache_bytes = cache + cb_experts_staging_bytes();
    info->n_expert_layers = m->n_expert_layers;
    info->expert_layers = m->expert_layers;
    *out = m;
    return 0;
oom:
    snprintf(err, errlen, "out of memory for activations");
fail:
    glm_free(m);
    return -1;
}

static void add_bias(float *y, const float *b, int n, int width) {
    if (!b) return;
    for (int i = 0; i < n; i++) cb_add(y + (size_t)i * (size_t)width, b, (size_t)width);
}

/* GLM-4.5 attention: biased projections, optional per-head q/k RMSNorm, half-split partial RoPE. */
static void gqa_forward(glm *m, glm_layer *L, cb_kv *kv, int l, int n, int pos0) {
    int qw = m->n_heads * m->head_dim, kw = m->kv_width, hd = m->head_dim;
    cb_linear_apply(&L->wq, m->q, m->h, n);
    cb_linear_apply(&L->wk, m->k, m->h, n);
    cb_linear_apply(&L->wv, m->v, m->h, n);
    add_bias(m->q, L->bq, n, qw);
    add_bias(m->k, L->bk, n, kw);
    add_bias(m->v, L->bv, n, kw);
    for (int i = 0; i < n; i++) {
        float *q = m->q + (size_t)i * qw, *k = m->k + (size_t)i * kw;
        if (m->qk_norm) {
            for (int h = 0; h < m->n_heads; h++) cb_rmsnorm(q + h * hd, q + h * hd, L->q_norm, hd, m->eps);
            for (int h = 0; h < m->n_kv_heads; h++) cb_rmsnorm(k + h * hd, k + h * hd, L->k_norm, hd, m->eps);
        }
        cb_rope_apply(&m->rope, q, m->n_heads, hd, pos0 + i);
        cb_rope_apply(&m->rope, k, m->n_kv_heads, hd, pos0 + i);
    }
    cb_kv_store(kv, l, pos0, n, m->k, m->v);
    cb_attend(m->att, m->q, kv, l, pos0, n, &m->gqa, m->scores);
    cb_linear_apply(&L->wo, m->proj, m->att, n);
}

static void latent_forward(glm *m, glm_layer *L, cb_kv *kv, int l, int n, int pos0) {
    cb_mla_project(&L->mla, m->h, n, pos0, kv, l, &m->rope);
    if (m->attn == ATTN_MLA) {
        cb_mla_attend(&L->mla, m->proj, n, pos0, kv, l, NULL, NULL, 0);
        return;
    }
    /* A shared layer keeps the selection of the last layer that ran its indexer (m->sel persists). */
    if (L->has_indexer)
        cb_dsa_select(&L->dsa, m->h, L->mla.q_resid, n, pos0, kv, l, m->index_col, &m->rope, m->sel, m->n_sel);
    cb_mla_attend(&L->mla, m->proj, n, pos0, kv, l, m->sel, m->n_sel, m->dsa.topk);
}

static int glm_forward(void *ptr, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                       char *err, size_t errlen) {
    glm *m = ptr;
    int H = m->hidden;
    for (int i = 0; i < n; i++) cb_embed(m->x + (size_t)i * H, &m->embed, tokens[i]);
    for (int l = 0; l < m->n_layers; l++) {
        glm_layer *L = &m->layers[l];
        for (int i = 0; i < n; i++) cb_rmsnorm(m->h + (size_t)i * H, m->x + (size_t)i * H, L->attn_norm, H, m->eps);
        if (m->attn == ATTN_GQA) gqa_forward(m, L, kv, l, n, pos0);
        else latent_forward(m, L, kv, l, n, pos0);
        cb_add(m->x, m->proj, (size_t)n * H);
        for (int i = 0; i < n; i++) cb_rmsnorm(m->h + (size_t)i * H, m->x + (size_t)i * H, L->ffn_norm, H, m->eps);
        if (L->is_moe) {
            if (cb_grouped_moe_forward(&L->moe, m->proj, m->h, n, err, errlen)) return -1;
        } else {
            cb_swiglu_forward(&L->dense, m->proj, m->h, n);
        }
        cb_add(m->x, m->proj, (size_t)n * H);
    }
    int first = all_logits ? 0 : n - 1, rows = n - first;
    for (int i = first; i < n; i++)
        cb_rmsnorm(m->h + (size_t)(i - first) * H, m->x + (size_t)i * H, m->final_norm, H, m->eps);
    cb_linear_apply(&m->lm_head, logits, m->h, rows);
    return 0;
}

static const cb_family glm_family = {"glm", glm_load, glm_forward, glm_free};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &glm_family); }
