/* latent.c: see latent.h. */
#include "latent.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void cb_latent_shape_finish(cb_latent_shape *s, int hidden) {
    cb_mla_shape *m = &s->mla;
    m->hidden = hidden;
    m->lora_eps = 1e-6f;       /* q_a_layernorm / kv_a_layernorm keep the RMSNorm default */
    if (!(m->scale > 0)) m->scale = 1.0f / sqrtf((float)(m->nope + m->rope));
    s->kv_width = m->kv_lora + m->rope;
    if (!s->sparse) return;
    s->dsa.hidden = hidden;
    s->dsa.q_lora = m->q_lora;
    s->dsa.rope_dim = m->rope;
    s->index_col = s->kv_width;
    s->kv_width += s->dsa.head_dim;
}

int cb_latent_init(cb_latent *a, const cb_st_index *idx, int l, const cb_latent_shape *s, int indexer, int max_batch,
                   int ctx, size_t *bytes, char *err, size_t errlen) {
    char prefix[128];
    snprintf(prefix, sizeof prefix, "model.layers.%d.self_attn.", l);
    if (cb_mla_init(&a->mla, idx, prefix, &s->mla, max_batch, ctx, bytes, err, errlen)) return -1;
    if (!s->sparse || !indexer) return 0;
    snprintf(prefix, sizeof prefix, "model.layers.%d.self_attn.indexer.", l);
    if (cb_dsa_init(&a->dsa, idx, prefix, &s->dsa, max_batch, ctx, bytes, err, errlen)) return -1;
    a->has_indexer = 1;
    return 0;
}

void cb_latent_free(cb_latent *a) {
    cb_mla_free(&a->mla);
    if (a->has_indexer) cb_dsa_free(&a->dsa);
    a->has_indexer = 0;
}

void cb_latent_forward(cb_latent *a, const cb_latent_shape *s, float *out, const float *h, int n, int pos0, cb_kv *kv,
                       int kv_layer, const cb_rope *rope, const cb_rope *index_rope, cb_latent_sel *sel) {
    cb_mla_project(&a->mla, h, n, pos0, kv, kv_layer, rope);
    if (!s->sparse) {
        cb_mla_attend(&a->mla, out, n, pos0, kv, kv_layer, NULL, NULL, 0);
        return;
    }
    if (a->has_indexer)
        cb_dsa_select(&a->dsa, h, a->mla.q_resid, n, pos0, kv, kv_layer, s->index_col, index_rope, sel->sel,
                      sel->n_sel);
    cb_mla_attend(&a->mla, out, n, pos0, kv, kv_layer, sel->sel, sel->n_sel, s->dsa.topk);
}

/* ---- the attention block ---- */

static const cb_hp_spec HPARAMS[] = {
    CB_HP_TEXT("attention", cb_attention, attention, NULL), CB_HP_FLAG("attention_bias", cb_attention, bias, 0),
    CB_HP_END,
};
static const cb_hp_spec LATENT_HPARAMS[] = {CB_MLA_HPARAMS(cb_attention, s), CB_MLA_SCALE_HPARAM(cb_attention, s),
                                             CB_HP_END};
static const cb_hp_spec MLA_HPARAMS[] = {CB_HP_FLAG("rope_interleave", cb_attention, interleave, 1), CB_HP_END};
static const cb_hp_spec DSA_HPARAMS[] = {CB_DSA_HPARAMS(cb_attention, s), CB_HP_END};
static const cb_hp_spec SHARED_INDEXER_HPARAMS[] = {
    CB_HP_PER_LAYER("indexer_layers", cb_attention, indexer_layers, "FS", n_layers), CB_HP_END,
};
static const cb_hp_spec GQA_HPARAMS[] = {
    CB_HP_REQ("num_attention_heads", cb_attention, gqa.n_heads),
    CB_HP_OPT("num_key_value_heads", cb_attention, gqa.n_kv_heads, 0, CB_HP_NONNEG),
    CB_HP_OPT("head_dim", cb_attention, gqa.head_dim, 0, CB_HP_NONNEG),
    CB_HP_FLAG("use_qk_norm", cb_attention, gqa.head_norm, 0), CB_HP_END,
};

static const char *const KIND_NAMES[] = {"mla", "dsa", "gqa"};

