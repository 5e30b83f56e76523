/* router.h: DeepSeek-V3-style grouped sigmoid routing (GLM-4.5+, DeepSeek-V3, Kimi K2).
 *
 * scores = sigmoid(router logits). Selection uses scores + e_score_correction_bias (the bias balances load and
 * never enters the weights): experts form n_group equal groups, a group scores the sum of its best two biased
 * scores, the topk_group best groups stay eligible, and the top_k best biased scores among their experts win.
 * The weights are the chosen experts' UNBIASED scores, renormalised to sum 1 when norm_topk_prob, times
 * routed_scaling_factor.
 */
#ifndef COLIBRI_ROUTER_H
#define COLIBRI_ROUTER_H

#include <stddef.h>

typedef struct {
    int n_experts, top_k, n_group, topk_group, norm_topk_prob;
    float scaling;             /* routed_scaling_factor */
    const float *bias;         /* e_score_correction_bias [n_experts], or NULL for none */
} cb_grouped_router;

/* Check the geometry (groups divide the experts, >= 2 experts per group when grouping, top_k fits in the kept
 * groups); 0 or -1 with a message naming the hyperparameter. */
int cb_grouped_router_check(const cb_grouped_router *r, char *err, size_t errlen);

/* Choose top_k experts for one row from its n_experts router logits: idx[top_k] in descending biased score
 * (ties: lowest index), w[top_k] their weights. scratch holds 2 * (n_experts + n_group) floats. */
void cb_grouped_route(const cb_grouped_router *r, const float *logits, int *idx, float *w, float *scratch);

#endif
