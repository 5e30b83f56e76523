/* deepseek.c: the DeepSeek MLA engines, a recipe over the runtime's decoder (decoder.h) and latent-attention
 * layer (latent.h).
 *
 *   deepseek_v3   (V3 / R1)  attention = MLA over the compressed cache (mla.h), interleaved RoPE on the rope part
 *   deepseek_v32  (V3.2)     attention = MLA restricted to the DSA indexer's top-k positions (dsa.h); every layer
 *                            runs its own indexer, whose RoPE rotates HALF-SPLIT pairs (the attention's stays
 *                            interleaved), so the engine keeps two rotary tables over the same frequencies
 *
 * Every layer:  x += attention(rmsnorm(x));  x += mlp(rmsnorm(x))
 * where mlp is a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE with shared experts
 * (grouped_moe.h). Multi-token-prediction layers stored after the last decoder layer are never loaded.
 * The plugin resolves config.json into --set values; mlp_layers has one letter per layer (D dense, M MoE).
 * deepseek_v4 is a different composition with its own binary (deepseek_v4.c); the plugin's engine_source picks
 * the binary by model_type.
 */
#include <stdio.h>
#include <string.h>

#include "decoder.h"
#include "engine.h"
#include "latent.h"

typedef struct {
    cb_decoder d;
    const char *attention;     /* mla (V3) or dsa (V3.2) */
    cb_latent_shape attn;
    int interleave;            /* rope_interleave (MLA only): interleaved pairs (default) or half-split */
    cb_latent *layers;
    cb_rope rope, index_rope;
    cb_latent_sel sel;
} ds;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(ds, d, 1e-6), CB_DECODER_GROUPED_HPARAMS(ds, d), CB_MLA_HPARAMS(ds, attn),
    CB_HP_FLAG("attention_bias", ds, attn.mla.bias, 0), CB_MLA_SCALE_HPARAM(ds, attn),
    CB_HP_TEXT("attention", ds, attention, "mla"), CB_HP_END,
};
static const cb_hp_spec DENSE_HPARAMS[] = {CB_HP_FLAG("rope_interleave", ds, interleave, 1), CB_HP_END};
static const cb_hp_spec SPARSE_HPARAMS[] = {CB_DSA_HPARAMS(ds, attn), CB_HP_END};

static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    ds *m = ptr;
    m->attn.sparse = !strcmp(m->attention, "dsa");
    if (!m->attn.sparse && strcmp(m->attention, "mla")) {
        snprintf(err, errlen, "--set attention=%s: expected mla or dsa", m->attention);
        return -1;
    }
    if (cb_hp_read(hp, m->attn.sparse ? SPARSE_HPARAMS : DENSE_HPARAMS, m, err, errlen)) return -1;
    if (m->attn.sparse) m->interleave = 1;
    cb_latent_shape_finish(&m->attn, m->d.hidden);
    return cb_rope_init(&m->rope, hp, m->attn.mla.rope, !m->interleave, err, errlen) ||
           (m->attn.sparse && cb_rope_init(&m->index_rope, hp, m->attn.mla.rope, 1, err, errlen));
}

static int load_layer(void *ptr, int l, char *err, size_t errlen) {
    ds *m = ptr;   /* V3.2: every layer runs its own indexer */
    return cb_latent_init(&m->layers[l], &m->d.idx, l, &m->attn, 1, m->d.max_batch, m->d.ctx, &m->d.dense_bytes, err,
                          errlen);
}

static int finish(void *ptr, cb_model_info *info, char *err, size_t errlen) {
    ds *m = ptr;
    info->kv_dim = m->attn.kv_width;
    info->kv_k_only = 1;
    return cb_latent_sel_init(&m->sel, &m->attn, m->d.max_batch) ? cb_oom(err, errlen, "the DSA selection") : 0;
}

static int attention(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    ds *m = ptr;
    cb_latent_forward(&m->layers[l], &m->attn, m->d.proj, m->d.h, n, pos0, kv, l, &m->rope, &m->index_rope, &m->sel);
    return 0;
}

static void free_model(void *ptr) {
    ds *m = ptr;
    cb_rope_free(&m->rope);
    cb_rope_free(&m->index_rope);
    cb_latent_sel_free(&m->sel);
}

static const cb_recipe RECIPE = {
    .hparams = HPARAMS, .model_size = sizeof(ds), .layer_size = sizeof(cb_latent), .layers_at = offsetof(ds, layers),
    .routed = CB_FFN_GROUPED, .setup = setup, .load_layer = load_layer, .finish = finish, .mixer = attention,
    .free_layer = cb_latent_free_layer, .free_model = free_model,
};

static int ds_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family ds_family
    = {.name = "deepseek-v4", .load = ds_load, .forward = cb_decoder_forward,
       .forward_batch = cb_decoder_forward_batch, .free = cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &ds_family); }
