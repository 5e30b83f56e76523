/* kda.h: Kimi Delta Attention (Kimi Linear's linear-attention token mixer). A gated delta rule like deltanet.h,
 * but the forget gate decays every KEY CHANNEL separately instead of a whole head at once. Per sequence and layer
 * it keeps a fixed-size state:
 *
 *   conv window  [3 * width][kernel - 1]   the last kernel-1 inputs of the q, k and v short convolutions
 *   memory S     [n_heads][head_dim][head_dim]
 *
 * width = n_heads * head_dim. For each token, given the family's projections x = [q | k | v] (3 * width),
 * f = f_b(f_a(h)) (width), b = b_proj(h) (n_heads) and g = g_b(g_a(h)) (width):
 *   q, k, v = silu(causal_conv1d(x));  q, k = l2norm(q), l2norm(k) per head;  q /= sqrt(head_dim)
 *   decay[i] = exp(-exp(A_log[h]) * softplus(f[i] + dt_bias[i]))     one per key channel i of head h
 *   beta = sigmoid(b[h]);  S[i][:] *= decay[i];  S += k (beta (v - S^T k))^T;  o = S^T q
 *   out = rmsnorm(o) * o_norm * sigmoid(g)       (per head, over head_dim)
 * Keys and values share head_dim. An all-zero state is the empty sequence, so a slot resets by zeroing it.
 */
#ifndef COLIBRI_KDA_H
#define COLIBRI_KDA_H

#include <stddef.h>

#include "blocks.h"

typedef struct {
    int n_heads, head_dim, kernel;
    float eps;                 /* of the gated output RMSNorm */
} cb_kda_config;

typedef struct {
    cb_kda_config c;
    int width;                 /* n_heads * head_dim */
    float *conv_w;             /* [3 * width][kernel]: the q, k, v convolutions stacked */
    float *neg_A;              /* -exp(A_log), n_heads */
    float *dt_bias;            /* width */
    float *norm;               /* head_dim */
} cb_kda;

/* Floats of one sequence's state for one layer (conv window + memory). */
size_t cb_kda_state_floats(const cb_kda_config *c);

/* Checks the geometry; loads "<prefix>{q,k,v}_conv1d.weight" [width, 1, kernel] each, "<prefix>A_log" (n_heads
 * values, stored [1, 1, n_heads, 1] or [n_heads]), "<prefix>dt_bias" [width] and "<prefix>o_norm.weight". */
int cb_kda_init(cb_kda *d, const cb_st_index *idx, const char *prefix, const cb_kda_config *c, size_t *dense_bytes,
                char *err, size_t errlen);
void cb_kda_free(cb_kda *d);

/* Run n tokens in order on `state` (advanced in place). x: n x 3 * width and f: n x width, both overwritten
 * (scratch); b: n x n_heads; g: n x width; out: n x width. */
void cb_kda_forward(const cb_kda *d, float *state, float *out, float *x, float *f, const float *b, const float *g,
                    int n);

#endif
