/* glm.c: the GLM MoE engines, a recipe over the runtime's decoder (decoder.h) and latent attention (latent.h).
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decoder.h"
#include "engine.h"
#include "latent.h"

typedef enum { ATTN_GQA = 0, ATTN_MLA = 1, ATTN_DSA = 2 } attn_kind;

typedef struct {
    cb_qkvo p;                 /* GQA */
    float *q_norm, *k_norm;
    cb_latent latent;          /* MLA / DSA */
} glm_layer;

typedef struct {
    cb_decoder d;
    const char *attention;
    attn_kind attn;
    int n_heads, attention_bias;
    /* GQA */
    int n_kv_heads, head_dim, qk_norm, qw, kv_width, gqa_kv, is_gqa, gqa_bias, gqa_qk_norm;
    /* MLA / DSA */
    cb_latent_shape lat;
    int interleave;
    const char *indexer_layers;   /* DSA: F runs its own indexer, S reuses the previous one's selection */
    glm_layer *layers;
    cb_rope rope;
    cb_attn_shape gqa;
    float *q, *k, *v, *att, *scores;   /* GQA activations for max_batch rows */
    cb_latent_sel sel;                 /* DSA: the current selection, carried across "shared" layers */
} glm;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(glm, d, 1e-5), CB_DECODER_GROUPED_HPARAMS(glm, d),
    CB_HP_REQ("num_attention_heads", glm, n_heads), CB_HP_FLAG("attention_bias", glm, attention_bias, 0),
    CB_HP_TEXT("attention", glm, attention, "gqa"), CB_HP_END,
};
static const cb_hp_spec GQA_HPARAMS[] = {
    CB_HP_OPT("num_key_value_heads", glm, n_kv_heads, 0, CB_HP_NONNEG),
    CB_HP_OPT("head_dim", glm, head_dim, 0, CB_HP_NONNEG), CB_HP_FLAG("use_qk_norm", glm, qk_norm, 0), CB_HP_END,
};
static const cb_hp_spec LATENT_HPARAMS[] = {CB_MLA_HPARAMS(glm, lat), CB_MLA_SCALE_HPARAM(glm, lat), CB_HP_END};
static const cb_hp_spec MLA_HPARAMS[] = {CB_HP_FLAG("rope_interleave", glm, interleave, 1), CB_HP_END};
static const cb_hp_spec DSA_HPARAMS[] = {
    CB_DSA_HPARAMS(glm, lat), CB_HP_PER_LAYER("indexer_layers", glm, indexer_layers, "FS", d.n_layers), CB_HP_END,
};

#define SA "model.layers.%d.self_attn."
static const cb_tensor_spec GQA_TENSORS[] = {
    CB_LINEAR_IF(SA "q_proj.weight", glm_layer, p.wq, glm, qw, d.hidden, is_gqa),
    CB_LINEAR_IF(SA "k_proj.weight", glm_layer, p.wk, glm, kv_width, d.hidden, is_gqa),
    CB_LINEAR_IF(SA "v_proj.weight", glm_layer, p.wv, glm, kv_width, d.hidden, is_gqa),
    CB_LINEAR_IF(SA "o_proj.weight", glm_layer, p.wo, glm, d.hidden, qw, is_gqa),
    CB_VECTOR_IF(SA "q_proj.bias", glm_layer, p.bq, glm, qw, gqa_bias),
    CB_VECTOR_IF(SA "k_proj.bias", glm_layer, p.bk, glm, kv_width, gqa_bias),
    CB_VECTOR_IF(SA "v_proj.bias", glm_layer, p.bv, glm, kv_width, gqa_bias),
    CB_VECTOR_IF(SA "q_norm.weight", glm_layer, q_norm, glm, head_dim, gqa_qk_norm),
    CB_VECTOR_IF(SA "k_norm.weight", glm_layer, k_norm, glm, head_dim, gqa_qk_norm),
    CB_TENSORS_END,
};

static int setup_gqa(glm *m, char *err, size_t errlen) {
    if (cb_attn_shape_init(&m->gqa, m->d.hidden, m->n_heads, m->n_kv_heads, m->head_dim, err, errlen)) return -1;
    m->n_kv_heads = m->gqa.n_kv_heads;
    m->head_dim = m->gqa.head_dim;
    m->is_gqa = 1;
    m->gqa_bias = m->attention_bias;
    m->gqa_qk_norm = m->qk_norm;
    m->qw = m->n_heads * m->head_dim;
    m->kv_width = m->gqa_kv = m->n_kv_heads * m->head_dim;
    return 0;
}

