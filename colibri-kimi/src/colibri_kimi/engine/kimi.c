/* kimi.c: the Kimi K2 engine (DeepSeek-V3 architecture under model_type kimi_k2), composed from the shared
 * runtime's blocks. This package ships its own composition so that colibri-kimi alone runs Kimi K2.
 *
 *   attention = MLA over the compressed cache (mla.h), interleaved RoPE on the rope part unless rope_interleave=0
 *
 * Every layer:  x += attention(rmsnorm(x));  x += mlp(rmsnorm(x))
 * where mlp is a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE with shared experts
 * (grouped_moe.h). Multi-token-prediction layers stored after the last decoder layer are never loaded.
 * The plugin resolves config.json into --set values; mlp_layers has one letter per layer (D dense, M MoE).
 * Kimi Linear (KDA + NoPE MLA) is its own composition in kimi_linear.c; main() below dispatches on model_type.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "engine.h"
#include "grouped_moe.h"
#include "kimi_linear.h"
#include "mla.h"
#include "swiglu.h"

typedef struct {
    float *attn_norm, *ffn_norm;
    cb_mla mla;
    int is_moe;
    cb_swiglu dense;
    cb_grouped_moe moe;
} kimi_layer;

typedef struct {
    int hidden, n_layers, vocab, tied, max_batch, ctx, inter;
    float eps;
    cb_mla_shape mla;
    int kv_width;
    cb_grouped_moe_shape moe;
    cb_st_index idx;
    cb_linear embed, lm_head;
    float *final_norm;
    kimi_layer *layers;
    cb_expert_layer **expert_layers;
    int n_expert_layers;
    cb_rope rope;
    float *x, *h, *proj;
} kimi;

static void kimi_free(void *ptr) {
    kimi *m = ptr;
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->n_layers; l++) {
            kimi_layer *L = &m->layers[l];
            free(L->attn_norm); free(L->ffn_norm);
            cb_mla_free(&L->mla);
            if (L->is_moe) cb_grouped_moe_free(&L->moe);
            else cb_swiglu_free(&L->dense);
        }
    free(m->layers);
    free(m->expert_layers);
    cb_linear_free(&m->embed);
    if (!m->tied) cb_linear_free(&m->lm_head);
    free(m->final_norm);
    cb_rope_free(&m->rope);
    free(m->x); free(m->h); free(m->proj);
    cb_st_close(&m->idx);
    free(m);
}

static int read_hparams(kimi *m, cb_hparams *hp, const char **mlp_layers, char *err, size_t errlen) {
    m->eps = 1e-6f;
    m->moe.norm_topk_prob = 1;
    m->moe.n_group = m->moe.topk_group = 1;
    m->moe.routed_scaling_factor = 1.0f;
    cb_mla_shape *s = &m->mla;
    if (cb_hp_int(hp, "hidden_size", &m->hidden, err, errlen) ||
        cb_hp_int(hp, "num_hidden_layers", &m->n_layers, err, errlen) ||
        cb_hp_int(hp, "num_attention_heads", &s->n_heads, err, errlen) ||
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
        cb_hp_bool_opt(hp, "attention_bias", &s->bias, err, errlen) ||
        cb_hp_int_opt(hp, "q_lora_rank", &s->q_lora, err, errlen) ||
        cb_hp_int(hp, "kv_lora_rank", &s->kv_lora, err, errlen) ||
        cb_hp_int(hp, "qk_nope_head_dim", &s->nope, err, errlen) ||
        cb_hp_int(hp, "qk_rope_head_dim", &s->rope, err, errlen) ||
        cb_hp_int(hp, "v_head_dim", &s->v_dim, err, errlen))
        return -1;
    if (m->hidden < 1 || m->n_layers < 1 || s->n_heads < 1 || m->vocab < 1 || m->inter < 1 || m->moe.inter < 1 ||
        m->moe.n_shared < 0 || m->eps <= 0) {
        snprintf(err, errlen, "--set hyperparameters out of range (sizes must be positive)");
        return -1;
    }
    m->moe.hidden = s->hidden = m->hidden;
    s->lora_eps = 1e-6f;
    s->scale = 1.0f / sqrtf((float)(s->nope + s->rope));
    if (cb_hp_float_opt(hp, "attention_scale", &s->scale, err, errlen)) return -1;
    m->kv_width = s->kv_lora + s->rope;
    *mlp_layers = cb_hp_str_opt(hp, "mlp_layers", NULL);
    if (!*mlp_layers || (int)strlen(*mlp_layers) != m->n_layers || strspn(*mlp_layers, "DM") != strlen(*mlp_layers)) {
        snprintf(err, errlen, "--set mlp_layers: needs exactly %d letters, D (dense) or M (MoE), one per layer",
                 m->n_layers);
        return -1;
    }
    return 0;
}

static int load_layer(kimi *m, int l, char mlp, int cap, size_t *dense, char *err, size_t errlen) {
    kimi_layer *L = &m->layers[l];
    char name[256];
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    if (cb_load_vector(&L->attn_norm, &m->idx, name, m->hidden, dense, err, errlen)) return -1;
    snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
    if (cb_load_vector(&L->ffn_norm, &m->idx, name, m->hidden, dense, err, errlen)) return -1;
    snprintf(name, sizeof name, "model.layers.%d.self_attn.", l);
    if (cb_mla_init(&L->mla, &m->idx, name, &m->mla, m->max_batch, m->ctx, dense, err, errlen)) return -1;
    if (mlp == 'M') {
        if (cb_grouped_moe_init(&L->moe, &m->idx, l, "model.layers.%d.mlp.", &m->moe, 1, cap, m->max_batch, dense,
                                err, errlen))
            return -1;
        L->is_moe = 1;
        m->expert_layers[m->n_expert_layers++] = &L->moe.moe.store;
        return 0;
    }
    snprintf(name, sizeof name, "model.layers.%d.mlp.", l);
    return cb_swiglu_init(&L->dense, &m->idx, name, m->hidden, m->inter, m->max_batch, dense, err, errlen);
}

static int kimi_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    kimi *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m->max_batch = a->max_batch;
    m->ctx = a->ctx;
    const char *mlp_layers = NULL;
    if (read_hparams(m, a->hp, &mlp_layers, err, errlen)) goto fail;
    int interleave = 1;
    if (cb_hp_bool_opt(a->hp, "rope_interleave", &interleave, err, errlen)) goto fail;
    if (cb_rope_init(&m->rope, a->hp, m->mla.rope, !interleave, err, errlen)) goto fail;
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
        if (load_layer(m, l, mlp_layers[l], a->cap, &dense, err, errlen)) goto fail;
        if (m->layers[l].is_moe) cache += cb_experts_cache_bytes(&m->layers[l].moe.moe.store);
    }
    size_t B = (size_t)m->max_batch, H = (size_t)m->hidden;
    m->x = malloc(B * H * sizeof(float));
    m->h = malloc(B * H * sizeof(float));
    m->proj = malloc(B * H * sizeof(float));
    if (!m->x || !m->h || !m->proj) goto oom;
    info->vocab = m->vocab;
    info->n_layers = m->n_layers;
    info->kv_dim = m->kv_width;
    info->kv_k_only = 1;
    info->dense_bytes = dense;
    info->expert_cache_bytes = cache + cb_experts_staging_bytes();
    info->n_expert_layers = m->n_expert_layers;
    info->expert_layers = m->expert_layers;
    *out = m;
    return 0;
oom:
    snprintf(err, errlen, "out of memory for activations");
fail:
    kimi_free(m);
    return -1;
}

static int kimi_forward(void *ptr, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                      char *err, size_t errlen) {
    kimi *m = ptr;
    int H = m->hidden;
    for (int i = 0; i < n; i++) cb_embed(m->x + (size_t)i * H, &m->embed, tokens[i]);
    for (int l = 0; l < m->n_layers; l++) {
        kimi_layer *L = &m->layers[l];
        for (int i = 0; i < n; i++) cb_rmsnorm(m->h + (size_t)i * H, m->x + (size_t)i * H, L->attn_norm, H, m->eps);
        cb_mla_project(&L->mla, m->h, n, pos0, kv, l, &m->rope);
        cb_mla_attend(&L->mla, m->proj, n, pos0, kv, l, NULL, NULL, 0);
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

static const cb_family kimi_k2_family = {"kimi", kimi_load, kimi_forward, kimi_free};

/* One binary runs both model types: --set model_type=kimi_linear (from the plugin) selects kimi_linear.c. */
typedef struct {
    const cb_family *impl;
    void *model;
} kimi_any;

static int any_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    const char *type = cb_hp_str_opt(a->hp, "model_type", "kimi_k2");
    const cb_family *impl = !strcmp(type, "kimi_k2") ? &kimi_k2_family
                          : !strcmp(type, "kimi_linear") ? &cb_kimi_linear_family : NULL;
    if (!impl) {
        snprintf(err, errlen, "--set model_type=%s: the kimi engine runs kimi_k2 and kimi_linear", type);
        return -1;
    }
    kimi_any *w = calloc(1, sizeof *w);
    if (!w) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    w->impl = impl;
    if (impl->load(&w->model, a, info, err, errlen)) {
        free(w);
        return -1;
    }
    *out = w;
    return 0;
}

static int any_forward(void *ptr, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                       char *err, size_t errlen) {
    kimi_any *w = ptr;
    return w->impl->forward(w->model, kv, tokens, n, pos0, logits, all_logits, err, errlen);
}

static void any_free(void *ptr) {
    kimi_any *w = ptr;
    if (!w) return;
    w->impl->free(w->model);
    free(w);
}

static const cb_family kimi_family = {"kimi", any_load, any_forward, any_free};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &kimi_family); }
