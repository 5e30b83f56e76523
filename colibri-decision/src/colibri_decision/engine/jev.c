/* jev.c: JEV decision models (transformers' JevForDecision): a Qwen3.5 dense text backbone (qwen3_5_text) and a
 * linear decision head at the token before each <|mark|>. A recipe over the runtime's decoder (decoder.h):
 *
 *   x += mixer(norm(x))      gated GQA on full-attention layers, Gated DeltaNet on linear ones (hybrid.h)
 *   x += mlp(norm(x))        a dense SwiGLU on every layer
 *   scores = softcap(proj(norm(x)) + bias)   the decoder's decision head (CB_DECODER_HEAD_HPARAMS)
 *
 * The engine's logits are the head's num_verbalizers scores (the rest of each row -inf): a question's options are
 * the rows from its type's offset on, which the plugin passes as the decide op's option ids. It only decides.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "hybrid.h"

typedef struct {
    cb_hybrid h;               /* first: the mixer (hybrid.h), and the decoder inside it */
    char *ffns;                /* every layer dense */
} jev;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(jev, h.d, 1e-6), CB_DECODER_HEAD_HPARAMS(jev, h.d),
    CB_HP_REQ("intermediate_size", jev, h.d.inter), CB_HP_FLAG("zero_centered_norm", jev, h.d.norm_offset, 1),
    CB_HP_TEXT("weight_prefix", jev, h.d.prefix, "model."), CB_HP_END,
};

static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    jev *m = ptr;
    size_t n = (size_t)m->h.d.n_layers;
    if (!m->h.d.head_rows) {
        snprintf(err, errlen, "--set decision_head_rows is required (the head's num_verbalizers)");
        return -1;
    }
    if (cb_hybrid_setup(&m->h, hp, err, errlen)) return -1;
    if (!(m->ffns = calloc(n + 1, 1))) return cb_oom(err, errlen, "the layer kinds");
    memset(m->ffns, 'D', n);
    m->h.d.ffn_layers = m->ffns;
    return 0;
}

static void free_model(void *ptr) {
    jev *m = ptr;
    cb_hybrid_free(&m->h);
    free(m->ffns);
}

static const cb_recipe RECIPE = {
    CB_HYBRID_RECIPE, .hparams = HPARAMS, .model_size = sizeof(jev), .routed = CB_FFN_NONE, .setup = setup,
    .free_model = free_model,
};

static int jev_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family jev_family
    = {.name = "jev", .load = jev_load, .forward = cb_decoder_forward, .free = cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &jev_family); }