/* The words of a comma-separated list: for (const char *c = list; *c; c = next_word(c)), strcspn(c, ",") long. */
static const char *next_word(const char *c) {
    c += strcspn(c, ",");
    return *c ? c + 1 : c;
}

/* The spec's kind named by attention= (absent: the spec's first); -1 with "expected a, b or c" otherwise. */
static int pick_kind(cb_attention *a, char *err, size_t errlen) {
    const char *kinds = a->spec->kinds, *want = a->attention ? a->attention : kinds;
    size_t want_len = a->attention ? strlen(want) : strcspn(kinds, ",");
    for (const char *c = kinds; *c; c = next_word(c))
        for (int k = 0; k < 3; k++)
            if (strcspn(c, ",") == want_len && strlen(KIND_NAMES[k]) == want_len && !strncmp(c, want, want_len) &&
                !strncmp(c, KIND_NAMES[k], want_len)) {
                a->kind = (cb_attn_kind)k;
                return 0;
            }
    char expected[64] = "";
    for (const char *c = kinds; *c; c = next_word(c)) {
        size_t len = strcspn(c, ","), at = strlen(expected);
        snprintf(expected + at, sizeof expected - at, "%s%.*s", !at ? "" : c[len] ? ", " : " or ", (int)len, c);
    }
    snprintf(err, errlen, "--set attention=%s: expected %s", want, expected);
    return -1;
}

static int setup_gqa(cb_attention *a, cb_decoder *d, cb_hparams *hp, char *err, size_t errlen) {
    cb_gqa_config *c = &a->gqa;
    cb_attn_shape shape;
    if (cb_hp_read(hp, GQA_HPARAMS, a, err, errlen) ||
        cb_attn_shape_init(&shape, d->hidden, c->n_heads, c->n_kv_heads, c->head_dim, err, errlen))
        return -1;
    c->n_kv_heads = shape.n_kv_heads, c->head_dim = shape.head_dim;
    c->hidden = d->hidden, c->eps = d->eps, c->qkv_bias = a->bias;
    return cb_rope_init(&a->rope, hp, c->head_dim, 1, err, errlen);   /* GLM-4.5 rotates half-split pairs */
}

static int setup_latent(cb_attention *a, cb_decoder *d, cb_hparams *hp, char *err, size_t errlen) {
    const cb_attention_spec *spec = a->spec;
    a->s.sparse = a->kind == CB_ATTN_DSA;
    a->interleave = 1;
    if (cb_hp_read(hp, LATENT_HPARAMS, a, err, errlen) ||
        (a->s.sparse && cb_hp_read(hp, DSA_HPARAMS, a, err, errlen)) ||
        (a->s.sparse && spec->shared_indexers && cb_hp_read(hp, SHARED_INDEXER_HPARAMS, a, err, errlen)) ||
        (!a->s.sparse && !spec->nope && cb_hp_read(hp, MLA_HPARAMS, a, err, errlen)))
        return -1;
    if (a->indexer_layers && a->indexer_layers[0] != 'F') {
        snprintf(err, errlen, "--set indexer_layers=%s: the first layer must run its own indexer (F)",
                 a->indexer_layers);
        return -1;
    }
    a->s.mla.bias = a->bias;
    cb_latent_shape_finish(&a->s, d->hidden);
    if (spec->nope) return 0;
    return cb_rope_init(&a->rope, hp, a->s.mla.rope, !a->interleave, err, errlen) ||
           (a->s.sparse && spec->index_neox && cb_rope_init(&a->index_rope, hp, a->s.mla.rope, 1, err, errlen));
}

static int attention_setup(void *block, const void *spec, cb_decoder *d, cb_hparams *hp, char *err, size_t errlen) {
    cb_attention *a = block;
    a->spec = spec;
    a->n_layers = d->n_layers;
    if (cb_hp_read(hp, HPARAMS, a, err, errlen) || pick_kind(a, err, errlen)) return -1;
    if (!(a->layers = calloc((size_t)d->n_layers, sizeof *a->layers))) return cb_oom(err, errlen, "the attention");
    return a->kind == CB_ATTN_GQA ? setup_gqa(a, d, hp, err, errlen) : setup_latent(a, d, hp, err, errlen);
}

