/* kimi_linear.c: the Kimi Linear engine (model_type kimi_linear), composed from the shared runtime's blocks.
 * kimi.c's main() hands a model to this family when the plugin passes --set model_type=kimi_linear.
 *
 * Every layer:  x += mixer(rmsnorm(x));  x += mlp(rmsnorm(x))
 *   mixer: Kimi Delta Attention (kda.h) on linear layers, MLA without RoPE (mla.h, rope NULL) on full layers
 *   mlp:   a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE + shared experts (grouped_moe.h),
 *          under block_sparse_moe. with experts stored as w1 (gate) / w3 (up) / w2 (down)
 * Only MLA layers hold KV (the compressed latent); each KDA layer keeps its conv windows and delta-rule memory in
 * the slot's recurrent state. The plugin resolves config.json into --set values: attn_layers has one letter per
 * layer (K KDA, F full MLA), mlp_layers one per layer (D dense, M MoE).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "engine.h"
#include "grouped_moe.h"
#include "kda.h"
#include "kimi_linear.h"
#include "mla.h"
#include "swiglu.h"

typedef struct {
    int full, is_moe;
    float *attn_norm, *ffn_norm;
    cb_mla mla;                /* full layers */
    int kv_layer;
    cb_linear q, k, v, f_a, f_b, b, g_a, g_b, o;   /* KDA layers */
    cb_kda kda;
    size_t state_off;          /* floats into the slot state */
    cb_swiglu dense;
    cb_grouped_moe moe;
} kl_layer;

typedef struct {
    int hidden, n_layers, vocab, tied, max_batch, ctx, inter, n_full, n_expert_layers;
    float eps;
    cb_mla_shape mla;
    cb_kda_config kda;
    cb_grouped_moe_shape moe;
    cb_st_index idx;
    cb_linear embed, lm_head;
    float *final_norm;
    kl_layer *layers;
    cb_expert_layer **expert_layers;
    float *x, *h, *proj, *lx, *lf, *lb, *lg, *lo, *low;
} kimi_linear;

/* Kimi Linear's experts: gate, up, down are w1, w3, w2. */
static const char *const EXPERT_MATS[3] = {"w1", "w3", "w2"};

static void kl_free(void *ptr) {
    kimi_linear *m = ptr;
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->n_layers; l++) {
            kl_layer *L = &m->layers[l];
            free(L->attn_norm); free(L->ffn_norm);
            cb_mla_free(&L->mla);
            cb_linear *lins[] = {&L->q, &L->k, &L->v, &L->f_a, &L->f_b, &L->b, &L->g_a, &L->g_b, &L->o};
            for (size_t i = 0; i < sizeof lins / sizeof *lins; i++) cb_linear_free(lins[i]);
            cb_kda_free(&L->kda);
            if (L->is_moe) cb_grouped_moe_free(&L->moe);
            else cb_swiglu_free(&L->dense);
        }
    free(m->layers);
    free(m->expert_layers);
    cb_linear_free(&m->embed);
    if (!m->tied) cb_linear_free(&m->lm_head);
    free(m->final_norm);
    float *bufs[] = {m->x, m->h, m->proj, m->lx, m->lf, m->lb, m->lg, m->lo, m->low};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    cb_st_close(&m->idx);
    free(m);
}

static int per_layer_letters(cb_hparams *hp, const char *key, const char *allowed, int n, const char **out,
                             char *err, size_t errlen) {
    const char *s = cb_hp_str_opt(hp, key, NULL);
    if (!s || (int)strlen(s) != n || strspn(s, allowed) != strlen(s)) {
        snprintf(err, errlen, "--set %s: needs exactly %d letters from %s, one per layer", key, n, allowed);
        return -1;
    }
    *out = s;
    return 0;
}

