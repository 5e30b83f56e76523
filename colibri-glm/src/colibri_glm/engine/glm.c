/* glm.c: the GLM MoE engines, a recipe over the runtime's decoder (decoder.h) and attention block (latent.h).
 *
 *   glm4_moe       (GLM-4.5/4.6/4.7)  attention = GQA (gqa.h), qkv bias, optional per-head q/k RMSNorm, partial
 *                                     half-split RoPE
 *   glm4_moe_lite  (GLM-4.7-Flash)    attention = MLA over the compressed cache (mla.h)
 *   glm_moe_dsa    (GLM-5)            attention = MLA restricted to the DSA indexer's top-k positions (dsa.h)
 *
 * Every layer:  x += attention(rmsnorm(x));  x += mlp(rmsnorm(x))
 * where mlp is a dense SwiGLU (leading layers) or the grouped sigmoid-routed MoE with shared experts
 * (grouped_moe.h). Multi-token-prediction layers stored after the last decoder layer are never loaded.
 *
 * The plugin resolves config.json into --set values; attention= picks the kind, and per-layer kinds arrive as
 * strings with one letter per layer: mlp_layers (D dense, M MoE) and, for DSA, indexer_layers (F runs its own
 * indexer, S reuses the previous one's selection).
 */
#include "engine.h"
#include "latent.h"

typedef struct {
    cb_decoder d;
    cb_attention attn;
} glm;

static const cb_hp_spec HPARAMS[] = {CB_DECODER_HPARAMS(glm, d, 1e-5), CB_DECODER_GROUPED_HPARAMS(glm, d), CB_HP_END};
static const cb_attention_spec ATTENTION = {.kinds = "gqa,mla,dsa", .shared_indexers = 1};

/* GQA, MLA or DSA as attention= says; GLM-5's indexer rotates with the attention's own (interleaved) table, and a
 * layer without an indexer attends to the selection the last one made. */
static int attention(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    glm *m = ptr;
    cb_attention_forward(&m->attn, l, m->d.proj, m->d.h, n, pos0, kv, &m->attn.rope);
    return 0;
}

CB_DECODER_ENGINE(glm, "glm", CB_ATTENTION_RECIPE(glm, attn, ATTENTION), .hparams = HPARAMS,
                  .routed = CB_FFN_GROUPED, .mixer = attention);
