/* jev.c: JEV decision models (transformers' JevForDecision): a Qwen3.5 dense text backbone (qwen3_5_text) and a
 * linear decision head at the token before each <|mark|>. A recipe over the runtime's decoder (decoder.h) and
 * hybrid mixer block (hybrid.h):
 *
 *   x += mixer(norm(x))      gated GQA on full-attention layers, Gated DeltaNet on linear ones (hybrid.h)
 *   x += mlp(norm(x))        a dense SwiGLU on every layer
 *   scores = softcap(proj(norm(x)) + bias)   the decoder's decision head (CB_DECODER_HEAD_HPARAMS)
 *
 * The engine's logits are the head's num_verbalizers scores (the rest of each row -inf): a question's options are
 * the rows from its type's offset on, which the plugin passes as the decide op's option ids. It only decides.
 */
#include "engine.h"
#include "hybrid.h"

typedef struct {
    cb_decoder d;
    cb_hybrid h;
} jev;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(jev, d, 1e-6), CB_DECODER_HEAD_HPARAMS(jev, d), CB_HP_REQ("intermediate_size", jev, d.inter),
    CB_HP_FLAG("zero_centered_norm", jev, d.norm_offset, 1), CB_HP_TEXT("weight_prefix", jev, d.prefix, "model."),
    CB_HP_END,
};
static const cb_hybrid_spec HYBRID = {.fused = 0};   /* Qwen3.5 splits its linear-attention projections */

/* Gated GQA on full-attention layers, Gated DeltaNet on the rest (the hybrid block's). */
static int mixer(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    jev *m = ptr;
    cb_hybrid_forward(&m->h, &m->d, l, kv, n, pos0);
    return 0;
}

CB_DECODER_ENGINE(jev, "jev", CB_HYBRID_RECIPE(jev, h, HYBRID), .hparams = HPARAMS, .routed = CB_FFN_DENSE,
                  .mixer = mixer);
