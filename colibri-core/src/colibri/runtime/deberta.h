/* deberta.h: the DeBERTa-v2/v3 encoder as a block (transformers' DebertaV2Model): a bidirectional post-LayerNorm
 * transformer whose attention adds disentangled relative-position terms to the content term.
 *
 *     x = LayerNorm(word[t] (+ position[i]) (+ token_type[0]), then embed_proj when embedding_size != hidden)
 *     per layer:  a = LayerNorm(x + O attend(x));   x = LayerNorm(a + W2 gelu(W1 a))
 *     attend: score(i, j) = [q_i.k_j + c2p: q_i.pk[d(i, j)] + p2c: k_j.pq[d'(i, j)]] / sqrt(head_dim * factor)
 *
 * with pk / pq the key / query projections of the (LayerNorm'd) relative embeddings (share_att_key: the layer's own
 * key_proj / query_proj, else pos_key_proj / pos_query_proj), d(i, j) = clamp(bucket(i - j) + span, 0, 2 span - 1)
 * and d'(i, j) = clamp(-bucket(j - i) + span, ...), bucket the log-bucketed relative position when
 * position_buckets > 0, and factor = 1 + (c2p) + (p2c). The whole sequence is one forward pass: no KV cache, every
 * position sees every other.
 *
 * Hyperparameters (--set, config.json's names): hidden_size, num_hidden_layers, num_attention_heads,
 * intermediate_size, vocab_size, layer_norm_eps, embedding_size, type_vocab_size, position_biased_input,
 * max_position_embeddings, relative_attention, position_buckets, max_relative_positions, share_att_key,
 * pos_att_type ("c2p|p2c"), norm_rel_ebd ("layer_norm" or "none").
 */
#ifndef COLIBRI_DEBERTA_H
#define COLIBRI_DEBERTA_H

#include <stddef.h>

#include "blocks.h"
#include "hparams.h"
#include "safetensors.h"

typedef struct {
    int hidden, n_layers, n_heads, head_dim, inter, vocab, embedding_size;
    int type_vocab_size, position_biased_input, max_positions;
    int relative, share_att_key, c2p, p2c, position_buckets, max_relative, norm_rel;
    float eps;
    const char *pos_att_type, *norm_rel_ebd;
} cb_deberta_config;

typedef struct {
    cb_linear q, k, v, o, up, down, pos_k, pos_q;    /* pos_k / pos_q: only without share_att_key */
    float *bq, *bk, *bv, *bo, *b_up, *b_down, *b_pos_k, *b_pos_q;
    float *ln_attn_w, *ln_attn_b, *ln_out_w, *ln_out_b;
} cb_deberta_layer;

typedef struct {
    cb_deberta_config c;
    int span;                  /* relative embeddings: 2 span rows */
    cb_linear word, position, token_type, embed_proj;
    float *ln_w, *ln_b;
    float *rel;                /* [2 span, hidden], LayerNorm'd once at load when norm_rel_ebd says so */
    cb_deberta_layer *layers;
} cb_deberta;

/* Read the hyperparameters above: 0, or -1 with a message naming the --set key. */
int cb_deberta_config_read(cb_deberta_config *c, cb_hparams *hp, char *err, size_t errlen);
/* Load the encoder's weights under `prefix` (e.g. "encoder.": prefix + "embeddings.word_embeddings.weight", ...),
 * adding their bytes to *bytes. 0, or -1 with a message naming the tensor. */
int cb_deberta_load(cb_deberta *m, const cb_deberta_config *c, const cb_st_index *idx, const char *prefix,
                    size_t *bytes, char *err, size_t errlen);
void cb_deberta_free(cb_deberta *m);
/* out[n x hidden] = the last hidden states of tokens[0..n) (one unpadded sequence). 0, or -1 (out of memory). */
int cb_deberta_forward(const cb_deberta *m, const int *tokens, int n, float *out, char *err, size_t errlen);

#endif
