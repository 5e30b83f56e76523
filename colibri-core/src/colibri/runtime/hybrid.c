/* hybrid.c: see hybrid.h. */
#include "hybrid.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const cb_hp_spec HPARAMS[] = {
    CB_HP_REQ("num_attention_heads", cb_hybrid, attn_cfg.n_heads),
    CB_HP_REQ("num_key_value_heads", cb_hybrid, attn_cfg.n_kv_heads),
    CB_HP_OPT("head_dim", cb_hybrid, attn_cfg.head_dim, 0, CB_HP_NONNEG),
    CB_HP_FLAG("qkv_bias", cb_hybrid, attn_cfg.qkv_bias, 0), CB_HP_FLAG("attention_bias", cb_hybrid, attn_cfg.o_bias, 0),
    CB_HP_FLAG("qk_norm", cb_hybrid, attn_cfg.head_norm, 0),
    CB_HP_FLAG("attn_output_gate", cb_hybrid, attn_cfg.output_gate, 0),
    CB_HP_TEXT("layer_types", cb_hybrid, layer_types, NULL), CB_HP_END,
};
/* Read only when some layer is linear attention. */
static const cb_hp_spec LINEAR_HPARAMS[] = {
    CB_HP_CHOICE_OF("linear_projection", cb_hybrid, split, "fused,split", 0),
    CB_HP_REQ("linear_num_key_heads", cb_hybrid, dn_cfg.n_k_heads),
    CB_HP_REQ("linear_num_value_heads", cb_hybrid, dn_cfg.n_v_heads),
    CB_HP_REQ("linear_key_head_dim", cb_hybrid, dn_cfg.k_dim), CB_HP_REQ("linear_value_head_dim", cb_hybrid, dn_cfg.v_dim),
    CB_HP_OPT("linear_conv_kernel_dim", cb_hybrid, dn_cfg.kernel, 4, CB_HP_POSITIVE), CB_HP_END,
};

