/* kimi_linear.c: the Kimi Linear engine (model_type kimi_linear), a recipe over the runtime's decoder (decoder.h).
 * Its own binary (colibri-kimi-linear), apart from Kimi K2's (kimi.c).
 *
 * Every layer:  x += mixer(rmsnorm(x));  x += mlp(rmsnorm(x))
 *   mixer: Kimi Delta Attention (kda.h) on linear layers, MLA without RoPE (mla.h, rope NULL) on full layers
 *   mlp:   a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE + shared experts (grouped_moe.h),
 *          under block_sparse_moe. with experts stored as w1 (gate) / w3 (up) / w2 (down)
 * Only MLA layers hold KV (the compressed latent); each KDA layer keeps its conv windows and delta-rule memory in
 * the slot's recurrent state. The plugin resolves config.json into --set values: attn_layers has one letter per
 * layer (K KDA, F full MLA), mlp_layers one per layer (D dense, M MoE).
 */
#include <stdio.h>
#include <string.h>

#include "decoder.h"
#include "engine.h"
#include "kda.h"
#include "latent.h"

typedef struct {
    int full;
    cb_latent mla;             /* full layers */
    int kv_layer;
    cb_linear q, k, v, f_a, f_b, b, g_a, g_b, o;   /* KDA layers */
    cb_kda kda;
    size_t state_off;          /* floats into the slot state */
} kl_layer;

typedef struct {
    cb_decoder d;
    cb_latent_shape attn;
    cb_kda_config kda;
    const char *attn_layers;   /* K: KDA, F: full MLA */
    int n_full, kda_width;
    size_t state;
    kl_layer *layers;
    float *lx, *lf, *lb, *lg, *lo, *low;
} kimi_linear;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(kimi_linear, d, 1e-5), CB_DECODER_GROUPED_HPARAMS(kimi_linear, d),
    CB_MLA_HPARAMS(kimi_linear, attn), CB_HP_REQ("linear_num_heads", kimi_linear, kda.n_heads),
    CB_HP_REQ("linear_head_dim", kimi_linear, kda.head_dim),
    CB_HP_OPT("linear_conv_kernel_dim", kimi_linear, kda.kernel, 4, CB_HP_POSITIVE),
    CB_HP_PER_LAYER("attn_layers", kimi_linear, attn_layers, "KF", d.n_layers), CB_HP_END,
};

/* Kimi Linear's experts: gate, up, down are w1, w3, w2. */
static const char *const EXPERT_MATS[3] = {"w1", "w3", "w2"};

static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    (void)hp, (void)err, (void)errlen;
    kimi_linear *m = ptr;
    m->d.moe.expert_mats = EXPERT_MATS;
    m->kda.eps = m->d.eps;
    m->kda_width = m->kda.n_heads * m->kda.head_dim;
    cb_latent_shape_finish(&m->attn, m->d.hidden);   /* kv_a_layernorm keeps KimiLinearRMSNorm's default eps */
    return 0;
}

/* The KDA layers' projections (the full layers' MLA loads its own). */
#define SA "model.layers.%d.self_attn."
static const cb_tensor_spec TENSORS[] = {
    CB_LINEAR_ON(SA "q_proj.weight", kl_layer, q, kimi_linear, kda_width, d.hidden, attn_layers, "K"),
    CB_LINEAR_ON(SA "k_proj.weight", kl_layer, k, kimi_linear, kda_width, d.hidden, attn_layers, "K"),
    CB_LINEAR_ON(SA "v_proj.weight", kl_layer, v, kimi_linear, kda_width, d.hidden, attn_layers, "K"),
    CB_LINEAR_ON(SA "f_a_proj.weight", kl_layer, f_a, kimi_linear, kda.head_dim, d.hidden, attn_layers, "K"),
    CB_LINEAR_ON(SA "f_b_proj.weight", kl_layer, f_b, kimi_linear, kda_width, kda.head_dim, attn_layers, "K"),
    CB_LINEAR_ON(SA "b_proj.weight", kl_layer, b, kimi_linear, kda.n_heads, d.hidden, attn_layers, "K"),
    CB_LINEAR_ON(SA "g_a_proj.weight", kl_layer, g_a, kimi_linear, kda.head_dim, d.hidden, attn_layers, "K"),
    CB_LINEAR_ON(SA "g_b_proj.weight", kl_layer, g_b, kimi_linear, kda_width, kda.head_dim, attn_layers, "K"),
    CB_LINEAR_ON(SA "o_proj.weight", kl_layer, o, kimi_linear, d.hidden, kda_width, attn_layers, "K"),
    CB_TENSORS_END,
};