static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    glm *m = ptr;
    m->attn = !strcmp(m->attention, "gqa") ? ATTN_GQA : !strcmp(m->attention, "mla") ? ATTN_MLA
            : !strcmp(m->attention, "dsa") ? ATTN_DSA : (attn_kind)-1;
    if ((int)m->attn < 0) {
        snprintf(err, errlen, "--set attention=%s: expected gqa, mla or dsa", m->attention);
        return -1;
    }
    if (m->attn == ATTN_GQA) {
        if (cb_hp_read(hp, GQA_HPARAMS, m, err, errlen) || setup_gqa(m, err, errlen)) return -1;
        /* GLM-4.5 rotates half-split pairs. */
        return cb_rope_init(&m->rope, hp, m->head_dim, 1, err, errlen);
    }
    m->lat.sparse = m->attn == ATTN_DSA;
    m->interleave = 1;         /* the MLA models rotate interleaved pairs unless rope_interleave=0 */
    if (cb_hp_read(hp, LATENT_HPARAMS, m, err, errlen) ||
        cb_hp_read(hp, m->lat.sparse ? DSA_HPARAMS : MLA_HPARAMS, m, err, errlen))
        return -1;
    if (m->lat.sparse && m->indexer_layers[0] != 'F') {
        snprintf(err, errlen, "--set indexer_layers=%s: the first layer must run its own indexer (F)",
                 m->indexer_layers);
        return -1;
    }
    m->lat.mla.bias = m->attention_bias;
    cb_latent_shape_finish(&m->lat, m->d.hidden);
    m->kv_width = m->lat.kv_width;
    return cb_rope_init(&m->rope, hp, m->lat.mla.rope, !m->interleave, err, errlen);
}

static int load_layer(void *ptr, int l, char *err, size_t errlen) {
    glm *m = ptr;
    if (m->attn == ATTN_GQA) return 0;
    int indexer = m->lat.sparse && m->indexer_layers[l] == 'F';
    return cb_latent_init(&m->layers[l].latent, &m->d.idx, l, &m->lat, indexer, m->d.max_batch, m->d.ctx,
                          &m->d.dense_bytes, err, errlen);
}

/* GQA only (qw and kv_width are 0 for the latent kinds, whose scratch is their own). */
static const cb_scratch_spec SCRATCH[] = {
    CB_SCRATCH(glm, q, qw, 1), CB_SCRATCH(glm, att, qw, 1), CB_SCRATCH(glm, k, gqa_kv, 1),
    CB_SCRATCH(glm, v, gqa_kv, 1), CB_SCRATCH_END,
};

static int finish(void *ptr, cb_model_info *info, char *err, size_t errlen) {
    glm *m = ptr;
    info->kv_dim = m->kv_width;
    info->kv_k_only = m->attn != ATTN_GQA;
    if (m->attn != ATTN_GQA)
        return cb_latent_sel_init(&m->sel, &m->lat, m->d.max_batch) ? cb_oom(err, errlen, "activations") : 0;
    m->scores = cb_attn_scratch(m->d.max_batch, m->n_heads, m->d.ctx);
    return m->scores ? 0 : cb_oom(err, errlen, "activations");
}

/* GLM-4.5 attention: biased projections, optional per-head q/k RMSNorm, half-split partial RoPE. */
static void gqa_forward(glm *m, glm_layer *L, cb_kv *kv, int l, int n, int pos0) {
    int qw = m->qw, kw = m->kv_width, hd = m->head_dim;
    cb_qkv_apply(&L->p, m->q, m->k, m->v, m->d.h, n);
    for (int i = 0; i < n; i++) {
        float *q = m->q + (size_t)i * qw, *k = m->k + (size_t)i * kw;
        if (m->qk_norm) {
            for (int hh = 0; hh < m->n_heads; hh++) cb_rmsnorm(q + hh * hd, q + hh * hd, L->q_norm, hd, m->d.eps);
            for (int hh = 0; hh < m->n_kv_heads; hh++) cb_rmsnorm(k + hh * hd, k + hh * hd, L->k_norm, hd, m->d.eps);
        }
        cb_rope_apply(&m->rope, q, m->n_heads, hd, pos0 + i);
        cb_rope_apply(&m->rope, k, m->n_kv_heads, hd, pos0 + i);
    }
    cb_kv_store(kv, l, pos0, n, m->k, m->v);
    cb_attend(m->att, m->q, kv, l, pos0, n, &m->gqa, m->scores);
    cb_linear_apply(&L->p.wo, m->d.proj, m->att, n);
}

static int attention(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    glm *m = ptr;
    glm_layer *L = &m->layers[l];
    if (m->attn == ATTN_GQA) gqa_forward(m, L, kv, l, n, pos0);
    else cb_latent_forward(&L->latent, &m->lat, m->d.proj, m->d.h, n, pos0, kv, l, &m->rope, &m->rope, &m->sel);
    return 0;
}

static void free_layer(void *model, void *layer) {
    if (((glm *)model)->attn != ATTN_GQA) cb_latent_free(&((glm_layer *)layer)->latent);
}

static void free_model(void *ptr) {
    glm *m = ptr;
    cb_rope_free(&m->rope);
    free(m->scores);
    cb_latent_sel_free(&m->sel);
}

static const cb_recipe RECIPE = {
    .hparams = HPARAMS, .model_size = sizeof(glm), .layer_size = sizeof(glm_layer), .layers_at = offsetof(glm, layers),
    .tensors = GQA_TENSORS, .scratch = SCRATCH, .routed = CB_FFN_GROUPED, .setup = setup, .load_layer = load_layer,
    .finish = finish, .mixer = attention, .free_layer = free_layer, .free_model = free_model,
};

static int glm_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family glm_family
    = {.name = "glm", .load = glm_load, .forward = cb_decoder_forward, .free = cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &glm_family); }