static int read_hparams(kimi_linear *m, cb_hparams *hp, const char **attn, const char **mlp, char *err,
                        size_t errlen) {
    m->eps = 1e-5f;
    m->moe.norm_topk_prob = 1;
    m->moe.n_group = m->moe.topk_group = 1;
    m->moe.routed_scaling_factor = 1.0f;
    m->moe.expert_mats = EXPERT_MATS;
    m->kda.kernel = 4;
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
        cb_hp_int_opt(hp, "q_lora_rank", &s->q_lora, err, errlen) ||
        cb_hp_int(hp, "kv_lora_rank", &s->kv_lora, err, errlen) ||
        cb_hp_int(hp, "qk_nope_head_dim", &s->nope, err, errlen) ||
        cb_hp_int(hp, "qk_rope_head_dim", &s->rope, err, errlen) ||
        cb_hp_int(hp, "v_head_dim", &s->v_dim, err, errlen) ||
        cb_hp_int(hp, "linear_num_heads", &m->kda.n_heads, err, errlen) ||
        cb_hp_int(hp, "linear_head_dim", &m->kda.head_dim, err, errlen) ||
        cb_hp_int_opt(hp, "linear_conv_kernel_dim", &m->kda.kernel, err, errlen))
        return -1;
    if (m->hidden < 1 || m->n_layers < 1 || s->n_heads < 1 || m->vocab < 1 || m->inter < 1 || m->moe.inter < 1 ||
        m->moe.n_shared < 0 || m->eps <= 0) {
        snprintf(err, errlen, "--set hyperparameters out of range (sizes must be positive)");
        return -1;
    }
    m->moe.hidden = s->hidden = m->hidden;
    m->kda.eps = m->eps;
    s->lora_eps = 1e-6f;       /* kv_a_layernorm keeps KimiLinearRMSNorm's default eps */
    s->scale = 1.0f / sqrtf((float)(s->nope + s->rope));
    return per_layer_letters(hp, "attn_layers", "KF", m->n_layers, attn, err, errlen) ||
           per_layer_letters(hp, "mlp_layers", "DM", m->n_layers, mlp, err, errlen);
}

static int has_matrix(const cb_st_index *idx, const char *stem) {
    char name[320];
    snprintf(name, sizeof name, "%s.weight", stem);
    if (cb_st_find(idx, name)) return 1;
    snprintf(name, sizeof name, "%s.qweight", stem);   /* quantized in a colibri-quant container */
    return cb_st_find(idx, name) != NULL;
}

static int load_kda(kimi_linear *m, kl_layer *L, const char *sa, size_t *dense, char *err, size_t errlen) {
    int H = m->hidden, W = m->kda.n_heads * m->kda.head_dim, D = m->kda.head_dim;
    struct { cb_linear *lin; const char *leaf; int rows, cols; } mats[] = {
        {&L->q, "q_proj", W, H}, {&L->k, "k_proj", W, H}, {&L->v, "v_proj", W, H},
        {&L->f_a, "f_a_proj", D, H}, {&L->f_b, "f_b_proj", W, D}, {&L->b, "b_proj", m->kda.n_heads, H},
        {&L->g_a, "g_a_proj", D, H}, {&L->g_b, "g_b_proj", W, D}, {&L->o, "o_proj", H, W},
    };
    char name[320];
    for (size_t i = 0; i < sizeof mats / sizeof *mats; i++) {
        snprintf(name, sizeof name, "%s%s.weight", sa, mats[i].leaf);
        if (cb_load_linear(mats[i].lin, &m->idx, name, mats[i].rows, mats[i].cols, dense, err, errlen)) return -1;
    }
    return cb_kda_init(&L->kda, &m->idx, sa, &m->kda, dense, err, errlen);
}

static int load_layer(kimi_linear *m, int l, char attn, char mlp, int cap, size_t *state, size_t *dense, char *err,
                      size_t errlen) {
    kl_layer *L = &m->layers[l];
    char name[320], sa[128];
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    if (cb_load_vector(&L->attn_norm, &m->idx, name, m->hidden, dense, err, errlen)) return -1;
    snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
    if (cb_load_vector(&L->ffn_norm, &m->idx, name, m->hidden, dense, err, errlen)) return -1;
    snprintf(sa, sizeof sa, "model.layers.%d.self_attn.", l);
    if (attn == 'F') {
        L->full = 1;
        L->kv_layer = m->n_full++;
        if (cb_mla_init(&L->mla, &m->idx, sa, &m->mla, m->max_batch, m->ctx, dense, err, errlen)) return -1;
    } else {
        if (load_kda(m, L, sa, dense, err, errlen)) return -1;
        L->state_off = *state;
        *state += cb_kda_state_floats(&m->kda);
    }
    if (mlp == 'M') {
        if (cb_grouped_moe_init(&L->moe, &m->idx, l, "model.layers.%d.block_sparse_moe.", &m->moe, 1, cap,
                                m->max_batch, dense, err, errlen))
            return -1;
        L->is_moe = 1;
        m->expert_layers[m->n_expert_layers++] = &L->moe.moe.store;
        return 0;
    }
    /* The original checkpoints keep a dense layer under mlp.; transformers saves it under block_sparse_moe. */
    snprintf(name, sizeof name, "model.layers.%d.mlp.gate_proj", l);
    snprintf(name, sizeof name, "model.layers.%d.%s.", l, has_matrix(&m->idx, name) ? "mlp" : "block_sparse_moe");
    return cb_swiglu_init(&L->dense, &m->idx, name, m->hidden, m->inter, m->max_batch, dense, err, errlen);
}

