/* mla.h: multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, GLM-5, Kimi) over a COMPRESSED cache.
 *
 * Per token and layer the cache holds only the kv_a_layernorm'd latent (kv_lora_rank floats) and the shared
 * rotated key part (qk_rope_head_dim floats): row = [latent | k_rope], at column 0 of the slot's cb_kv row (a
 * family may keep more after it, e.g. the DSA indexer's key). Attention runs in the absorbed form: each head's
 * no-RoPE query is pulled through the key half of kv_b_proj into latent space (q_lat = W_UK^T q_nope), scores
 * are q_lat . latent + q_rope . k_rope, and the weighted sum of latents goes out through the value half of
 * kv_b_proj. That is the same arithmetic as expanding K and V per head, without ever materialising them.
 */
#ifndef COLIBRI_MLA_H
#define COLIBRI_MLA_H

#include <stddef.h>

#include "blocks.h"

typedef struct {
    int hidden, n_heads;
    int q_lora;                /* 0: a plain q_proj */
    int kv_lora, nope, rope, v_dim;
    int bias;                  /* attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj carry biases */
    float scale;               /* softmax scale, (nope + rope)^-0.5 unless YaRN rescales it */
    float lora_eps;            /* eps of q_a_layernorm / kv_a_layernorm */
} cb_mla_shape;

typedef struct {
    cb_mla_shape s;
    int max_batch, ctx;
    cb_linear q_proj, q_a, q_b, kv_a, kv_b, o;
    float *q_a_norm, *kv_a_norm, *bq_a, *bkv_a, *bo;
    /* scratch (rows up to max_batch) */
    float *q_resid;            /* n x q_lora: the normalised q latent (the DSA indexer reads it) */
    float *q;                  /* n x n_heads x (nope + rope) */
    float *ckv;                /* n x (kv_lora + rope) */
    float *att;                /* n x n_heads x v_dim */
    float *work;               /* per (row, head): ctx scores + 3 x kv_lora */
    int borrowed;              /* the scratch above is another layer's (cb_mla_share_scratch) */
} cb_mla;

/* prefix: the layer's attention prefix, e.g. "model.layers.3.self_attn." */
int cb_mla_init(cb_mla *m, const cb_st_index *idx, const char *prefix, const cb_mla_shape *s, int max_batch, int ctx,
                size_t *bytes, char *err, size_t errlen);
void cb_mla_free(cb_mla *m);
/* Point m's scratch at owner's and free m's own (same shape, max_batch and ctx, or nothing happens): a model's
 * layers attend one after another, so one set serves them all instead of n_layers x max_batch x n_heads x ctx. */
void cb_mla_share_scratch(cb_mla *m, const cb_mla *owner);

/* Project rows h[0..n) at positions pos0..: queries (RoPE'd) into m->q, m->q_resid, and the compressed key/value
 * row of each token into the cache (layer, pos0 + i), columns [0, kv_lora + rope). rope == NULL leaves the
 * "rope" part unrotated (Kimi Linear's MLA is NoPE: that part is an ordinary shared key). */
void cb_mla_project(cb_mla *m, const float *h, int n, int pos0, cb_kv *kv, int layer, const cb_rope *rope);

/* out[i] = o_proj(attention of row i). sel == NULL: every position <= pos0 + i. Otherwise row i attends exactly
 * to the n_sel[i] positions sel[i * sel_stride ..] (ascending, each <= pos0 + i). */
void cb_mla_attend(cb_mla *m, float *out, int n, int pos0, const cb_kv *kv, int layer, const int *sel,
                   const int *n_sel, int sel_stride);

#endif