static int load_layer(void *ptr, int l, char *err, size_t errlen) {
    kimi_linear *m = ptr;
    kl_layer *L = &m->layers[l];
    if (m->attn_layers[l] == 'F') {
        L->full = 1;
        L->kv_layer = m->n_full++;
        return cb_latent_init(&L->mla, &m->d.idx, l, &m->attn, 0, m->d.max_batch, m->d.ctx, &m->d.dense_bytes, err,
                              errlen);
    }
    L->state_off = m->state;
    m->state += cb_kda_state_floats(&m->kda);
    char sa[128];
    snprintf(sa, sizeof sa, SA, l);
    return cb_kda_init(&L->kda, &m->d.idx, sa, &m->kda, &m->d.dense_bytes, err, errlen);
}

static const cb_scratch_spec SCRATCH[] = {
    CB_SCRATCH(kimi_linear, lx, kda_width, 3), CB_SCRATCH(kimi_linear, lf, kda_width, 1),
    CB_SCRATCH(kimi_linear, lg, kda_width, 1), CB_SCRATCH(kimi_linear, lo, kda_width, 1),
    CB_SCRATCH(kimi_linear, lb, kda.n_heads, 1), CB_SCRATCH(kimi_linear, low, kda.head_dim, 1), CB_SCRATCH_END,
};

static int finish(void *ptr, cb_model_info *info, char *err, size_t errlen) {
    (void)err, (void)errlen;
    kimi_linear *m = ptr;
    info->n_layers = m->n_full;
    info->kv_dim = m->attn.kv_width;
    info->kv_k_only = 1;
    info->state_bytes = m->state * sizeof(float);
    return 0;
}

/* out = W_b (W_a x): the forget and output gates' low-rank projections. */
static void low_rank(kimi_linear *m, const cb_linear *a, const cb_linear *b, float *out, int n) {
    cb_linear_apply(a, m->low, m->d.h, n);
    cb_linear_apply(b, out, m->low, n);
}

static void kda_mixer(kimi_linear *m, kl_layer *L, cb_kv *kv, int n) {
    size_t W = (size_t)m->kda_width;
    const float *h = m->d.h;
    /* [q | k | v] rows for the stacked short convolutions: project each, then interleave per row. */
    cb_linear_apply(&L->q, m->lo, h, n);
    for (int i = 0; i < n; i++) memcpy(m->lx + (size_t)i * 3 * W, m->lo + (size_t)i * W, W * sizeof(float));
    cb_linear_apply(&L->k, m->lo, h, n);
    for (int i = 0; i < n; i++) memcpy(m->lx + (size_t)i * 3 * W + W, m->lo + (size_t)i * W, W * sizeof(float));
    cb_linear_apply(&L->v, m->lo, h, n);
    for (int i = 0; i < n; i++) memcpy(m->lx + (size_t)i * 3 * W + 2 * W, m->lo + (size_t)i * W, W * sizeof(float));
    low_rank(m, &L->f_a, &L->f_b, m->lf, n);
    low_rank(m, &L->g_a, &L->g_b, m->lg, n);
    cb_linear_apply(&L->b, m->lb, h, n);
    cb_kda_forward(&L->kda, kv->state + L->state_off, m->lo, m->lx, m->lf, m->lb, m->lg, n);
    cb_linear_apply(&L->o, m->d.proj, m->lo, n);
}

/* Full layers: MLA without RoPE on their own KV layer; the rest: Kimi Delta Attention on the slot state. */
static int mixer(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    kimi_linear *m = ptr;
    kl_layer *L = &m->layers[l];
    if (L->full) cb_latent_forward(&L->mla, &m->attn, m->d.proj, m->d.h, n, pos0, kv, L->kv_layer, NULL, NULL, NULL);
    else kda_mixer(m, L, kv, n);
    return 0;
}

static void free_layer(void *model, void *layer) {
    (void)model;
    kl_layer *L = layer;
    cb_latent_free(&L->mla);
    cb_kda_free(&L->kda);
}

static const cb_recipe RECIPE = {
    .hparams = HPARAMS, .model_size = sizeof(kimi_linear), .layer_size = sizeof(kl_layer),
    .layers_at = offsetof(kimi_linear, layers), .tensors = TENSORS, .routed = CB_FFN_GROUPED,
    .moe_prefix = "model.layers.%d.block_sparse_moe.",
    /* The original checkpoints keep a dense layer under mlp.; transformers saves it under block_sparse_moe. */
    .dense_prefixes = {"model.layers.%d.mlp.", "model.layers.%d.block_sparse_moe."},
    .setup = setup, .load_layer = load_layer, .finish = finish, .mixer = mixer, .free_layer = free_layer,
    .scratch = SCRATCH,
};

static int kl_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family kl_family
    = {.name = "kimi", .load = kl_load, .forward = cb_decoder_forward,
       .forward_batch = cb_decoder_forward_batch, .free = cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &kl_family); }