/* The blocks' prefixes (gqa.h and deltanet.h name the tensors under them), and the split DeltaNet projections. */
#define SA "model.layers.%d.self_attn."
#define LA "model.layers.%d.linear_attn."
static const cb_tensor_spec TENSORS[] = {
    CB_LINEAR_IF_ON(LA "in_proj_qkv.weight", cb_hybrid_layer, in_qkv, cb_hybrid, conv_w, hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_z.weight", cb_hybrid_layer, in_z, cb_hybrid, vd, hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_b.weight", cb_hybrid_layer, in_b, cb_hybrid, nv, hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_a.weight", cb_hybrid_layer, in_a, cb_hybrid, nv, hidden, split, mixers, "L"),
    CB_LINEAR_ON(LA "out_proj.weight", cb_hybrid_layer, out_proj, cb_hybrid, hidden, vd, mixers, "L"),
    CB_TENSORS_END,
};

static const cb_scratch_spec SCRATCH[] = {
    CB_SCRATCH(cb_hybrid, lx, conv_w, 1), CB_SCRATCH(cb_hybrid, lz, vd, 1), CB_SCRATCH(cb_hybrid, lo, vd, 1),
    CB_SCRATCH(cb_hybrid, lb, nv, 1), CB_SCRATCH(cb_hybrid, la, nv, 1), CB_SCRATCH_END,
};

/* The mixer per layer (layer_types, default all full); the DeltaNet widths when a layer needs them; the attention's
 * shape and RoPE. */
static int hybrid_setup(void *block, const void *spec, cb_decoder *d, cb_hparams *hp, char *err, size_t errlen) {
    cb_hybrid *m = block;
    cb_gqa_config *a = &m->attn_cfg;
    cb_deltanet_config *c = &m->dn_cfg;
    int n = m->n_layers = d->n_layers;
    m->spec = spec;
    m->hidden = d->hidden;
    if (cb_hp_read(hp, HPARAMS, m, err, errlen)) return -1;
    if (!(m->mixers = calloc((size_t)n + 1, 1)) || !(m->layers = calloc((size_t)n, sizeof *m->layers)))
        return cb_oom(err, errlen, "the layer kinds");
    memset(m->mixers, 'F', (size_t)n);
    if ((m->layer_types && cb_hp_layer_words("layer_types", m->layer_types, "full_attention=F,linear_attention=L", n,
                                             m->mixers, err, errlen)) ||
        (strchr(m->mixers, 'L') && cb_hp_read(hp, LINEAR_HPARAMS, m, err, errlen)))
        return -1;
    m->fused = strchr(m->mixers, 'L') && !m->split;
    if (m->fused && !m->spec->fused) {
        snprintf(err, errlen, "--set linear_projection=fused: this engine runs only the split projections");
        return -1;
    }
    c->eps = d->eps;
    m->kd = c->n_k_heads * c->k_dim, m->vd = c->n_v_heads * c->v_dim, m->nv = c->n_v_heads;
    m->conv_w = 2 * m->kd + m->vd;
    if (m->fused) m->qkvz_w = 2 * m->kd + 2 * m->vd, m->ba_w = 2 * m->nv;
    a->qkv_bias |= a->o_bias;  /* attention_bias biases all four projections (Qwen3); qkv_bias only q/k/v (Qwen2) */
    if (!a->head_dim) a->head_dim = d->hidden / a->n_heads;
    a->hidden = d->hidden, a->eps = d->eps, a->norm_offset = d->norm_offset;
    return cb_rope_init(&m->rope, hp, a->head_dim, 1, err, errlen);
}

static int hybrid_load_layer(void *block, cb_decoder *d, int l, char *err, size_t errlen) {
    cb_hybrid *m = block;
    cb_hybrid_layer *L = &m->layers[l];
    char prefix[320];
    if (m->mixers[l] == 'F') {
        L->kv_layer = m->n_full++;
        return cb_gqa_init(&L->attn, &d->idx, cb_decoder_name(d, prefix, sizeof prefix, SA, l), &m->attn_cfg,
                           &d->dense_bytes, err, errlen);
    }
    L->state_off = cb_decoder_state(d, cb_deltanet_state_floats(&m->dn_cfg));
    return cb_load_block_tensors(L, m, d, TENSORS, l, err, errlen) ||
           cb_deltanet_init(&L->dn, &d->idx, cb_decoder_name(d, prefix, sizeof prefix, LA, l), &m->dn_cfg,
                            &d->dense_bytes, err, errlen);
}

static int hybrid_finish(void *block, cb_decoder *d, cb_model_info *info, char *err, size_t errlen) {
    cb_hybrid *m = block;
    info->n_layers = m->n_full;
    info->kv_dim = m->attn_cfg.n_kv_heads * m->attn_cfg.head_dim;
    if (cb_alloc_scratch(m, SCRATCH, d->max_batch, err, errlen)) return -1;
    return m->n_full ? cb_gqa_scratch_init(&m->attn_scratch, &m->attn_cfg, d->max_batch, d->ctx, err, errlen) : 0;
}

static void hybrid_free(void *block, cb_decoder *d) {
    (void)d;
    cb_hybrid *m = block;
    for (int l = 0; m->layers && l < m->n_layers; l++) {
        cb_free_tensors(&m->layers[l], TENSORS);
        cb_gqa_free(&m->layers[l].attn);
        cb_deltanet_free(&m->layers[l].dn);
    }
    free(m->layers);
    cb_rope_free(&m->rope);
    cb_gqa_scratch_free(&m->attn_scratch);
    cb_free_scratch(m, SCRATCH);
    free(m->mixers);
}

const cb_block_type cb_hybrid_block = {
    .setup = hybrid_setup, .load_layer = hybrid_load_layer, .finish = hybrid_finish, .free = hybrid_free,
};

void cb_hybrid_deltanet(cb_hybrid *m, cb_decoder *d, int l, cb_kv *kv, int n) {
    cb_hybrid_layer *L = &m->layers[l];
    cb_deltanet_forward(&L->dn, kv->state + L->state_off, m->lo, m->lx, m->lz, m->lb, m->la, n);
    cb_linear_apply(&L->out_proj, d->proj, m->lo, n);
}

/* Full layers: gated GQA on their own KV layer; the rest: Gated DeltaNet on the slot state. */
void cb_hybrid_forward(cb_hybrid *m, cb_decoder *d, int l, cb_kv *kv, int n, int pos0) {
    cb_hybrid_layer *L = &m->layers[l];
    if (m->mixers[l] == 'F') {
        cb_gqa_forward(&L->attn, &m->attn_scratch, d->proj, d->h, n, kv, L->kv_layer, pos0, &m->rope);
        return;
    }
    cb_linear_apply(&L->in_qkv, m->lx, d->h, n);
    cb_linear_apply(&L->in_z, m->lz, d->h, n);
    cb_linear_apply(&L->in_b, m->lb, d->h, n);
    cb_linear_apply(&L->in_a, m->la, d->h, n);
    cb_hybrid_deltanet(m, d, l, kv, n);
}
