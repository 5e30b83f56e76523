/* laya.c: Laya decision models (the `laya` package): a ModernBERT encoder and Laya's typed decision head.
 *
 *     x = LayerNorm(embed(tokens))                                             the encoder (ModernBERT)
 *     per layer:  x += attn(LayerNorm(x))     full attention with the global RoPE theta, or (every layer not a
 *                                             multiple of global_attn_every_n_layers) |i - j| <= window with the
 *                                             local theta; layer 0 has no attention norm
 *                 x += Wo(gelu(a) * g), [a, g] = Wi(LayerNorm(x))                 GeGLU
 *     x = LayerNorm(x) + type_emb[question type]                               the head: pre-norm transformer
 *     per head layer:  x += attn(LayerNorm(x));  x += linear2(relu(linear1(LayerNorm(x))))     layers, biased
 *     score(row) = Linear(gelu(Linear(LayerNorm(x[row]))))                     at each option's [MASK]
 *
 * A question is one sequence ([CLS] question [SEP] [MASK] option ... [SEP] state [SEP], built by the plugin);
 * it arrives as a decide whose marks are the options' [MASK] positions (+1) and whose option at each mark is the
 * question type (0 choice, 1 score, 2 noul), whose score the head gives there. The encoder is bidirectional, so
 * the engine answers decides only, each computed whole (cb_family.decide).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decoder.h"
#include "encoder.h"
#include "engine.h"

#define N_TYPES 3              /* laya.common.QTYPES: choice 0, score 1, noul 2 */
#define HEAD_EPS 1e-5f         /* torch's TransformerEncoderLayer and the scorer's LayerNorm keep their default */

typedef struct {
    cb_enc_attn attn;
    float *attn_norm, *attn_norm_b, *mlp_norm, *mlp_norm_b;
    cb_linear wi, wo;
    float *wi_b, *wo_b;
} enc_layer;

typedef struct {
    cb_enc_attn attn;
    float *norm1, *norm1_b, *norm2, *norm2_b;
    cb_linear lin1, lin2;
    float *lin1_b, *lin2_b;
} head_layer;

typedef struct {
    cb_decoder d;              /* names the declared tensors; holds the index, hidden size, layers and vocab */
    int n_heads, inter, inter2, qkv_rows, norm_bias, attention_bias, mlp_bias, window, types, one;
    int head_layers, head_heads, head_inter, head_qkv;
    float global_theta, local_theta;
    const char *kinds;         /* per encoder layer: F full attention, S sliding window */
    char *normed;              /* per encoder layer: N where it has an attention norm (all but the first) */
    const char *head_kinds;    /* per head layer: H */
    enc_layer *layers;
    head_layer *head;
    float *emb_norm, *emb_norm_b, *final_norm, *final_norm_b, *type_emb;
    float *sc_norm, *sc_norm_b, *sc1_b, *sc2_b;
    cb_linear sc1, sc2;
    cb_rope global_rope, local_rope;
    int max_n;
    cb_enc_scratch scratch;
    float *enc, *x, *h, *proj, *mlp, *row;
} laya_model;

static const cb_hp_spec HPARAMS[] = {
    CB_HP_REQ("hidden_size", laya_model, d.hidden), CB_HP_REQ("num_hidden_layers", laya_model, d.n_layers),
    CB_HP_REQ("vocab_size", laya_model, d.vocab), CB_HP_REQ("num_attention_heads", laya_model, n_heads),
    CB_HP_REQ("intermediate_size", laya_model, inter),
    CB_HP_NUM("norm_eps", laya_model, d.eps, 1e-5, CB_HP_POSITIVE),
    CB_HP_FLAG("norm_bias", laya_model, norm_bias, 0), CB_HP_FLAG("attention_bias", laya_model, attention_bias, 0),
    CB_HP_FLAG("mlp_bias", laya_model, mlp_bias, 0),
    CB_HP_PER_LAYER("layer_types", laya_model, kinds, "FS", d.n_layers),
    CB_HP_OPT("sliding_window", laya_model, window, 64, CB_HP_NONNEG),
    CB_HP_NUM("global_rope_theta", laya_model, global_theta, 160000.0, CB_HP_POSITIVE),
    CB_HP_NUM("local_rope_theta", laya_model, local_theta, 10000.0, CB_HP_POSITIVE),
    CB_HP_OPT("head_layers", laya_model, head_layers, 0, CB_HP_NONNEG),
    CB_HP_REQ("head_heads", laya_model, head_heads),
    CB_HP_END,
};

