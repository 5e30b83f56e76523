/* kimi.c: the Kimi K2 engine (DeepSeek-V3 architecture under model_type kimi_k2), a recipe over the runtime's
 * decoder (decoder.h) and attention block (latent.h). This package ships its own recipe so that colibri-kimi
 * alone runs Kimi K2.
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
#include "engine.h"
#include "latent.h"

typedef struct {
    cb_decoder d;
    cb_attention attn;
} kimi;

static const cb_hp_spec HPARAMS[] = {CB_DECODER_HPARAMS(kimi, d, 1e-6), CB_DECODER_GROUPED_HPARAMS(kimi, d),
                                     CB_HP_END};
static const cb_attention_spec ATTENTION = {.kinds = "mla"};

/* MLA over every cached position of the layer. */
static int attention(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    kimi *m = ptr;
    cb_attention_forward(&m->attn, l, m->d.proj, m->d.h, n, pos0, kv, NULL);
    return 0;
}

CB_DECODER_BATCHED_ENGINE(kimi, "kimi", CB_ATTENTION_RECIPE(kimi, attn, ATTENTION), .hparams = HPARAMS,
                          .routed = CB_FFN_GROUPED, .mixer = attention);
