/* hybrid.c: see hybrid.h. */
#include "hybrid.h"

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

/* The blocks' prefixes (gqa.h and deltanet.h name the tensors under them), and the DeltaNet projections. */
#define SA "model.layers.%d.self_attn."
#define LA "model.layers.%d.linear_attn."
const cb_tensor_spec cb_hybrid_tensors[] = {
    CB_LINEAR_IF_ON(LA "in_proj_qkvz.weight", cb_hybrid_layer, in_qkvz, cb_hybrid, qkvz_w, d.hidden, fused, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_ba.weight", cb_hybrid_layer, in_ba, cb_hybrid, ba_w, d.hidden, fused, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_qkv.weight", cb_hybrid_layer, in_qkv, cb_hybrid, conv_w, d.hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_z.weight", cb_hybrid_layer, in_z, cb_hybrid, vd, d.hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_b.weight", cb_hybrid_layer, in_b, cb_hybrid, nv, d.hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_a.weight", cb_hybrid_layer, in_a, cb_hybrid, nv, d.hidden, split, mixers, "L"),
    CB_LINEAR_ON(LA "out_proj.weight", cb_hybrid_layer, out_proj, cb_hybrid, d.hidden, vd, mixers, "L"),
    CB_TENSORS_END,
};

const cb_scratch_spec cb_hybrid_scratch[] = {
    CB_SCRATCH(cb_hybrid, lx, conv_w, 1), CB_SCRATCH(cb_hybrid, lz, vd, 1), CB_SCRATCH(cb_hybrid, lo, vd, 1),
    CB_SCRATCH(cb_hybrid, lb, nv, 1), CB_SCRATCH(cb_hybrid, la, nv, 1), CB_SCRATCH(cb_hybrid, qkvz, qkvz_w, 1),
    CB_SCRATCH(cb_hybrid, ba, ba_w, 1), CB_SCRATCH_END,
};

/* The mixer per layer (layer_types, default all full); the DeltaNet widths when a layer needs them; the attention's
 * shape and RoPE. */
int cb_hybrid_setup(cb_hybrid *m, cb_hparams *hp, char *err, size_t errlen) {
    cb_gqa_config *a = &m->attn_cfg;
    cb_deltanet_config *c = &m->dn_cfg;
    int n = m->d.n_layers;
    if (cb_hp_read(hp, HPARAMS, m, err, errlen)) return -1;
    if (!(m->mixers = calloc((size_t)n + 1, 1))) return cb_oom(err, errlen, "the layer kinds");
    memset(m->mixers, 'F', (size_t)n);
    if ((m->layer_types && cb_hp_layer_words("layer_types", m->layer_types, "full_attention=F,linear_attention=L", n,
                                             m->mixers, err, errlen)) ||
        (strchr(m->mixers, 'L') && cb_hp_read(hp, LINEAR_HPARAMS, m, err, errlen)))
        return -1;
    m->fused = !m->split, c->eps = m->d.eps;
    m->kd = c->n_k_heads * c->k_dim, m->vd = c->n_v_heads * c->v_dim, m->nv = c->n_v_heads;
    m->conv_w = 2 * m->kd + m->vd, m->qkvz_w = 2 * m->kd + 2 * m->vd, m->ba_w = 2 * m->nv;
    a->qkv_bias |= a->o_bias;  /* attention_bias biases all four projections (Qwen3); qkv_bias only q/k/v (Qwen2) */
    if (!a->head_dim) a->head_dim = m->d.hidden / a->n_heads;
    a->hidden = m->d.hidden, a->eps = m->d.eps, a->norm_offset = m->d.norm_offset;
    return cb_rope_init(&m->rope, hp, a->head_dim, 1, err, errlen);
}

int cb_hybrid_load_layer(void *ptr, int l, char *err, size_t errlen) {
    cb_hybrid *m = ptr;
    cb_hybrid_layer *L = &m->layers[l];
    char prefix[320];
    if (m->mixers[l] == 'F') {
        L->kv_layer = m->n_full++;
        return cb_gqa_init(&L->attn, &m->d.idx, cb_decoder_name(&m->d, prefix, sizeof prefix, SA, l),
                           &m->attn_cfg, &m->d.dense_bytes, err, errlen);
    }
    L->state_off = m->state;
    m->state += cb_deltanet_state_floats(&m->dn_cfg);
    return cb_deltanet_init(&L->dn, &m->d.idx, cb_decoder_name(&m->d, prefix, sizeof prefix, LA, l), &m->dn_cfg,
                            &m->d.dense_bytes, err, errlen);
}

int cb_hybrid_finish(void *ptr, cb_model_info *info, char *err, size_t errlen) {
    cb_hybrid *m = ptr;
    info->n_layers = m->n_full;
    info->kv_dim = m->attn_cfg.n_kv_heads * m->attn_cfg.head_dim;
    info->state_bytes = m->state * sizeof(float);
    return m->n_full ? cb_gqa_scratch_init(&m->attn_scratch, &m->attn_cfg, m->d.max_batch, m->d.ctx, err, errlen) : 0;
}

/* Qwen3-Next's in_proj_qkvz / in_proj_ba interleave per key-head group g: [q k v(r heads) z(r heads)] and
 * [b(r) a(r)], r = value heads per key head. Regroup into the conv input [q | k | v] and z, b, a. */
static void ungroup_qkvz(const cb_hybrid *m, int n) {
    const cb_deltanet_config *d = &m->dn_cfg;
    int r = d->n_v_heads / d->n_k_heads, kd = m->kd, vd = m->vd, nv = m->nv;
    int gw = 2 * d->k_dim + 2 * r * d->v_dim, rv = r * d->v_dim;
    size_t fsz = sizeof(float);
    for (int i = 0; i < n; i++) {
        const float *src = m->qkvz + (size_t)i * (size_t)m->qkvz_w, *ba = m->ba + (size_t)i * (size_t)m->ba_w;
        float *x = m->lx + (size_t)i * (size_t)m->conv_w, *z = m->lz + (size_t)i * (size_t)vd;
        for (int g = 0; g < d->n_k_heads; g++) {
            const float *s = src + (size_t)g * (size_t)gw;
            memcpy(x + (size_t)g * d->k_dim, s, (size_t)d->k_dim * fsz);
            memcpy(x + kd + (size_t)g * d->k_dim, s + d->k_dim, (size_t)d->k_dim * fsz);
            memcpy(x + 2 * kd + (size_t)g * rv, s + 2 * d->k_dim, (size_t)rv * fsz);
            memcpy(z + (size_t)g * rv, s + 2 * d->k_dim + rv, (size_t)rv * fsz);
            memcpy(m->lb + (size_t)i * nv + (size_t)g * r, ba + (size_t)g * 2 * r, (size_t)r * fsz);
            memcpy(m->la + (size_t)i * nv + (size_t)g * r, ba + (size_t)g * 2 * r + r, (size_t)r * fsz);
        }
    }
}

static void linear_mixer(cb_hybrid *m, cb_hybrid_layer *L, cb_kv *kv, int n) {
    const float *h = m->d.h;
    if (m->fused) {
        cb_linear_apply(&L->in_qkvz, m->qkvz, h, n);
        cb_linear_apply(&L->in_ba, m->ba, h, n);
        ungroup_qkvz(m, n);
    } else {
        cb_linear_apply(&L->in_qkv, m->lx, h, n);
        cb_linear_apply(&L->in_z, m->lz, h, n);
        cb_linear_apply(&L->in_b, m->lb, h, n);
        cb_linear_apply(&L->in_a, m->la, h, n);
    }
    cb_deltanet_forward(&L->dn, kv->state + L->state_off, m->lo, m->lx, m->lz, m->lb, m->la, n);
    cb_linear_apply(&L->out_proj, m->d.proj, m->lo, n);
}

/* Full layers: gated GQA on their own KV layer; the rest: Gated DeltaNet on the slot state. Reads d->h, writes
 * d->proj (decoder.h runs the norms, residuals, FFN and the logits around it). */
int cb_hybrid_mixer(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    cb_hybrid *m = ptr;
    cb_hybrid_layer *L = &m->layers[l];
    if (m->mixers[l] == 'F')
        cb_gqa_forward(&L->attn, &m->attn_scratch, m->d.proj, m->d.h, n, kv, L->kv_layer, pos0, &m->rope);
    else
        linear_mixer(m, L, kv, n);
    return 0;
}

void cb_hybrid_free_layer(void *model, void *layer) {
    (void)model;
    cb_hybrid_layer *L = layer;
    cb_gqa_free(&L->attn);
    cb_deltanet_free(&L->dn);
}

void cb_hybrid_free(cb_hybrid *m) {
    cb_rope_free(&m->rope);
    cb_gqa_scratch_free(&m->attn_scratch);
    free(m->mixers);
}
