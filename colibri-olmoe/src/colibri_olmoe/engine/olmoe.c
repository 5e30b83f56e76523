/* olmoe.c: the OLMoE engine (OlmoeForCausalLM), composed from the shared runtime's blocks.
 *
 * Per layer:  x += o_proj(attention(rope(clip(q_norm(q_proj h))), rope(clip(k_norm(k_proj h))), clip(v_proj h)))
 *             x += moe(rmsnorm(x))                     with h = rmsnorm(x)
 * OLMoE's q_norm/k_norm are RMSNorms over the full projected width (all heads at once), not per head; the
 * router is a softmax over all experts, top-k, renormalised only when norm_topk_prob.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "engine.h"

typedef struct {
    float *attn_norm, *q_norm, *k_norm, *ffn_norm;
    float *bq, *bk, *bv, *bo;  /* only with attention_bias */
    cb_linear wq, wk, wv, wo;
    cb_moe moe;
} olmoe_layer;

typedef struct {
    int hidden, n_layers, n_heads, n_kv_heads, head_dim, inter, n_experts, top_k, norm_topk_prob, vocab;
    int tied, attention_bias, max_batch;
    float eps, clip_qkv;       /* clip_qkv <= 0: no clamp */
    cb_st_index idx;
    cb_linear embed, lm_head;
    float *final_norm;
    olmoe_layer *layers;
    cb_expert_layer **expert_layers;
    cb_rope rope;
    cb_attn_shape attn;
    /* activations for max_batch rows */
    float *x, *h, *q, *k, *v, *qn, *kn, *att, *proj, *scores;
} olmoe;

static void olmoe_free(void *ptr) {
    olmoe *m = ptr;
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->n_layers; l++) {
            olmoe_layer *L = &m->layers[l];
            free(L->attn_norm); free(L->q_norm); free(L->k_norm); free(L->ffn_norm);
            free(L->bq); free(L->bk); free(L->bv); free(L->bo);
            cb_linear_free(&L->wq); cb_linear_free(&L->wk); cb_linear_free(&L->wv); cb_linear_free(&L->wo);
            cb_moe_free(&L->moe);
        }
    free(m->layers);
    free(m->expert_layers);
    cb_linear_free(&m->embed);
    if (!m->tied) cb_linear_free(&m->lm_head);
    free(m->final_norm);
    cb_rope_free(&m->rope);
    free(m->x); free(m->h); free(m->q); free(m->k); free(m->v); free(m->qn); free(m->kn);
    free(m->att); free(m->proj); free(m->scores);
    cb_st_close(&m->idx);
    free(m);
}

static int read_hparams(olmoe *m, cb_hparams *hp, char *err, size_t errlen) {
    m->eps = 1e-5f;
    m->head_dim = 0;
    m->clip_qkv = 0;
    if (cb_hp_int(hp, "hidden_size", &m->hidden, err, errlen) ||
        cb_hp_int(hp, "num_hidden_layers", &m->n_layers, err, errlen) ||
        cb_hp_int(hp, "num_attention_heads", &m->n_heads, err, errlen) ||
        cb_hp_int(hp, "num_key_value_heads", &m->n_kv_heads, err, errlen) ||
        cb_hp_int(hp, "intermediate_size", &m->inter, err, errlen) ||
        cb_hp_int(hp, "num_experts", &m->n_experts, err, errlen) ||
        cb_hp_int(hp, "num_experts_per_tok", &m->top_k, err, errlen) ||
        cb_hp_int(hp, "vocab_size", &m->vocab, err, errlen) ||
        cb_hp_int_opt(hp, "head_dim", &m->head_dim, err, errlen) ||
        cb_hp_float_opt(hp, "rms_norm_eps", &m->eps, err, errlen) ||
        cb_hp_float_opt(hp, "clip_qkv", &m->clip_qkv, err, errlen) ||
        cb_hp_bool_opt(hp, "norm_topk_prob", &m->norm_topk_prob, err, errlen) ||
        cb_hp_bool_opt(hp, "tie_word_embeddings", &m->tied, err, errlen) ||
        cb_hp_bool_opt(hp, "attention_bias", &m->attention_bias, err, errlen))
        return -1;
    if (m->hidden < 1 || m->n_layers < 1 || m->n_heads < 1 || m->n_kv_heads < 1 || m->inter < 1 ||
        m->n_experts < 1 || m->vocab < 1 || m->n_heads % m->n_kv_heads) {
        snprintf(err, errlen, "--set hyperparameters out of range (sizes must be positive and "
                              "num_attention_heads a multiple of num_key_value_heads)");
        return -1;
    }
    if (!m->head_dim) m->head_dim = m->hidden / m->n_heads;
    if (m->head_dim < 2 || m->eps <= 0) {
        snprintf(err, errlen, "--set head_dim / rms_norm_eps out of range");
        return -1;
    }
    return 0;
}

