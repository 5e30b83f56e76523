/* qwen.c: the Qwen MoE engines (qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe[_text]), a recipe over the runtime's
 * decoder (decoder.h). Every layer is
 *
 *   x += mixer(norm(x))      mixer: GQA attention (gqa.h), or Gated DeltaNet (deltanet.h) on hybrid layers
 *   x += ffn(norm(x))        ffn: routed MoE (+ sigmoid-gated shared expert), or a dense MLP (mlp_only_layers)
 *
 * What differs between the four types is switched by hyperparameters the plugin resolves: qkv biases (qwen2_moe),
 * per-head q/k norm (qwen3+), zero-centred "1 + w" RMSNorms and the attention output gate (the hybrids), the
 * linear-attention projection layout (qwen3_next fuses q/k/v/z and b/a per key-head group; qwen3_5 splits them)
 * and weight_prefix (qwen3_5 nests the text model under model.language_model.).
 * Only full-attention layers hold KV; each DeltaNet layer keeps its state in the slot's recurrent state.
 */
#include <stdlib.h>
#include <string.h>

#include "decoder.h"
#include "deltanet.h"
#include "engine.h"
#include "gqa.h"

typedef struct {
    cb_gqa attn;               /* full layers */
    int kv_layer;
    cb_deltanet dn;            /* linear layers */
    cb_linear in_qkvz, in_ba;  /* qwen3_next layout */
    cb_linear in_qkv, in_z, in_b, in_a;   /* qwen3_5 layout */
    cb_linear out_proj;
    size_t state_off;          /* floats into the slot state */
} qwen_layer;

typedef struct {
    cb_decoder d;
    int sparse_step, n_full;
    const char *layer_types, *mlp_only;   /* --set strings */
    char *mixers, *ffns;       /* per layer: F full attention / L DeltaNet; D dense / M MoE */
    int split, fused;          /* the DeltaNet projections' layout: qwen3_5's split, or qwen3_next's fused */
    cb_gqa_config attn_cfg;
    cb_deltanet_config dn_cfg;
    int kd, vd, nv, conv_w, qkvz_w, ba_w;   /* DeltaNet widths (0 without linear layers) */
    size_t state;
    qwen_layer *layers;
    cb_rope rope;
    cb_gqa_scratch attn_scratch;
    float *lx, *lz, *lb, *la, *lo, *qkvz, *ba;
} qwen;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(qwen, d, 1e-6),
    CB_HP_REQ("num_experts", qwen, d.moe.n_experts), CB_HP_REQ("num_experts_per_tok", qwen, d.moe.top_k),
    CB_HP_REQ("moe_intermediate_size", qwen, d.moe.inter), CB_HP_FLAG("norm_topk_prob", qwen, d.moe.norm_topk_prob, 0),
    CB_HP_OPT("intermediate_size", qwen, d.inter, 0, CB_HP_NONNEG),
    CB_HP_OPT("shared_expert_intermediate_size", qwen, d.shared_inter, 0, CB_HP_NONNEG),
    CB_HP_OPT("decoder_sparse_step", qwen, sparse_step, 1, CB_HP_POSITIVE),
    CB_HP_REQ("num_attention_heads", qwen, attn_cfg.n_heads), CB_HP_REQ("num_key_value_heads", qwen, attn_cfg.n_kv_heads),
    CB_HP_OPT("head_dim", qwen, attn_cfg.head_dim, 0, CB_HP_NONNEG),
    CB_HP_FLAG("qkv_bias", qwen, attn_cfg.qkv_bias, 0), CB_HP_FLAG("attention_bias", qwen, attn_cfg.o_bias, 0),
    CB_HP_FLAG("qk_norm", qwen, attn_cfg.head_norm, 0), CB_HP_FLAG("attn_output_gate", qwen, attn_cfg.output_gate, 0),
    CB_HP_FLAG("zero_centered_norm", qwen, d.norm_offset, 0), CB_HP_TEXT("weight_prefix", qwen, d.prefix, "model."),
    CB_HP_TEXT("layer_types", qwen, layer_types, NULL), CB_HP_TEXT("mlp_only_layers", qwen, mlp_only, ""), CB_HP_END,
};
/* Read only when some layer is linear attention. */
static const cb_hp_spec LINEAR_HPARAMS[] = {
    CB_HP_CHOICE_OF("linear_projection", qwen, split, "fused,split", 0),
    CB_HP_REQ("linear_num_key_heads", qwen, dn_cfg.n_k_heads), CB_HP_REQ("linear_num_value_heads", qwen, dn_cfg.n_v_heads),
    CB_HP_REQ("linear_key_head_dim", qwen, dn_cfg.k_dim), CB_HP_REQ("linear_value_head_dim", qwen, dn_cfg.v_dim),
    CB_HP_OPT("linear_conv_kernel_dim", qwen, dn_cfg.kernel, 4, CB_HP_POSITIVE), CB_HP_END,
};

/* The blocks' prefixes (gqa.h and deltanet.h name the tensors under them), and the DeltaNet projections. */
#define SA "model.layers.%d.self_attn."
#define LA "model.layers.%d.linear_attn."
static const cb_tensor_spec TENSORS[] = {
    CB_LINEAR_IF_ON(LA "in_proj_qkvz.weight", qwen_layer, in_qkvz, qwen, qkvz_w, d.hidden, fused, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_ba.weight", qwen_layer, in_ba, qwen, ba_w, d.hidden, fused, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_qkv.weight", qwen_layer, in_qkv, qwen, conv_w, d.hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_z.weight", qwen_layer, in_z, qwen, vd, d.hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_b.weight", qwen_layer, in_b, qwen, nv, d.hidden, split, mixers, "L"),
    CB_LINEAR_IF_ON(LA "in_proj_a.weight", qwen_layer, in_a, qwen, nv, d.hidden, split, mixers, "L"),
    CB_LINEAR_ON(LA "out_proj.weight", qwen_layer, out_proj, qwen, d.hidden, vd, mixers, "L"),
    CB_TENSORS_END,
};

