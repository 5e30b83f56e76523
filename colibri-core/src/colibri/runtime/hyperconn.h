/* hyperconn.h: manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is hc parallel streams.
 *
 * Before each block the streams X[hc][hidden] give three weights through one linear map of their flattened,
 * RMS-normalised concatenation:  pre[hc] = sigmoid(.) + eps collapses the streams into the block input,
 * post[hc] = 2 sigmoid(.) spreads the block output back, and comb[hc][hc] = softmax rows + eps projected onto
 * doubly-stochastic matrices by Sinkhorn-Knopp mixes the old streams in:
 *
 *     input = sum_j pre[j] X[j];        X'[k] = post[k] y + sum_j comb[j][k] X[j]
 *
 * The model's final head uses only a "pre" (cb_hc_head_weights). Everything is f32, in transformers' order.
 */
#ifndef COLIBRI_HYPERCONN_H
#define COLIBRI_HYPERCONN_H

typedef struct {
    int hc, hidden, sinkhorn_iters;
    float norm_eps;            /* the RMS norm over the flattened streams (rms_norm_eps) */
    float hc_eps;              /* added to pre and comb, and the Sinkhorn denominators' floor */
} cb_hc_shape;

/* Scratch floats cb_hc_weights / cb_hc_head_weights need. */
int cb_hc_scratch_floats(const cb_hc_shape *s);

/* fn: [(2 + hc) * hc, hc * hidden] f32, base: [(2 + hc) * hc], scale: [3]. X: hc * hidden. */
void cb_hc_weights(const cb_hc_shape *s, const float *fn, const float *base, const float *scale, const float *X,
                   float *pre, float *post, float *comb, float *scratch);
/* fn: [hc, hc * hidden], base: [hc], scale: [1]; pre[hc]. */
void cb_hc_head_weights(const cb_hc_shape *s, const float *fn, const float *base, const float *scale,
                        const float *X, float *pre, float *scratch);
/* out[d] = sum_j pre[j] X[j][d]. */
void cb_hc_collapse(float *out, const float *X, const float *pre, int hc, int hidden);
/* X[k][d] = post[k] y[d] + sum_j comb[j][k] X_old[j][d], in place; tmp holds hc * hidden floats. */
void cb_hc_expand(float *X, const float *y, const float *post, const float *comb, int hc, int hidden, float *tmp);

#endif