static int alloc_activations(kimi_linear *m, char *err, size_t errlen) {
    size_t B = (size_t)m->max_batch, H = (size_t)m->hidden;
    size_t W = (size_t)m->kda.n_heads * (size_t)m->kda.head_dim, D = (size_t)m->kda.head_dim;
    m->x = malloc(B * H * sizeof(float));
    m->h = malloc(B * H * sizeof(float));
    m->proj = malloc(B * H * sizeof(float));
    m->lx = malloc(B * 3 * W * sizeof(float));
    m->lf = malloc(B * W * sizeof(float));
    m->lg = malloc(B * W * sizeof(float));
    m->lo = malloc(B * W * sizeof(float));
    m->lb = malloc(B * (size_t)m->kda.n_heads * sizeof(float));
    m->low = malloc(B * D * sizeof(float));
    if (!m->x || !m->h || !m->proj || !m->lx || !m->lf || !m->lg || !m->lo || !m->lb || !m->low) {
        snprintf(err, errlen, "out of memory for activations");
        return -1;
    }
    return 0;
}

static int kl_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    kimi_linear *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m->max_batch = a->max_batch;
    m->ctx = a->ctx;
    const char *attn = NULL, *mlp = NULL;
    if (read_hparams(m, a->hp, &attn, &mlp, err, errlen) || cb_st_open(&m->idx, a->model_dir, err, errlen))
        goto fail;
    size_t dense = 0, state = 0, cache = 0;
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
    for (int l = 0; l < m->n_layers; l++) {
        if (load_layer(m, l, attn[l], mlp[l], a->cap, &state, &dense, err, errlen)) goto fail;
        if (m->layers[l].is_moe) cache += cb_experts_cache_bytes(&m->layers[l].moe.moe.store);
    }
    if (alloc_activations(m, err, errlen)) goto fail;
    info->vocab = m->vocab;
    info->n_layers = m->n_full;
    info->kv_dim = m->mla.kv_lora + m->mla.rope;
    info->kv_k_only = 1;
    info->state_bytes = state * sizeof(float);
    info->dense_bytes = dense;
    info->expert_cache_bytes = cache + cb_experts_staging_bytes();
    info->n_expert_layers = m->n_expert_layers;
    info->expert_layers = m->expert_layers;
    *out = m;
    return 0;
fail:
    kl_free(m);
    return -1;
}

/* out = W_b (W_a x): the forget and output gates' low-rank projections. */
static void low_rank(kimi_linear *m, const cb_linear *a, const cb_linear *b, float *out, int n) {
    cb_linear_apply(a, m->low, m->h, n);
    cb_linear_apply(b, out, m->low, n);
}

static void kda_mixer(kimi_linear *m, kl_layer *L, cb_kv *kv, int n) {
    size_t W = (size_t)m->kda.n_heads * (size_t)m->kda.head_dim;
    /* [q | k | v] rows for the stacked short convolutions: project each, then interleave per row. */
    cb_linear_apply(&L->q, m->lo, m->h, n);
    for (int i = 0; i < n; i++) memcpy(m->lx + (size_t)i * 3 * W, m->lo + (size_t)i * W, W * sizeof(float));
    cb_linear_apply(&L->k, m->lo, m->h, n);
    for (int i = 0; i < n; i++) memcpy(m->lx + (size_t)i * 3 * W + W, m->lo + (size_t)i * W, W * sizeof(float));
    cb_linear_apply(&L->v, m->lo, m->h, n);
    for (int i = 0; i < n; i++) memcpy(m->lx + (size_t)i * 3 * W + 2 * W, m->lo + (size_t)i * W, W * sizeof(float));
    low_rank(m, &L->f_a, &L->f_b, m->lf, n);
    low_rank(m, &L->g_a, &L->g_b, m->lg, n);
    cb_linear_apply(&L->b, m->lb, m->h, n);
    cb_kda_forward(&L->kda, kv->state + L->state_off, m->lo, m->lx, m->lf, m->lb, m->lg, n);
    cb_linear_apply(&L->o, m->proj, m->lo, n);
}

static int kl_forward(void *ptr, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                      char *err, size_t errlen) {
    kimi_linear *m = ptr;
    int H = m->hidden;
    for (int i = 0; i < n; i++) cb_embed(m->x + (size_t)i * H, &m->embed, tokens[i]);
    for (int l = 0; l < m->n_layers; l++) {
        kl_layer *L = &m->layers[l];
        for (int i = 0; i < n; i++) cb_rmsnorm(m->h + (size_t)i * H, m->x + (size_t)i * H, L->attn_norm, H, m->eps);
        if (L->full) {
            cb_mla_project(&L->mla, m->h, n, pos0, kv, L->kv_layer, NULL);
            cb_mla_attend(&L->mla, m->proj, n, pos0, kv, L->kv_layer, NULL, NULL, 0);
        } else {
            kda_mixer(m, L, kv, n);
        }
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

const cb_family cb_kimi_linear_family = {"kimi_linear", kl_load, kl_forward, kl_free};