#define VEC_IF_ON(name, f, flag) \
    {name, CB_TENSOR_VECTOR, offsetof(enc_layer, f), offsetof(laya_model, d.hidden), 0, offsetof(laya_model, flag), \
     offsetof(laya_model, normed), "N"}
#define E "encoder.layers.%d."
static const cb_tensor_spec ENCODER_LAYER[] = {
    CB_VECTOR_ON(E "attn_norm.weight", enc_layer, attn_norm, laya_model, d.hidden, normed, "N"),
    VEC_IF_ON(E "attn_norm.bias", attn_norm_b, norm_bias),
    CB_LINEAR(E "attn.Wqkv.weight", enc_layer, attn.qkv, laya_model, qkv_rows, d.hidden),
    CB_VECTOR_IF(E "attn.Wqkv.bias", enc_layer, attn.qkv_bias, laya_model, qkv_rows, attention_bias),
    CB_LINEAR(E "attn.Wo.weight", enc_layer, attn.out, laya_model, d.hidden, d.hidden),
    CB_VECTOR_IF(E "attn.Wo.bias", enc_layer, attn.out_bias, laya_model, d.hidden, attention_bias),
    CB_VECTOR(E "mlp_norm.weight", enc_layer, mlp_norm, laya_model, d.hidden),
    CB_VECTOR_IF(E "mlp_norm.bias", enc_layer, mlp_norm_b, laya_model, d.hidden, norm_bias),
    CB_LINEAR(E "mlp.Wi.weight", enc_layer, wi, laya_model, inter2, d.hidden),
    CB_VECTOR_IF(E "mlp.Wi.bias", enc_layer, wi_b, laya_model, inter2, mlp_bias),
    CB_LINEAR(E "mlp.Wo.weight", enc_layer, wo, laya_model, d.hidden, inter),
    CB_VECTOR_IF(E "mlp.Wo.bias", enc_layer, wo_b, laya_model, d.hidden, mlp_bias),
    CB_TENSORS_END,
};
#undef E
#define H "head.layers.%d."
static const cb_tensor_spec HEAD_LAYER[] = {
    CB_LINEAR(H "self_attn.in_proj_weight", head_layer, attn.qkv, laya_model, head_qkv, d.hidden),
    CB_VECTOR(H "self_attn.in_proj_bias", head_layer, attn.qkv_bias, laya_model, head_qkv),
    CB_LINEAR(H "self_attn.out_proj.weight", head_layer, attn.out, laya_model, d.hidden, d.hidden),
    CB_VECTOR(H "self_attn.out_proj.bias", head_layer, attn.out_bias, laya_model, d.hidden),
    CB_VECTOR(H "norm1.weight", head_layer, norm1, laya_model, d.hidden),
    CB_VECTOR(H "norm1.bias", head_layer, norm1_b, laya_model, d.hidden),
    CB_VECTOR(H "norm2.weight", head_layer, norm2, laya_model, d.hidden),
    CB_VECTOR(H "norm2.bias", head_layer, norm2_b, laya_model, d.hidden),
    CB_LINEAR(H "linear1.weight", head_layer, lin1, laya_model, head_inter, d.hidden),
    CB_VECTOR(H "linear1.bias", head_layer, lin1_b, laya_model, head_inter),
    CB_LINEAR(H "linear2.weight", head_layer, lin2, laya_model, d.hidden, head_inter),
    CB_VECTOR(H "linear2.bias", head_layer, lin2_b, laya_model, d.hidden),
    CB_TENSORS_END,
};
#undef H
static const cb_tensor_spec MODEL[] = {
    CB_LINEAR("encoder.embeddings.tok_embeddings.weight", laya_model, d.embed, laya_model, d.vocab, d.hidden),
    CB_VECTOR("encoder.embeddings.norm.weight", laya_model, emb_norm, laya_model, d.hidden),
    CB_VECTOR_IF("encoder.embeddings.norm.bias", laya_model, emb_norm_b, laya_model, d.hidden, norm_bias),
    CB_VECTOR("encoder.final_norm.weight", laya_model, final_norm, laya_model, d.hidden),
    CB_VECTOR_IF("encoder.final_norm.bias", laya_model, final_norm_b, laya_model, d.hidden, norm_bias),
    CB_TABLE("type_emb.weight", laya_model, type_emb, laya_model, types, d.hidden),
    CB_VECTOR("scorer.0.weight", laya_model, sc_norm, laya_model, d.hidden),
    CB_VECTOR("scorer.0.bias", laya_model, sc_norm_b, laya_model, d.hidden),
    CB_LINEAR("scorer.1.weight", laya_model, sc1, laya_model, d.hidden, d.hidden),
    CB_VECTOR("scorer.1.bias", laya_model, sc1_b, laya_model, d.hidden),
    CB_LINEAR("scorer.3.weight", laya_model, sc2, laya_model, one, d.hidden),
    CB_VECTOR("scorer.3.bias", laya_model, sc2_b, laya_model, one),
    CB_TENSORS_END,
};

