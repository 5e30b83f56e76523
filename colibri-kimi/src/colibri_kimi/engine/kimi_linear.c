/* kimi_linear.c: the Kimi Linear engine (model_type kimi_linear), a recipe over the runtime's decoder (decoder.h)
 * and attention block (latent.h). Its own binary (colibri-kimi-linear), apart from Kimi K2's (kimi.c).
 *
 * Every layer:  x += mixer(rmsnorm(x));  x += mlp(rmsnorm(x))
 *   mixer: Kimi Delta Attention (kda.h) on linear layers, MLA without RoPE (mla.h) on full layers
 *   mlp:   a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE + shared experts (grouped_moe.h),
 *          under block_sparse_moe. with experts stored as w1 (gate) / w3 (up) / w2 (down)
 * Only MLA layers hold KV (the compressed latent); each KDA layer keeps its conv windows and delta-rule memory in
 * the slot's recurrent state. The plugin resolves config.json into --set values: attn_layers has one letter per
 * layer (K KDA, F full MLA), mlp_layers one per layer (D dense, M MoE).
 */
#include <string.h>

#include "engine.h"
#include "kda.h"
#include "latent.h"

typedef struct {
    cb_linear q, k, v, f_a, f_b, b, g_a, g_b, o;
    cb_kda kda;
    size_t state_off;          /* floats into the slot state */
} kl_layer;

typedef struct {
    cb_decoder d;
    cb_attention attn;         /* the full layers' */
    cb_kda_config kda;
    const char *attn_layers;   /* K: KDA, F: full MLA */
    int kda_width;
    kl_layer *layers;
    float *lx, *lf, *lb, *lg, *lo, *low;
} kimi_linear;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(kimi_linear, d, 1e-5), CB_DECODER_GROUPED_HPARAMS(kimi_linear, d),
    CB_HP_REQ("linear_num_heads", kimi_linear, kda.n_heads), CB_HP_REQ("linear_head_dim", kimi_linear, kda.head_dim),
    CB_HP_OPT("linear_conv_kernel_dim", kimi_linear, kda.kernel, 4, CB_HP_POSITIVE),
    CB_HP_NUM("rms_norm_eps", kimi_linear, kda.eps, 1e-5, CB_HP_POSITIVE),   /* the KDA output norm's too */
    CB_HP_PER_LAYER("attn_layers", kimi_linear, attn_layers, "KF", d.n_layers), CB_HP_END,
};
/* kv_a_layernorm keeps KimiLinearRMSNorm's default eps (latent.h's lora_eps). */
static const cb_attention_spec ATTENTION = {.kinds = "mla", .nope = 1, .on = "F",
                                            .letters = offsetof(kimi_linear, attn_layers)};

/* The KDA layers' projections (the full layers' MLA is the attention block's). */
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

static const cb_scratch_spec SCRATCH[] = {
    CB_SCRATCH(kimi_linear, lx, kda_width, 3), CB_SCRATCH(kimi_linear, lf, kda_width, 1),
    CB_SCRATCH(kimi_linear, lg, kda_width, 1), CB_SCRATCH(kimi_linear, lo, kda_width, 1),
    CB_SCRATCH(kimi_linear, lb, kda.n_heads, 1), CB_SCRATCH(kimi_linear, low, kda.head_dim, 1), CB_SCRATCH_END,
};

static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    (void)hp, (void)err, (void)errlen;
    kimi_linear *m = ptr;
    m->kda_width = m->kda.n_heads * m->kda.head_dim;
    return 0;
}

/* A KDA layer's convolutions, decay and norm, and its place in the slot's recurrent state. */
static int load_layer(void *ptr, int l, char *err, size_t errlen) {
    kimi_linear *m = ptr;
    kl_layer *L = &m->layers[l];
    char sa[128];
    if (m->attn_layers[l] != 'K') return 0;
    L->state_off = cb_decoder_state(&m->d, cb_kda_state_floats(&m->kda));
    return cb_kda_init(&L->kda, &m->d.idx, cb_decoder_name(&m->d, sa, sizeof sa, SA, l), &m->kda, &m->d.dense_bytes,
                       err, errlen);
}

static void free_layer(void *model, void *layer) {
    (void)model;
    cb_kda_free(&((kl_layer *)layer)->kda);
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
    if (m->attn_layers[l] == 'F') cb_attention_forward(&m->attn, l, m->d.proj, m->d.h, n, pos0, kv, NULL);
    else kda_mixer(m, &m->layers[l], kv, n);
    return 0;
}

CB_DECODER_BATCHED_ENGINE(kimi_linear, "kimi", CB_ATTENTION_RECIPE(kimi_linear, attn, ATTENTION), .hparams = HPARAMS,
                          .layer_size = sizeof(kl_layer), .layers_at = offsetof(kimi_linear, layers),
                          .tensors = TENSORS,
                          .scratch = SCRATCH, .routed = CB_FFN_GROUPED, .expert_mats = {"w1", "w3", "w2"},
                          .moe_prefix = "model.layers.%d.block_sparse_moe.",
                          /* The original checkpoints keep a dense layer under mlp.; transformers saves it under
                           * block_sparse_moe. */
                          .dense_prefixes = {"model.layers.%d.mlp.", "model.layers.%d.block_sparse_moe."},
                          .setup = setup, .load_layer = load_layer, .free_layer = free_layer,
                          .mixer = mixer);
