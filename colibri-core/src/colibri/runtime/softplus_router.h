/* softplus_router.h: DeepSeek-V4 routing: sqrt(softplus) scores, chosen either by top-k of the scores plus a
 * selection-only bias, or by a fixed token -> experts table (hash routing, the first layers).
 *
 * Either way the weights are the chosen experts' unbiased scores, renormalised to sum 1 (+1e-20) and multiplied
 * by routed_scaling_factor. softplus follows torch (beta 1, threshold 20: x itself above 20).
 */
#ifndef COLIBRI_SOFTPLUS_ROUTER_H
#define COLIBRI_SOFTPLUS_ROUTER_H

#include <stdint.h>

float cb_sqrtsoftplus(float x);

/* logits[n_experts] -> idx[top_k] (descending biased score, ties: lowest index), w[top_k].
 * bias may be NULL. scores: scratch of n_experts floats. */
void cb_sqrtsoftplus_route(const float *logits, const float *bias, int n_experts, int top_k, float scaling,
                           int *idx, float *w, float *scores);
/* Hash routing: the experts are table[top_k] (one row of tid2eid), weights from logits as above. */
void cb_hash_route(const float *logits, const int32_t *table, int top_k, float scaling, int *idx, float *w);

#endif
