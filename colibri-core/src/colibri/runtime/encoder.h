/* encoder.h: the pieces of a bidirectional (encoder) transformer over one whole sequence: LayerNorm, GELU and ReLU,
 * and self-attention in which every token sees every other (or those within a window), with or without RoPE.
 *
 * An encoder has no KV cache: each layer's keys depend on the whole sequence, so a sequence is computed at once
 * (cb_family.decide) and nothing of a previous one is reused. Each (row, head) is computed on its own, so the
 * thread split never changes a bit.
 */
#ifndef COLIBRI_ENCODER_H
#define COLIBRI_ENCODER_H

#include <stddef.h>

#include "blocks.h"

/* out = (x - mean) / sqrt(var + eps) * w + b over n values (w, b may be NULL: 1 and 0); out may equal x. */
void cb_layernorm(float *out, const float *x, const float *w, const float *b, int n, float eps);
/* x = 0.5 x (1 + erf(x / sqrt 2)) (the exact GELU, torch's default) / x = max(x, 0), for n values. */
void cb_gelu(float *x, size_t n);
void cb_relu(float *x, size_t n);

/* Self-attention of one layer over a whole sequence: a fused [3 * hidden, hidden] projection (queries, keys, values
 * stacked), optional biases, RoPE on queries and keys (rope NULL: none), softmax(q k^T / sqrt(head_dim)) v over the
 * keys with |i - j| <= window (window < 0: every key), then the output projection. */
typedef struct {
    int hidden, n_heads, head_dim;
    cb_linear qkv, out;
    float *qkv_bias, *out_bias;   /* NULL without biases */
} cb_enc_attn;

/* Scratch for cb_enc_attention over at most max_n rows. */
typedef struct {
    float *qkv, *att, *scores;
    int max_n, n_heads;
} cb_enc_scratch;

/* The shape of a's heads (its tensors are loaded by the family, e.g. from a cb_tensor_spec table): 0, or -1 when
 * hidden does not split into n_heads heads of at least 2. */
int cb_enc_attn_shape(cb_enc_attn *a, int hidden, int n_heads, char *err, size_t errlen);
int cb_enc_scratch_init(cb_enc_scratch *s, int max_n, int hidden, int n_heads, char *err, size_t errlen);
void cb_enc_scratch_free(cb_enc_scratch *s);

/* out = attention(h) for the n rows of the sequence (positions 0..n-1); out must not alias h. */
void cb_enc_attention(const cb_enc_attn *a, cb_enc_scratch *s, float *out, const float *h, int n, int window,
                      const cb_rope *rope);

#endif
