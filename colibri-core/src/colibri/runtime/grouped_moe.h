/* grouped_moe.h: the DeepSeek-V3-style MoE block: grouped sigmoid routing (router.h) over streamed experts
 * (cb_moe's store) plus optional always-on shared experts (one SwiGLU of n_shared x expert width).
 *
 *     out = sum_k w_k expert_k(x) + shared(x)
 */
#ifndef COLIBRI_GROUPED_MOE_H
#define COLIBRI_GROUPED_MOE_H

#include <stddef.h>

#include "blocks.h"
#include "router.h"
#include "swiglu.h"

typedef struct {
    cb_moe moe;                /* router matrix, expert store, scratch */
    cb_grouped_router route;
    float *bias;               /* e_score_correction_bias, owned */
    int has_shared;
    cb_swiglu shared;
    float *route_scratch, *shared_out;
} cb_grouped_moe;

typedef struct {
    int n_experts, top_k, n_group, topk_group, norm_topk_prob, n_shared;
    float routed_scaling_factor;
    int hidden, inter;         /* inter: one routed expert's width (shared experts: n_shared x inter) */
    const char *const *expert_mats;   /* an expert's gate, up, down matrix names under experts.<e>. (NULL:
                                       * gate_proj, up_proj, down_proj; Kimi Linear: w1, w3, w2) */
} cb_grouped_moe_shape;

/* prefix_fmt: the MLP prefix as a printf format of the layer, e.g. "model.layers.%d.mlp."; reads
 * <prefix>gate.weight, <prefix>gate.e_score_correction_bias (when has_bias),
 * <prefix>experts.<e>.<expert_mats>.weight and <prefix>shared_experts.* (when n_shared > 0). */
int cb_grouped_moe_init(cb_grouped_moe *m, const cb_st_index *idx, int layer, const char *prefix_fmt,
                        const cb_grouped_moe_shape *s, int has_bias, int cap, int max_batch, size_t *dense_bytes,
                        char *err, size_t errlen);
void cb_grouped_moe_free(cb_grouped_moe *m);
int cb_grouped_moe_forward(cb_grouped_moe *m, float *out, const float *x, int n, char *err, size_t errlen);

#endif
