/* deltanet.h: the Gated DeltaNet token mixer (linear attention with a delta-rule recurrent state), as in
 * Qwen3-Next and Qwen3.5. Per sequence it keeps a fixed-size state instead of a growing KV cache:
 *
 *   conv window  [conv_dim][kernel - 1]     the last kernel-1 inputs of the depthwise causal conv1d
 *   memory S     [n_v_heads][k_dim][v_dim]  the delta-rule associative memory
 *
 * For each token, given the projected x = [q | k | v] (conv_dim), z (n_v_heads * v_dim), b and a (n_v_heads):
 *   q, k, v = silu(causal_conv1d(x));  q, k = l2norm(q), l2norm(k);  q /= sqrt(k_dim)
 *   beta = sigmoid(b);  decay = exp(-exp(A_log) * softplus(a + dt_bias))
 *   per value head h (its key head is h / (n_v_heads / n_k_heads)):
 *     S *= decay;  S += k (beta (v - S^T k))^T;  o = S^T q
 *   out = rmsnorm(o) * norm_weight * silu(z)       (per head, over v_dim)
 * The projections in and out are the family's (their layouts differ between checkpoints). An all-zero state is
 * the empty sequence, so a slot's state is reset by zeroing it.
 */
#ifndef COLIBRI_DELTANET_H
#define COLIBRI_DELTANET_H

#include <stddef.h>

#include "blocks.h"

#define CB_DELTANET_MAX_KERNEL 16
#define CB_DELTANET_MAX_VDIM 1024

typedef struct {
    int n_k_heads, n_v_heads, k_dim, v_dim, kernel;
    float eps;                 /* of the gated RMSNorm */
} cb_deltanet_config;

typedef struct {
    cb_deltanet_config c;
    int conv_dim;              /* 2 * n_k_heads * k_dim + n_v_heads * v_dim */
    float *conv_w;             /* [conv_dim][kernel] */
    float *neg_A;              /* -exp(A_log), n_v_heads */
    float *dt_bias;            /* n_v_heads */
    float *norm;               /* v_dim */
} cb_deltanet;

/* Floats of one sequence's state for one layer (conv window + memory). */
size_t cb_deltanet_state_floats(const cb_deltanet_config *c);

/* Checks the geometry; loads "<prefix>conv1d.weight" [conv_dim, 1, kernel], "<prefix>A_log", "<prefix>dt_bias"
 * and "<prefix>norm.weight". */
int cb_deltanet_init(cb_deltanet *d, const cb_st_index *idx, const char *prefix, const cb_deltanet_config *c,
                     size_t *dense_bytes, char *err, size_t errlen);
void cb_deltanet_free(cb_deltanet *d);

/* Run n tokens in order on `state` (advanced in place). x: n x conv_dim, overwritten; z: n x (n_v_heads * v_dim);
 * b, a: n x n_v_heads; out: n x (n_v_heads * v_dim). */
void cb_deltanet_forward(const cb_deltanet *d, float *state, float *out, float *x, const float *z, const float *b,
                         const float *a, int n);

/* ---- the pieces Kimi Delta Attention (kda.h) shares with this block ---- */

/* torch.nn.functional.softplus with its default threshold: linear above 20. */
float cb_softplus(float x);
/* x /= sqrt(sum x^2 + 1e-6), the FLA l2norm both linear attentions apply to q and k. */
void cb_l2norm(float *x, int n);
/* Depthwise causal conv1d + silu over n rows of `channels` (x: n x channels, in place). w: [channels][kernel];
 * window: [channels][kernel - 1], the previous inputs, advanced in place. kernel <= CB_DELTANET_MAX_KERNEL. */
void cb_short_conv_silu(const float *w, int channels, int kernel, float *window, float *x, int n);
/* One delta-rule step of one head's memory S [dk][dv]: row i of S decays by decay[i * decay_stride] (stride 0: one
 * decay for the whole head), then S += k (beta (v - S^T k))^T, and o = S^T q. dv <= CB_DELTANET_MAX_VDIM. */
void cb_delta_rule_step(float *S, int dk, int dv, const float *decay, int decay_stride, const float *k,
                        const float *v, float beta, const float *q, float *o);

#endif
