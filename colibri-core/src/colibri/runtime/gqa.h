/* gqa.h: grouped-query self-attention with a KV cache, in the variants Qwen-style families use:
 * optional q/k/v (and o) biases, optional per-head RMSNorm of q and k (weights stored as w or, for zero-centred
 * norms, as w - 1), RoPE (full or partial, from a cb_rope), and an optional sigmoid output gate that q_proj
 * produces alongside the query ([query(head_dim), gate(head_dim)] per head, as Qwen3-Next's gated attention).
 *
 *   q, k, v = proj(h) (+ bias);  q, k = rope(norm_per_head(q, k));  a = attend(q, KV);  out = o_proj(a * sigmoid(g))
 *
 * Scratch is shared by every layer of a model (one cb_gqa_scratch sized for the widest layer).
 */
#ifndef COLIBRI_GQA_H
#define COLIBRI_GQA_H

#include <stddef.h>

#include "blocks.h"

typedef struct {
    int hidden, n_heads, n_kv_heads, head_dim;
    int qkv_bias;              /* q_proj/k_proj/v_proj have biases */
    int o_bias;                /* o_proj has a bias */
    int head_norm;             /* q_norm / k_norm: RMSNorm over each head's head_dim values */
    int norm_offset;           /* those norm weights are stored zero-centred: the scale is 1 + w */
    int output_gate;           /* q_proj is [n_heads * 2 * head_dim]: per head the query, then its gate */
    float eps;                 /* RMSNorm epsilon */
} cb_gqa_config;

typedef struct {
    cb_gqa_config c;
    cb_linear wq, wk, wv, wo;
    float *bq, *bk, *bv, *bo;  /* NULL without biases */
    float *q_norm, *k_norm;    /* head_dim scales (1 + w already added), NULL without head_norm */
} cb_gqa;

typedef struct {
    float *qg, *q, *gate, *k, *v, *att, *scores;
} cb_gqa_scratch;

/* Tensors: "<prefix>{q,k,v,o}_proj.weight", "<prefix>{q,k,v,o}_proj.bias", "<prefix>{q,k}_norm.weight". */
int cb_gqa_init(cb_gqa *a, const cb_st_index *idx, const char *prefix, const cb_gqa_config *c, size_t *dense_bytes,
                char *err, size_t errlen);
void cb_gqa_free(cb_gqa *a);

int cb_gqa_scratch_init(cb_gqa_scratch *s, const cb_gqa_config *c, int max_batch, int ctx, char *err, size_t errlen);
void cb_gqa_scratch_free(cb_gqa_scratch *s);

/* out[i] (hidden) for rows h[0..n) at positions pos0..; stores their K/V in layer kv_layer of the slot's cache. */
void cb_gqa_forward(const cb_gqa *a, cb_gqa_scratch *s, float *out, const float *h, int n, cb_kv *kv, int kv_layer,
                    int pos0, const cb_rope *rope);

#endif
