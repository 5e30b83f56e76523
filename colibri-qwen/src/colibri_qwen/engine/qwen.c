/* qwen.c: the Qwen MoE engines (qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe[_text]), a recipe over the runtime's
 * decoder (decoder.h) and hybrid mixer block (hybrid.h). Every layer is
 *
 *   x += mixer(norm(x))      mixer: GQA attention (gqa.h), or Gated DeltaNet (deltanet.h) on hybrid layers
 *   x += ffn(norm(x))        ffn: routed MoE (+ sigmoid-gated shared expert), or a dense MLP (mlp_only_layers)
 *
 * What differs between the four types is switched by hyperparameters the plugin resolves: qkv biases (qwen2_moe),
 * per-head q/k norm (qwen3+), zero-centred "1 + w" RMSNorms and the attention output gate (the hybrids), the
 * linear-attention projection layout (qwen3_next fuses q/k/v/z and b/a per key-head group: this file's; qwen3_5
 * splits them: the block's) and weight_prefix (qwen3_5 nests the text model under model.language_model.).
 * Only full-attention layers hold KV; each DeltaNet layer keeps its state in the slot's recurrent state.
 */
#include <string.h>

#include "engine.h"
#include "hybrid.h"

typedef struct {
    cb_linear in_qkvz, in_ba;  /* qwen3_next's fused linear-attention input projections */
} qwen_layer;

typedef struct {
    cb_decoder d;
    cb_hybrid h;
    qwen_layer *layers;
    float *qkvz, *ba;          /* their outputs for max_batch rows */
} qwen;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(qwen, d, 1e-6), CB_DECODER_SPARSE_HPARAMS(qwen, d),
    CB_HP_REQ("num_experts", qwen, d.moe.n_experts), CB_HP_REQ("num_experts_per_tok", qwen, d.moe.top_k),
    CB_HP_REQ("moe_intermediate_size", qwen, d.moe.inter),
    CB_HP_FLAG("norm_topk_prob", qwen, d.moe.norm_topk_prob, 0),
    CB_HP_OPT("intermediate_size", qwen, d.inter, 0, CB_HP_NONNEG),
    CB_HP_OPT("shared_expert_intermediate_size", qwen, d.shared_inter, 0, CB_HP_NONNEG),
    CB_HP_FLAG("zero_centered_norm", qwen, d.norm_offset, 0), CB_HP_TEXT("weight_prefix", qwen, d.prefix, "model."),
    CB_HP_END,
};
static const cb_hybrid_spec HYBRID = {.fused = 1};

#define LA "model.layers.%d.linear_attn."
static const cb_tensor_spec TENSORS[] = {
    CB_LINEAR_IF_ON(LA "in_proj_qkvz.weight", qwen_layer, in_qkvz, qwen, h.qkvz_w, d.hidden, h.fused, h.mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_ba.weight", qwen_layer, in_ba, qwen, h.ba_w, d.hidden, h.fused, h.mixers, "L"),
    CB_TENSORS_END,
};
static const cb_scratch_spec SCRATCH[] = {CB_SCRATCH(qwen, qkvz, h.qkvz_w, 1), CB_SCRATCH(qwen, ba, h.ba_w, 1),
                                          CB_SCRATCH_END};

/* Qwen3-Next's in_proj_qkvz / in_proj_ba interleave per key-head group g: [q k v(r heads) z(r heads)] and
 * [b(r) a(r)], r = value heads per key head. Regroup into the conv input [q | k | v] and z, b, a. */
static void ungroup_qkvz(qwen *m, int n) {
    cb_hybrid *h = &m->h;
    const cb_deltanet_config *d = &h->dn_cfg;
    int r = d->n_v_heads / d->n_k_heads, kd = h->kd, vd = h->vd, nv = h->nv;
    int gw = 2 * d->k_dim + 2 * r * d->v_dim, rv = r * d->v_dim;
    size_t fsz = sizeof(float);
    for (int i = 0; i < n; i++) {
        const float *src = m->qkvz + (size_t)i * (size_t)h->qkvz_w, *ba = m->ba + (size_t)i * (size_t)h->ba_w;
        float *x = h->lx + (size_t)i * (size_t)h->conv_w, *z = h->lz + (size_t)i * (size_t)vd;
        for (int g = 0; g < d->n_k_heads; g++) {
            const float *s = src + (size_t)g * (size_t)gw;
            memcpy(x + (size_t)g * d->k_dim, s, (size_t)d->k_dim * fsz);
            memcpy(x + kd + (size_t)g * d->k_dim, s + d->k_dim, (size_t)d->k_dim * fsz);
            memcpy(x + 2 * kd + (size_t)g * rv, s + 2 * d->k_dim, (size_t)rv * fsz);
            memcpy(z + (size_t)g * rv, s + 2 * d->k_dim + rv, (size_t)rv * fsz);
            memcpy(h->lb + (size_t)i * nv + (size_t)g * r, ba + (size_t)g * 2 * r, (size_t)r * fsz);
            memcpy(h->la + (size_t)i * nv + (size_t)g * r, ba + (size_t)g * 2 * r + r, (size_t)r * fsz);
        }
    }
}

/* The hybrid block's mixer, except on qwen3_next's linear layers: their fused projections, regrouped, feed the
 * block's DeltaNet. */
static int mixer(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    qwen *m = ptr;
    if (m->h.fused && m->h.mixers[l] == 'L') {
        cb_linear_apply(&m->layers[l].in_qkvz, m->qkvz, m->d.h, n);
        cb_linear_apply(&m->layers[l].in_ba, m->ba, m->d.h, n);
        ungroup_qkvz(m, n);
        cb_hybrid_deltanet(&m->h, &m->d, l, kv, n);
    } else {
        cb_hybrid_forward(&m->h, &m->d, l, kv, n, pos0);
    }
    return 0;
}

CB_DECODER_BATCHED_ENGINE(qwen, "qwen", CB_HYBRID_RECIPE(qwen, h, HYBRID), .hparams = HPARAMS,
                          .layer_size = sizeof(qwen_layer), .layers_at = offsetof(qwen, layers), .tensors = TENSORS,
                          .scratch = SCRATCH, .routed = CB_FFN_MOE,
                          .mixer = mixer, .shared_prefix = "model.layers.%d.mlp.shared_expert.",
                          .shared_gate = "model.layers.%d.mlp.shared_expert_gate.weight");