/* Per layer: the mixer (layer_types, default all full) and the FFN (every decoder_sparse_step-th layer routes unless
 * mlp_only_layers makes it dense); the DeltaNet widths when a layer needs them; the attention's shape and RoPE. */
static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    qwen *m = ptr;
    cb_gqa_config *a = &m->attn_cfg;
    cb_deltanet_config *c = &m->dn_cfg;
    int n = m->d.n_layers;
    if (!(m->mixers = calloc((size_t)n + 1, 1)) || !(m->ffns = calloc((size_t)n + 1, 1)))
        return cb_oom(err, errlen, "the layer kinds");
    for (int l = 0; l < n; l++) m->mixers[l] = 'F', m->ffns[l] = (l + 1) % m->sparse_step ? 'D' : 'M';
    if ((m->layer_types && cb_hp_layer_words("layer_types", m->layer_types, "full_attention=F,linear_attention=L", n,
                                             m->mixers, err, errlen)) ||
        cb_hp_layer_indices("mlp_only_layers", m->mlp_only, n, 'D', m->ffns, err, errlen) ||
        (strchr(m->mixers, 'L') && cb_hp_read(hp, LINEAR_HPARAMS, m, err, errlen)))
        return -1;
    m->d.ffn_layers = m->ffns;
    m->fused = !m->split, c->eps = m->d.eps;
    m->kd = c->n_k_heads * c->k_dim, m->vd = c->n_v_heads * c->v_dim, m->nv = c->n_v_heads;
    m->conv_w = 2 * m->kd + m->vd, m->qkvz_w = 2 * m->kd + 2 * m->vd, m->ba_w = 2 * m->nv;
    a->qkv_bias |= a->o_bias;  /* attention_bias biases all four projections (Qwen3); qkv_bias only q/k/v (Qwen2) */
    if (!a->head_dim) a->head_dim = m->d.hidden / a->n_heads;
    a->hidden = m->d.hidden, a->eps = m->d.eps, a->norm_offset = m->d.norm_offset;
    return cb_rope_init(&m->rope, hp, a->head_dim, 1, err, errlen);
}

static int load_layer(void *ptr, int l, char *err, size_t errlen) {
    qwen *m = ptr;
    qwen_layer *L = &m->layers[l];
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

static const cb_scratch_spec SCRATCH[] = {
    CB_SCRATCH(qwen, lx, conv_w, 1), CB_SCRATCH(qwen, lz, vd, 1), CB_SCRATCH(qwen, lo, vd, 1),
    CB_SCRATCH(qwen, lb, nv, 1), CB_SCRATCH(qwen, la, nv, 1), CB_SCRATCH(qwen, qkvz, qkvz_w, 1),
    CB_SCRATCH(qwen, ba, ba_w, 1), CB_SCRATCH_END,
};

static int finish(void *ptr, cb_model_info *info, char *err, size_t errlen) {
    qwen *m = ptr;
    info->n_layers = m->n_full;
    info->kv_dim = m->attn_cfg.n_kv_heads * m->attn_cfg.head_dim;
    info->state_bytes = m->state * sizeof(float);
    return m->n_full ? cb_gqa_scratch_init(&m->attn_scratch, &m->attn_cfg, m->d.max_batch, m->d.ctx, err, errlen) : 0;
}

/* Qwen3-Next's in_proj_qkvz / in_proj_ba interleave per key-head group g: [q k v(r heads) z(r heads)] and
 * [b(r) a(r)], r = value heads per key head. Regroup into the conv input [q | k | v] and z, b, a. */
static void ungroup_qkvz(const qwen *m, int n) {
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

static void linear_mixer(qwen *m, qwen_layer *L, cb_kv *kv, int n, int fused) {
    const float *h = m->d.h;
    if (fused) {
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
 * d->proj (decoder.h runs the norms, residuals, MoE with its shared expert, and the logits around it). */
static int mixer(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    qwen *m = ptr;
    qwen_layer *L = &m->layers[l];
    if (m->mixers[l] == 'F')
        cb_gqa_forward(&L->attn, &m->attn_scratch, m->d.proj, m->d.h, n, kv, L->kv_layer, pos0, &m->rope);
    else
        linear_mixer(m, L, kv, n, m->fused);
    return 0;
}

static void free_layer(void *model, void *layer) {
    (void)model;
    qwen_layer *L = layer;
    cb_gqa_free(&L->attn);
    cb_deltanet_free(&L->dn);
}

static void free_model(void *ptr) {
    qwen *m = ptr;
    cb_rope_free(&m->rope);
    cb_gqa_scratch_free(&m->attn_scratch);
    free(m->mixers);
    free(m->ffns);
}

static const cb_recipe RECIPE = {
    .hparams = HPARAMS, .model_size = sizeof(qwen), .layer_size = sizeof(qwen_layer), .layers_at = offsetof(qwen, layers),
    .tensors = TENSORS, .scratch = SCRATCH, .routed = CB_FFN_MOE, .setup = setup, .load_layer = load_layer,
    .finish = finish, .mixer = mixer, .free_layer = free_layer, .free_model = free_model,
    .shared_prefix = "model.layers.%d.mlp.shared_expert.", .shared_gate = "model.layers.%d.mlp.shared_expert_gate.weight",
};

static int qwen_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family qwen_family = {"qwen", qwen_load, cb_decoder_forward, cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &qwen_family); }
