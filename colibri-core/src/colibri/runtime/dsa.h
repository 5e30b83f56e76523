/* dsa.h: the DeepSeek sparse attention (DSA) lightning indexer (DeepSeek-V3.2, GLM-5).
 *
 * Each token gets one index key k = LayerNorm(wk h) (with bias, eps 1e-6) and each query n_heads index queries
 * q = wq_b q_resid (q_resid: MLA's normalised q latent). The first rope_dim dims of both are RoPE'd with the
 * attention's frequencies, in INTERLEAVED pairs (GLM-5's convention in transformers; DeepSeek-V3.2 rotates
 * half-split pairs, so the pairing is a parameter). The score of key t for a query is
 *     sum_h w_h relu(q_h . k_t / sqrt(head_dim)),   w = weights_proj(h) / sqrt(n_heads)
 * and the query attends to its topk best-scoring positions (all of them when it has no more than topk).
 * Index keys live in the slot's cache row at a column the family chooses, so they come and go with the slot.
 */
#ifndef COLIBRI_DSA_H
#define COLIBRI_DSA_H

#include <stddef.h>

#include "blocks.h"

typedef struct {
    int hidden, q_lora, n_heads, head_dim, rope_dim, topk;
} cb_dsa_shape;

typedef struct {
    cb_dsa_shape s;
    int max_batch, ctx;
    cb_linear wq_b, wk, weights_proj;
    float *k_norm_w, *k_norm_b;
    float *q, *k, *w;          /* n x n_heads*head_dim, n x head_dim, n x n_heads */
    float *scores;             /* per row: ctx */
    int *heap;                 /* per row: topk */
    int borrowed;              /* q, k, w, scores and heap are another layer's (cb_dsa_share_scratch) */
} cb_dsa;

/* prefix: the indexer's prefix, e.g. "model.layers.3.self_attn.indexer." */
int cb_dsa_init(cb_dsa *x, const cb_st_index *idx, const char *prefix, const cb_dsa_shape *s, int max_batch, int ctx,
                size_t *bytes, char *err, size_t errlen);
void cb_dsa_free(cb_dsa *x);
/* Point x's scratch at owner's and free x's own (same shape, max_batch and ctx), as cb_mla_share_scratch: the
 * selection an indexer makes is the caller's (cb_latent_sel), not this scratch, so layers may share it. */
void cb_dsa_share_scratch(cb_dsa *x, const cb_dsa *owner);

/* Store the index keys of rows [0, n) (positions pos0..) at column `col` of the cache rows of `layer`, then pick
 * each row's positions: sel[i * s.topk ..] gets n_sel[i] positions in ascending order. rope must be interleaved
 * or half-split as the model wants (rope->neox). */
void cb_dsa_select(cb_dsa *x, const float *h, const float *q_resid, int n, int pos0, cb_kv *kv, int layer, int col,
                   const cb_rope *rope, int *sel, int *n_sel);

/* The selection step alone, for tests and reuse: the positions of the k best scores[0..n) (higher wins, ties
 * to the lower position), ascending, into out[]; returns how many (min(k, n)). heap holds k ints. */
int cb_dsa_top_positions(const float *scores, int n, int k, int *heap, int *out);

#endif