static int attention_load_layer(void *block, cb_decoder *d, int l, char *err, size_t errlen) {
    cb_attention *a = block;
    const cb_attention_spec *spec = a->spec;
    cb_attention_layer *L = &a->layers[l];
    if (spec->on) {
        const char *letters = *(const char *const *)((const char *)d + spec->letters);
        if (!strchr(spec->on, letters[l])) return 0;
    }
    L->kv_layer = a->n_kv++;
    if (a->kind == CB_ATTN_GQA) {
        char prefix[320];
        return cb_gqa_init(&L->gqa, &d->idx, cb_decoder_name(d, prefix, sizeof prefix, "model.layers.%d.self_attn.", l),
                           &a->gqa, &d->dense_bytes, err, errlen);
    }
    int indexer = !a->indexer_layers || a->indexer_layers[l] == 'F';
    return cb_latent_init(&L->lat, &d->idx, l, &a->s, indexer, d->max_batch, d->ctx, &d->dense_bytes, err, errlen);
}

/* Every latent layer attends in the first one's MLA (and indexer) scratch: layers run one at a time, and per-layer
 * copies would cost n_layers x max_batch x n_heads x (ctx + 3 kv_lora) floats, gigabytes at DeepSeek-V3's size. */
static void share_latent_scratch(cb_attention *a) {
    cb_latent *mla_owner = NULL, *dsa_owner = NULL;
    for (int l = 0; l < a->n_layers; l++) {
        cb_latent *lat = &a->layers[l].lat;
        if (!lat->mla.work) continue;            /* a layer without this block (.on) */
        if (mla_owner) cb_mla_share_scratch(&lat->mla, &mla_owner->mla);
        else mla_owner = lat;
        if (!lat->has_indexer) continue;
        if (dsa_owner) cb_dsa_share_scratch(&lat->dsa, &dsa_owner->dsa);
        else dsa_owner = lat;
    }
}

static int attention_finish(void *block, cb_decoder *d, cb_model_info *info, char *err, size_t errlen) {
    cb_attention *a = block;
    info->n_layers = a->n_kv;
    if (a->kind != CB_ATTN_GQA) share_latent_scratch(a);
    if (a->kind == CB_ATTN_GQA) {
        info->kv_dim = a->gqa.n_kv_heads * a->gqa.head_dim;
        return a->n_kv ? cb_gqa_scratch_init(&a->scratch, &a->gqa, d->max_batch, d->ctx, err, errlen) : 0;
    }
    info->kv_dim = a->s.kv_width;
    info->kv_k_only = 1;
    if (!a->s.sparse) return 0;
    a->sel.sel = malloc((size_t)d->max_batch * (size_t)a->s.dsa.topk * sizeof(int));
    a->sel.n_sel = malloc((size_t)d->max_batch * sizeof(int));
    return a->sel.sel && a->sel.n_sel ? 0 : cb_oom(err, errlen, "the DSA selection");
}

static void attention_free(void *block, cb_decoder *d) {
    (void)d;
    cb_attention *a = block;
    for (int l = 0; a->layers && l < a->n_layers; l++) {
        cb_latent_free(&a->layers[l].lat);
        cb_gqa_free(&a->layers[l].gqa);
    }
    free(a->layers);
    cb_rope_free(&a->rope);
    cb_rope_free(&a->index_rope);
    free(a->sel.sel);
    free(a->sel.n_sel);
    cb_gqa_scratch_free(&a->scratch);
}

const cb_block_type cb_attention_block = {
    .setup = attention_setup, .load_layer = attention_load_layer, .finish = attention_finish, .free = attention_free,
};

void cb_attention_forward(cb_attention *a, int l, float *out, const float *h, int n, int pos0, cb_kv *kv,
                          const cb_rope *index_rope) {
    cb_attention_layer *L = &a->layers[l];
    if (a->kind == CB_ATTN_GQA)
        cb_gqa_forward(&L->gqa, &a->scratch, out, h, n, kv, L->kv_layer, pos0, &a->rope);
    else
        cb_latent_forward(&L->lat, &a->s, out, h, n, pos0, kv, L->kv_layer, a->spec->nope ? NULL : &a->rope,
                          index_rope, &a->sel);
}
