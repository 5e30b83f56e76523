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
 * Only full-attention layers hold KV; each DeltaNet layer keeps its state in the slot's recurrent state. The mixers
 * are the runtime's hybrid block (hybrid.h); this file adds the MoE feed-forward.
 */
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "hybrid.h"

typedef struct {
    cb_hybrid h;               /* first: the mixer (hybrid.h), and the decoder inside it */
    int sparse_step;
    const char *mlp_only;      /* --set string */
    char *ffns;                /* per layer: D dense / M MoE */
} qwen;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(qwen, h.d, 1e-6),
    CB_HP_REQ("num_experts", qwen, h.d.moe.n_experts), CB_HP_REQ("num_experts_per_tok", qwen, h.d.moe.top_k),
    CB_HP_REQ("moe_intermediate_size", qwen, h.d.moe.inter),
    CB_HP_FLAG("norm_topk_prob", qwen, h.d.moe.norm_topk_prob, 0),
    CB_HP_OPT("intermediate_size", qwen, h.d.inter, 0, CB_HP_NONNEG),
    CB_HP_OPT("shared_expert_intermediate_size", qwen, h.d.shared_inter, 0, CB_HP_NONNEG),
    CB_HP_OPT("decoder_sparse_step", qwen, sparse_step, 1, CB_HP_POSITIVE),
    CB_HP_FLAG("zero_centered_norm", qwen, h.d.norm_offset, 0), CB_HP_TEXT("weight_prefix", qwen, h.d.prefix, "model."),
    CB_HP_TEXT("mlp_only_layers", qwen, mlp_only, ""), CB_HP_END,
};

/* The mixers (hybrid.h), then the FFN per layer: every decoder_sparse_step-th layer routes unless mlp_only_layers
 * makes it dense. */
static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    qwen *m = ptr;
    int n = m->h.d.n_layers;
    if (cb_hybrid_setup(&m->h, hp, err, errlen)) return -1;
    if (!(m->ffns = calloc((size_t)n + 1, 1))) return cb_oom(err, errlen, "the layer kinds");
    for (int l = 0; l < n; l++) m->ffns[l] = (l + 1) % m->sparse_step ? 'D' : 'M';
    if (cb_hp_layer_indices("mlp_only_layers", m->mlp_only, n, 'D', m->ffns, err, errlen)) return -1;
    m->h.d.ffn_layers = m->ffns;
    return 0;
}

static void free_model(void *ptr) {
    qwen *m = ptr;
    cb_hybrid_free(&m->h);
    free(m->ffns);
}

static const cb_recipe RECIPE = {
    CB_HYBRID_RECIPE, .hparams = HPARAMS, .model_size = sizeof(qwen), .routed = CB_FFN_MOE, .setup = setup,
    .free_model = free_model, .shared_prefix = "model.layers.%d.mlp.shared_expert.",
    .shared_gate = "model.layers.%d.mlp.shared_expert_gate.weight",
};

static int qwen_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family qwen_family
    = {.name = "qwen", .load = qwen_load, .forward = cb_decoder_forward,
       .forward_batch = cb_decoder_forward_batch, .free = cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &qwen_family); }
