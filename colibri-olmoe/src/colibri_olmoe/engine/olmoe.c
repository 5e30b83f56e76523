/* olmoe.c: the OLMoE engine (OlmoeForCausalLM), a recipe over the runtime's decoder (decoder.h).
 *
 * Per layer:  x += o_proj(attention(rope(clip(q_norm(q_proj h))), rope(clip(k_norm(k_proj h))), clip(v_proj h)))
 *             x += moe(rmsnorm(x))                     with h = rmsnorm(x)
 * OLMoE's q_norm/k_norm are RMSNorms over the full projected width (all heads at once), not per head; the
 * router is a softmax over all experts, top-k, renormalised only when norm_topk_prob.
 */
#include <stdlib.h>

#include "decoder.h"
#include "engine.h"

typedef struct {
    float *q_norm, *k_norm;
    cb_qkvo p;                 /* biases only with attention_bias */
} olmoe_layer;

typedef struct {
    cb_decoder d;
    int n_heads, n_kv_heads, head_dim, attention_bias, qw, kw;
    float clip_qkv;            /* <= 0: no clamp */
    olmoe_layer *layers;
    cb_rope rope;
    cb_attn_shape attn;
    float *q, *k, *v, *qn, *kn, *att, *scores;   /* activations for max_batch rows */
} olmoe;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(olmoe, d, 1e-5), CB_DECODER_MOE_HPARAMS(olmoe, d),
    CB_HP_REQ("num_attention_heads", olmoe, n_heads), CB_HP_REQ("num_key_value_heads", olmoe, n_kv_heads),
    CB_HP_OPT("head_dim", olmoe, head_dim, 0, CB_HP_NONNEG), CB_HP_NUM("clip_qkv", olmoe, clip_qkv, 0, CB_HP_ANY),
    CB_HP_FLAG("attention_bias", olmoe, attention_bias, 0), CB_HP_END,
};

#define SA "model.layers.%d.self_attn."
static const cb_tensor_spec TENSORS[] = {
    CB_VECTOR(SA "q_norm.weight", olmoe_layer, q_norm, olmoe, qw),
    CB_VECTOR(SA "k_norm.weight", olmoe_layer, k_norm, olmoe, kw),
    CB_LINEAR(SA "q_proj.weight", olmoe_layer, p.wq, olmoe, qw, d.hidden),
    CB_LINEAR(SA "k_proj.weight", olmoe_layer, p.wk, olmoe, kw, d.hidden),
    CB_LINEAR(SA "v_proj.weight", olmoe_layer, p.wv, olmoe, kw, d.hidden),
    CB_LINEAR(SA "o_proj.weight", olmoe_layer, p.wo, olmoe, d.hidden, qw),
    CB_VECTOR_IF(SA "q_proj.bias", olmoe_layer, p.bq, olmoe, qw, attention_bias),
    CB_VECTOR_IF(SA "k_proj.bias", olmoe_layer, p.bk, olmoe, kw, attention_bias),
    CB_VECTOR_IF(SA "v_proj.bias", olmoe_layer, p.bv, olmoe, kw, attention_bias),
    CB_VECTOR_IF(SA "o_proj.bias", olmoe_layer, p.bo, olmoe, d.hidden, attention_bias),
    CB_TENSORS_END,
};

static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    olmoe *m = ptr;
    if (cb_attn_shape_init(&m->attn, m->d.hidden, m->n_heads, m->n_kv_heads, m->head_dim, err, errlen)) return -1;
    m->head_dim = m->attn.head_dim;
    m->qw = m->n_heads * m->head_dim;
    m->kw = m->n_kv_heads * m->head_dim;
    return cb_rope_init(&m->rope, hp, m->head_dim, 1, err, errlen);
}

static const cb_scratch_spec SCRATCH[] = {
    CB_SCRATCH(olmoe, q, qw, 1), CB_SCRATCH(olmoe, qn, qw, 1), CB_SCRATCH(olmoe, att, qw, 1),
    CB_SCRATCH(olmoe, k, kw, 1), CB_SCRATCH(olmoe, kn, kw, 1), CB_SCRATCH(olmoe, v, kw, 1), CB_SCRATCH_END,
};

static int finish(void *ptr, cb_model_info *info, char *err, size_t errlen) {
    olmoe *m = ptr;
    if (!(m->scores = cb_attn_scratch(m->d.max_batch, m->n_heads, m->d.ctx))) return cb_oom(err, errlen, "scores");
    info->kv_dim = m->kw;
    return 0;
}

/* Reads d->h, writes d->proj (decoder.h runs the norms, residuals, MoE and logits around it). */
static int attention(void *ptr, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen) {
    (void)err, (void)errlen;
    olmoe *m = ptr;
    olmoe_layer *L = &m->layers[l];
    int qw = m->qw, kw = m->kw;
    cb_qkv_apply(&L->p, m->q, m->k, m->v, m->d.h, n);
    for (int i = 0; i < n; i++) {
        float *q = m->qn + (size_t)i * qw, *k = m->kn + (size_t)i * kw;
        cb_rmsnorm(q, m->q + (size_t)i * qw, L->q_norm, qw, m->d.eps);
        cb_rmsnorm(k, m->k + (size_t)i * kw, L->k_norm, kw, m->d.eps);
        if (m->clip_qkv > 0) {
            cb_clamp(q, (size_t)qw, m->clip_qkv);
            cb_clamp(k, (size_t)kw, m->clip_qkv);
            cb_clamp(m->v + (size_t)i * kw, (size_t)kw, m->clip_qkv);
        }
        cb_rope_apply(&m->rope, q, m->n_heads, m->head_dim, pos0 + i);
        cb_rope_apply(&m->rope, k, m->n_kv_heads, m->head_dim, pos0 + i);
    }
    cb_kv_store(kv, l, pos0, n, m->kn, m->v);
    cb_attend(m->att, m->qn, kv, l, pos0, n, &m->attn, m->scores);
    cb_linear_apply(&L->p.wo, m->d.proj, m->att, n);
    cb_add_bias(m->d.proj, L->p.bo, n, m->d.hidden);
    return 0;
}

static void free_model(void *ptr) {
    olmoe *m = ptr;
    cb_rope_free(&m->rope);
    free(m->scores);
}

static const cb_recipe RECIPE = {
    .hparams = HPARAMS, .model_size = sizeof(olmoe), .layer_size = sizeof(olmoe_layer),
    .layers_at = offsetof(olmoe, layers), .tensors = TENSORS, .scratch = SCRATCH, .routed = CB_FFN_MOE,
    .setup = setup, .finish = finish, .mixer = attention, .free_model = free_model,
};

static int olmoe_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family olmoe_family
    = {.name = "olmoe", .load = olmoe_load, .forward = cb_decoder_forward,
       .forward_batch = cb_decoder_forward_batch, .free = cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &olmoe_family); }
