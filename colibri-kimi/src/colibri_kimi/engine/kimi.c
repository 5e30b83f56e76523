/* kimi.c: the Kimi K2 engine (DeepSeek-V3 architecture under model_type kimi_k2), a recipe over the runtime's
 * decoder (decoder.h) and latent-attention layer (latent.h). This package ships its own recipe so that
 * colibri-kimi alone runs Kimi K2.
 *
 *   attention = MLA over the compressed cache (mla.h), interleaved RoPE on the rope part unless rope_interleave=0
 *
 * Every layer:  x += attention(rmsnorm(x));  x += mlp(rmsnorm(x))
 * where mlp is a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE with shared experts
 * (grouped_moe.h). Multi-token-prediction layers stored after the last decoder layer are never loaded.
 * The plugin resolves config.json into --set values; mlp_layers has one letter per layer (D dense, M MoE).
 * Kimi Linear (KDA + NoPE MLA) is its own composition with its own binary (kimi_linear.c); the plugin's
 * engine_source picks the binary by model_type.
 */

#include "decoder.h"
#include "engine.h"
#include "latent.h"

typedef struct {
    cb_decoder d;
    cb_latent_shape attn;
    int interleave;            /* rope_interleave: interleaved pairs (default) or half-split */
    cb_latent *layers;
    cb_rope rope;
} kimi;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(kimi, d, 1e-6), CB_DECODER_GROUPED_HPARAMS(kimi, d), CB_MLA_HPARAMS(kimi, attn),
    CB_HP_FLAG("attention_bias", kimi, attn.mla.bias, 0), CB_MLA_SCALE_HPARAM(kimi, attn),
    CB_HP_FLAG("rope_interleave", kimi, interleave, 1), CB_HP_END,
};

static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    kimi *m = ptr;
    cb_latent_shape_finish(&m->attn, m->d.hidden);
    return cb_rope_init(&m->rope, hp, m->attn.mla.rope, !m->interleave, err, errlen);
}

static int load_layer(void *ptr, int l, char *err, size_t errlen) {
    kimi *m = ptr;
    return cb_latent_init(&m->layers[l], &m->d.idx, l, &m->attn, 0, m->d.max_batch, m->d.ctx, &m->d.dense_bytes, err,
                          errlen);
}

static int finish(void *ptr, cb_model_info *info, char *err, size_t errlen) {
    (void)err, (void)errlen;
    kimi *m = ptr;
    info->kv_dim = m->attn.kv_width;
    info->kv_k_only = 1;
    return 0;
}

static int attention(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    kimi *m = ptr;
    cb_latent_forward(&m->layers[l], &m->attn, m->d.proj, m->d.h, n, pos0, kv, l, &m->rope, NULL, NULL);
    return 0;
}

static void free_model(void *ptr) { cb_rope_free(&((kimi *)ptr)->rope); }

static const cb_recipe RECIPE = {
    .hparams = HPARAMS, .model_size = sizeof(kimi), .layer_size = sizeof(cb_latent),
    .layers_at = offsetof(kimi, layers),
    .routed = CB_FFN_GROUPED, .setup = setup, .load_layer = load_layer, .finish = finish, .mixer = attention,
    .free_layer = cb_latent_free_layer, .free_model = free_model,
};

static int kimi_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family kimi_family
    = {.name = "kimi", .load = kimi_load, .forward = cb_decoder_forward,
       .forward_batch = cb_decoder_forward_batch, .free = cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &kimi_family); }