static void laya_free(void *model) {
    laya_model *m = model;
    if (!m) return;
    for (int l = 0; m->layers && l < m->d.n_layers; l++) cb_free_tensors(&m->layers[l], ENCODER_LAYER);
    for (int l = 0; m->head && l < m->head_layers; l++) cb_free_tensors(&m->head[l], HEAD_LAYER);
    cb_free_tensors(m, MODEL);
    cb_rope_free(&m->global_rope);
    cb_rope_free(&m->local_rope);
    cb_enc_scratch_free(&m->scratch);
    void *owned[] = {m->layers, m->head, m->normed, m->enc, m->x, m->h, m->proj, m->mlp, m->row};
    for (size_t i = 0; i < sizeof owned / sizeof *owned; i++) free(owned[i]);
    cb_st_close(&m->d.idx);
    free(m);
}

/* ModernBERT's RoPE: every dimension of a head rotates, rotate_half pairs, 1 / theta^(2i / head_dim) in f32. */
static int rope_of(cb_rope *r, float theta, int head_dim) {
    *r = (cb_rope){1, head_dim, malloc((size_t)(head_dim / 2) * sizeof(float)), 1.0f};
    if (!r->inv_freq) return -1;
    for (int i = 0; i < head_dim / 2; i++) r->inv_freq[i] = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
    return 0;
}

static int setup(laya_model *m, const cb_load_args *a, char *err, size_t errlen) {
    int D = m->d.hidden, n = m->d.n_layers;
    m->qkv_rows = 3 * D;
    m->inter2 = 2 * m->inter;
    m->head_inter = 4 * D;     /* laya builds nn.TransformerEncoderLayer(d, nhead, 4 * d) */
    m->head_qkv = 3 * D;
    m->types = N_TYPES;
    m->one = 1;
    m->max_n = a->ctx;
    if (!(m->normed = malloc((size_t)n + 1))) return cb_oom(err, errlen, "the layer table");
    for (int l = 0; l < n; l++) m->normed[l] = l ? 'N' : '-';
    m->normed[n] = 0;
    int hd = D / m->n_heads;   /* n_heads >= 1: a required key */
    if (D % m->n_heads || hd % 2) {
        snprintf(err, errlen, "--set num_attention_heads=%d: %d dimensions split into no even heads", m->n_heads, D);
        return -1;
    }
    if (rope_of(&m->global_rope, m->global_theta, hd) || rope_of(&m->local_rope, m->local_theta, hd))
        return cb_oom(err, errlen, "the rotary tables");
    int heads = m->n_heads > m->head_heads ? m->n_heads : m->head_heads;
    int widest = m->inter2 > m->head_inter ? m->inter2 : m->head_inter;
    size_t rows = (size_t)m->max_n * (size_t)D;
    m->enc = malloc(rows * sizeof(float));
    m->x = malloc(rows * sizeof(float));
    m->h = malloc(rows * sizeof(float));
    m->proj = malloc(rows * sizeof(float));
    m->mlp = malloc((size_t)m->max_n * (size_t)widest * sizeof(float));
    m->row = malloc((size_t)2 * (size_t)D * sizeof(float));
    if (!m->enc || !m->x || !m->h || !m->proj || !m->mlp || !m->row) return cb_oom(err, errlen, "the activations");
    return cb_enc_scratch_init(&m->scratch, m->max_n, D, heads, err, errlen);
}