static int load_layer(olmoe *m, int l, int cap, size_t *dense, char *err, size_t errlen) {
    olmoe_layer *L = &m->layers[l];
    const cb_st_index *idx = &m->idx;
    int qw = m->n_heads * m->head_dim, kw = m->n_kv_heads * m->head_dim;
    char name[256];
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix), name)
    if (cb_load_vector(&L->attn_norm, idx, NAME("input_layernorm.weight"), m->hidden, dense, err, errlen) ||
        cb_load_vector(&L->ffn_norm, idx, NAME("post_attention_layernorm.weight"), m->hidden, dense, err,
                       errlen) ||
        cb_load_vector(&L->q_norm, idx, NAME("self_attn.q_norm.weight"), qw, dense, err, errlen) ||
        cb_load_vector(&L->k_norm, idx, NAME("self_attn.k_norm.weight"), kw, dense, err, errlen) ||
        cb_load_linear(&L->wq, idx, NAME("self_attn.q_proj.weight"), qw, m->hidden, dense, err, errlen) ||
        cb_load_linear(&L->wk, idx, NAME("self_attn.k_proj.weight"), kw, m->hidden, dense, err, errlen) ||
        cb_load_linear(&L->wv, idx, NAME("self_attn.v_proj.weight"), kw, m->hidden, dense, err, errlen) ||
        cb_load_linear(&L->wo, idx, NAME("self_attn.o_proj.weight"), m->hidden, qw, dense, err, errlen))
        return -1;
    if (m->attention_bias &&
        (cb_load_vector(&L->bq, idx, NAME("self_attn.q_proj.bias"), qw, dense, err, errlen) ||
         cb_load_vector(&L->bk, idx, NAME("self_attn.k_proj.bias"), kw, dense, err, errlen) ||
         cb_load_vector(&L->bv, idx, NAME("self_attn.v_proj.bias"), kw, dense, err, errlen) ||
         cb_load_vector(&L->bo, idx, NAME("self_attn.o_proj.bias"), m->hidden, dense, err, errlen)))
        return -1;
    static const char *const experts[3] = {
        "model.layers.%d.mlp.experts.%d.gate_proj.weight",
        "model.layers.%d.mlp.experts.%d.up_proj.weight",
        "model.layers.%d.mlp.experts.%d.down_proj.weight",
    };
    if (cb_moe_init(&L->moe, idx, l, NAME("mlp.gate.weight"), experts, m->n_experts, m->top_k, m->norm_topk_prob,
                    m->hidden, m->inter, cap, m->max_batch, dense, err, errlen))
        return -1;
#undef NAME
    m->expert_layers[l] = &L->moe.store;
    return 0;
}

static int olmoe_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    olmoe *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m->max_batch = a->max_batch;
    if (read_hparams(m, a->hp, err, errlen) || cb_rope_init(&m->rope, a->hp, m->head_dim, 1, err, errlen))
        goto fail;
    if (cb_st_open(&m->idx, a->model_dir, err, errlen)) goto fail;
    size_t dense = 0;
    if (cb_load_linear(&m->embed, &m->idx, "model.embed_tokens.weight", m->vocab, m->hidden, &dense, err,
                       errlen) ||
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
        if (load_layer(m, l, a->cap, &dense, err, errlen)) goto fail;
        cache += cb_experts_cache_bytes(&m->layers[l].moe.store);
    }
    size_t B = (size_t)m->max_batch, qw = (size_t)(m->n_heads * m->head_dim), kw = (size_t)(m->n_kv_heads * m->head_dim);
    m->x = malloc(B * (size_t)m->hidden * sizeof(float));
    m->h = malloc(B * (size_t)m->hidden * sizeof(float));
    m->proj = malloc(B * (size_t)m->hidden * sizeof(float));
    m->q = malloc(B * qw * sizeof(float));
    m->qn = malloc(B * qw * sizeof(float));
    m->att = malloc(B * qw * sizeof(float));
    m->k = malloc(B * kw * sizeof(float));
    m->kn = malloc(B * kw * sizeof(float));
    m->v = malloc(B * kw * sizeof(float));
    m->scores = cb_attn_scratch(m->max_batch, m->n_heads, a->ctx);
    if (!m->x || !m->h || !m->proj || !m->q || !m->qn || !m->att || !m->k || !m->kn || !m->v || !m->scores) {
        snprintf(err, errlen, "out of memory for activations");
        goto fail;
    }
    m->attn = (cb_attn_shape){m->n_heads, m->n_kv_heads, m->head_dim, 1.0f / sqrtf((float)m->head_dim)};
    info->vocab = m->vocab;
    info->n_layers = m->n_layers;
    info->kv_dim = (int)kw;
    info->dense_bytes = dense;
    info->expert_cache_bytes = cache + cb_experts_staging_bytes();
    info->n_expert_layers = m->n_layers;
    info->expert_layers = m->expert_layers;
    *out = m;
    return 0;
