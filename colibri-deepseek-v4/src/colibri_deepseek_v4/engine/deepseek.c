/* deepseek.c: the DeepSeek MLA engines, a recipe over the runtime's decoder (decoder.h) and attention block
 * (latent.h).
 *
 *   deepseek_v3   (V3 / R1)  attention = MLA over the compressed cache (mla.h), interleaved RoPE on the rope part
 *   deepseek_v32  (V3.2)     attention = MLA restricted to the DSA indexer's top-k positions (dsa.h); every layer
 *                            runs its own indexer, whose RoPE rotates HALF-SPLIT pairs (the attention's stays
 *                            interleaved), so the block keeps two rotary tables over the same frequencies
 *
 * Every layer:  x += attention(rmsnorm(x));  x += mlp(rmsnorm(x))
 * where mlp is a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE with shared experts
 * (grouped_moe.h). Multi-token-prediction layers stored after the last decoder layer are never loaded.
 * The plugin resolves config.json into --set values; mlp_layers has one letter per layer (D dense, M MoE), and
 * attention= picks mla or dsa. deepseek_v4 is a different composition with its own binary (deepseek_v4.c); the
 * plugin's engine_source picks the binary by model_type.
 */
#include "engine.h"
#include "latent.h"

typedef struct {
    cb_decoder d;
    cb_attention attn;
} ds;

static const cb_hp_spec HPARAMS[] = {CB_DECODER_HPARAMS(ds, d, 1e-6), CB_DECODER_GROUPED_HPARAMS(ds, d), CB_HP_END};
static const cb_attention_spec ATTENTION = {.kinds = "mla,dsa", .index_neox = 1};

/* V3: MLA over every cached position. V3.2: the layer's own indexer, rotating its half-split table, picks the
 * top-k positions first, and the attention reads only those. */
static int attention(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    ds *m = ptr;
    cb_attention_forward(&m->attn, l, m->d.proj, m->d.h, n, pos0, kv, &m->attn.index_rope);
    return 0;
}

CB_DECODER_BATCHED_ENGINE(ds, "deepseek-v4", CB_ATTENTION_RECIPE(ds, attn, ATTENTION), .hparams = HPARAMS,
                          .routed = CB_FFN_GROUPED, .mixer = attention);