static int laya_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    laya_model *m = calloc(1, sizeof *m);
    if (!m) return cb_oom(err, errlen, "the model");
    *out = NULL;
    size_t bytes = 0;
    if (cb_hp_read(a->hp, HPARAMS, m, err, errlen) || cb_st_open(&m->d.idx, a->model_dir, err, errlen)) goto fail;
    m->layers = calloc((size_t)m->d.n_layers, sizeof *m->layers);
    m->head = calloc((size_t)(m->head_layers ? m->head_layers : 1), sizeof *m->head);
    if (!m->layers || !m->head) {
        cb_oom(err, errlen, "the layers");
        goto fail;
    }
    if (setup(m, a, err, errlen) || cb_load_tensors(m, m, MODEL, 0, &m->d.idx, &bytes, err, errlen)) goto fail;
    for (int l = 0; l < m->d.n_layers; l++)
        if (cb_enc_attn_shape(&m->layers[l].attn, m->d.hidden, m->n_heads, err, errlen) ||
            cb_load_tensors(&m->layers[l], m, ENCODER_LAYER, l, &m->d.idx, &bytes, err, errlen))
            goto fail;
    for (int l = 0; l < m->head_layers; l++)
        if (cb_enc_attn_shape(&m->head[l].attn, m->d.hidden, m->head_heads, err, errlen) ||
            cb_load_tensors(&m->head[l], m, HEAD_LAYER, l, &m->d.idx, &bytes, err, errlen))
            goto fail;
    info->vocab = m->d.vocab;
    info->outputs = N_TYPES;   /* a decide's option at a mark is the question type whose score the head gives */
    info->dense_bytes = bytes;
    *out = m;
    return 0;
fail:
    laya_free(m);
    return -1;
}

/* m->enc = the encoder's last hidden states of tokens[0..n). */
static void encode(laya_model *m, const int *tokens, int n) {
    int D = m->d.hidden;
    float eps = m->d.eps;
    for (int i = 0; i < n; i++) {
        float *x = m->x + (size_t)i * (size_t)D;
        cb_embed(x, &m->d.embed, tokens[i]);
        cb_layernorm(x, x, m->emb_norm, m->emb_norm_b, D, eps);
    }
    for (int l = 0; l < m->d.n_layers; l++) {
        const enc_layer *L = &m->layers[l];
        int local = m->kinds[l] == 'S';
        for (int i = 0; i < n; i++) {
            const float *x = m->x + (size_t)i * (size_t)D;
            float *h = m->h + (size_t)i * (size_t)D;
            if (L->attn_norm) cb_layernorm(h, x, L->attn_norm, L->attn_norm_b, D, eps);
            else memcpy(h, x, (size_t)D * sizeof(float));
        }
        cb_enc_attention(&L->attn, &m->scratch, m->proj, m->h, n, local ? m->window : -1,
                         local ? &m->local_rope : &m->global_rope);
        cb_add(m->x, m->proj, (size_t)n * (size_t)D);
        for (int i = 0; i < n; i++)
            cb_layernorm(m->h + (size_t)i * D, m->x + (size_t)i * D, L->mlp_norm, L->mlp_norm_b, D, eps);
        cb_linear_apply(&L->wi, m->mlp, m->h, n);
        cb_add_bias(m->mlp, L->wi_b, n, m->inter2);
        for (int i = 0; i < n; i++) {   /* GeGLU: gelu(input) * gate, packed into the first inter of each row */
            float *in = m->mlp + (size_t)i * (size_t)m->inter2, *gate = in + m->inter;
            cb_gelu(in, (size_t)m->inter);
            for (int k = 0; k < m->inter; k++) m->mlp[(size_t)i * (size_t)m->inter + k] = in[k] * gate[k];
        }
        cb_linear_apply(&L->wo, m->proj, m->mlp, n);
        cb_add_bias(m->proj, L->wo_b, n, D);
        cb_add(m->x, m->proj, (size_t)n * (size_t)D);
    }
    for (int i = 0; i < n; i++)
        cb_layernorm(m->enc + (size_t)i * D, m->x + (size_t)i * D, m->final_norm, m->final_norm_b, D, eps);
}