fail:
    olmoe_free(m);
    return -1;
}

static void add_bias(float *y, const float *b, int n, int width) {
    if (!b) return;
    for (int i = 0; i < n; i++) cb_add(y + (size_t)i * (size_t)width, b, (size_t)width);
}

static int olmoe_forward(void *ptr, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                         char *err, size_t errlen) {
    olmoe *m = ptr;
    int H = m->hidden, qw = m->n_heads * m->head_dim, kw = m->n_kv_heads * m->head_dim;
    for (int i = 0; i < n; i++) cb_embed(m->x + (size_t)i * H, &m->embed, tokens[i]);
    for (int l = 0; l < m->n_layers; l++) {
        olmoe_layer *L = &m->layers[l];
        for (int i = 0; i < n; i++) cb_rmsnorm(m->h + (size_t)i * H, m->x + (size_t)i * H, L->attn_norm, H, m->eps);
        cb_linear_apply(&L->wq, m->q, m->h, n);
        cb_linear_apply(&L->wk, m->k, m->h, n);
        cb_linear_apply(&L->wv, m->v, m->h, n);
        add_bias(m->q, L->bq, n, qw);
        add_bias(m->k, L->bk, n, kw);
        add_bias(m->v, L->bv, n, kw);
        for (int i = 0; i < n; i++) {
            float *q = m->qn + (size_t)i * qw, *k = m->kn + (size_t)i * kw;
            cb_rmsnorm(q, m->q + (size_t)i * qw, L->q_norm, qw, m->eps);
            cb_rmsnorm(k, m->k + (size_t)i * kw, L->k_norm, kw, m->eps);
            if (m->clip_qkv > 0) {
                cb_clamp(q, (size_t)qw, m->clip_qkv);
                cb_clamp(k, (size_t)kw, m->clip_qkv);
                cb_clamp(m->v + (size_t)i * kw, (size_t)kw, m->clip_qkv);
            }
            cb_rope_apply(&m->rope, q, m->n_heads, m->head_dim, pos0 + i);
            cb_rope_apply(&m->rope, k, m->n_kv_heads, m->head_dim, pos0 + i);
        }
        cb_kv_store(kv, l, pos0, n, m->kn, m->v);
        cb_attend(m->att, m->qn, kv, l, pos0, n, &m->attn, m->scores);
        cb_linear_apply(&L->wo, m->proj, m->att, n);
        add_bias(m->proj, L->bo, n, H);
        cb_add(m->x, m->proj, (size_t)n * H);
        for (int i = 0; i < n; i++) cb_rmsnorm(m->h + (size_t)i * H, m->x + (size_t)i * H, L->ffn_norm, H, m->eps);
        if (cb_moe_forward(&L->moe, m->proj, m->h, n, err, errlen)) return -1;
        cb_add(m->x, m->proj, (size_t)n * H);
    }
    int first = all_logits ? 0 : n - 1, rows = n - first;
    for (int i = first; i < n; i++)
        cb_rmsnorm(m->h + (size_t)(i - first) * H, m->x + (size_t)i * H, m->final_norm, H, m->eps);
    cb_linear_apply(&m->lm_head, logits, m->h, rows);
    return 0;
}

static const cb_family olmoe_family = {"olmoe", olmoe_load, olmoe_forward, olmoe_free};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &olmoe_family); }