/* m->x = the head's output over the encoded rows for question type t. */
static void head(laya_model *m, int t, int n) {
    int D = m->d.hidden;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < D; k++) m->x[(size_t)i * D + k] = m->enc[(size_t)i * D + k] + m->type_emb[t * D + k];
    for (int l = 0; l < m->head_layers; l++) {
        const head_layer *L = &m->head[l];
        for (int i = 0; i < n; i++)
            cb_layernorm(m->h + (size_t)i * D, m->x + (size_t)i * D, L->norm1, L->norm1_b, D, HEAD_EPS);
        cb_enc_attention(&L->attn, &m->scratch, m->proj, m->h, n, -1, NULL);
        cb_add(m->x, m->proj, (size_t)n * (size_t)D);
        for (int i = 0; i < n; i++)
            cb_layernorm(m->h + (size_t)i * D, m->x + (size_t)i * D, L->norm2, L->norm2_b, D, HEAD_EPS);
        cb_linear_apply(&L->lin1, m->mlp, m->h, n);
        cb_add_bias(m->mlp, L->lin1_b, n, m->head_inter);
        cb_relu(m->mlp, (size_t)n * (size_t)m->head_inter);
        cb_linear_apply(&L->lin2, m->proj, m->mlp, n);
        cb_add_bias(m->proj, L->lin2_b, n, D);
        cb_add(m->x, m->proj, (size_t)n * (size_t)D);
    }
}

/* The scorer at one row of the head's output. */
static float score(laya_model *m, int row) {
    int D = m->d.hidden;
    float *y = m->row, *z = m->row + D, s;
    cb_layernorm(y, m->x + (size_t)row * D, m->sc_norm, m->sc_norm_b, D, HEAD_EPS);
    cb_linear_apply(&m->sc1, z, y, 1);
    cb_add_bias(z, m->sc1_b, 1, D);
    cb_gelu(z, (size_t)D);
    cb_linear_apply(&m->sc2, &s, z, 1);
    return s + m->sc2_b[0];
}

static int laya_decide(void *model, const int *tokens, int n, cb_decide *d, char *err, size_t errlen) {
    laya_model *m = model;
    int used[N_TYPES] = {0};
    for (int k = 0; k < d->first_option[d->n_marks]; k++) used[d->options[k]] = 1;   /* in [0, N_TYPES): outputs */
    if (n > m->max_n) {
        snprintf(err, errlen, "a prompt of %d tokens exceeds the context of %d", n, m->max_n);
        return -1;
    }
    encode(m, tokens, n);
    for (int t = 0; t < N_TYPES; t++) {
        if (!used[t]) continue;
        head(m, t, n);
        for (int i = 0; i < d->n_marks; i++)
            for (int k = d->first_option[i]; k < d->first_option[i + 1]; k++)
                if (d->options[k] == t) d->scores[k] = score(m, d->rows[i]);
    }
    return 0;
}

static const cb_family LAYA = {.name = "laya", .load = laya_load, .free = laya_free, .decide = laya_decide};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &LAYA); }
